"""Hunyuan VAEs ComfyUI loads (``comfy.sd.VAE.__init__``), each checked against the diffusers class it converts to.

* HunyuanImage-2.1's 64-channel 32x VAE (``comfy/ldm/hunyuan_video/vae.py``, detected by a 64-channel
  ``decoder.conv_in.weight``) -> diffusers ``AutoencoderKLHunyuanImage`` (family ``hunyuan_image``): the same ops
  (GroupNorm(32) resnets, pixel-(un)shuffle resamplers with their channel-averaging / repeating shortcuts,
  single-head mid attention, the mean-of-groups encoder shortcut and the repeat decoder shortcut), the same zero
  padding, 4-D latents.
* HunyuanImage-2.1's refiner VAE (``comfy/ldm/hunyuan_video/vae_refiner.py`` with ``refiner_vae=True``, detected by a
  32-channel ``decoder.conv_in.conv.weight``) -> diffusers ``AutoencoderKLHunyuanImageRefiner`` (family
  ``hunyuan_image_refiner``): the same causal replicate-padded convolutions, RMS norms, DCAE resamplers and mid
  attention over all tokens. ComfyUI treats it as an image VAE (``not_video``): one frame in, one latent frame out,
  which its encoder packs to 64 channels (the 32-channel mean twice: the first frame repeated, then frames folded
  pairwise into channels) and its decoder unpacks (the second half). diffusers' class has no such packing and
  no temporal resampling, and both agree exactly on one frame: :data:`REFINER_LATENTS` does the packing, and a
  latent of more than one frame is refused (ComfyUI would resample it in time).
* The 32-channel plain-``Conv3d`` variant of ``vae_refiner.py`` (``refiner_vae=False``, detected by a 5-D
  32-channel ``decoder.conv_in.weight``): the refiner's modules with zero-padded, non-causal 3-D convolutions,
  GroupNorm(32) instead of RMS norms and resamplers that treat every frame alike, which no diffusers class
  computes. It converts to the derived class ``AutoencoderKLHunyuanImageRefinerConv3d`` (family
  ``hunyuan_refiner_conv3d``, ``distributed/vae/variants.py``) through the refiner's key map. ComfyUI treats it as
  an image VAE (``not_video``): one frame in (repeated to four before encoding), one latent frame, one frame out;
  a latent of more than one frame is refused (:data:`CONV3D_LATENTS`).
* HunyuanVideo's 3-D KL autoencoder (ComfyUI's ``AutoencoderKL`` with ``conv3d=True``, detected by
  ``decoder.conv_in.conv.weight``): the same causal replicate-padded convolutions, GroupNorm(32) resnets, first-frame
  aware nearest upsampling and replicate-padded strided downsampling as diffusers' ``AutoencoderKLHunyuanVideo``,
  but ComfyUI runs the mid-block attention over all frames at once (diffusers masks it frame-causally) and decodes a
  whole clip in one call (diffusers tiles clips of more than four latent frames in time). It converts to the
  derived class ``AutoencoderKLHunyuanVideoFullAttention`` (family ``hunyuan_video_full_attention``,
  ``distributed/vae/variants.py``), which changes exactly those two steps.

Key maps: diffusers has no single-file converter for these layouts; ComfyUI keeps the released ``down.{i}.block.{j}``
/ ``up.{i}.block.{j}`` / ``mid.block_1, attn_1, block_2`` names, mapped here level by level.
"""

from __future__ import annotations

import re
from typing import Dict, Mapping, NamedTuple

import torch

from ....distributed.vae.convert import UnsupportedVaeError
from .table import LayoutRow, indices, refuse

__all__ = ["ROWS", "LatentLayout", "REFINER_LATENTS", "CONV3D_LATENTS"]

_LTX_KEY = "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight"
_MOCHI_KEYS = ("blocks.2.blocks.3.stack.5.weight", "decoder.blocks.2.blocks.3.stack.5.weight")


class LatentLayout(NamedTuple):
    """How ComfyUI's LATENT / IMAGE for a VAE differ from what the diffusers model takes and returns.

    Args:
        to_library: ComfyUI's latent -> the diffusers model's latent (raises ``ValueError`` for one it cannot map).
        from_library: the diffusers encoder's latent mean -> ComfyUI's latent.
        images_are_batch: a 5-D VAE that ComfyUI feeds images as a batch of one-frame clips (``not_video``),
            not as the frames of one clip.
    """

    to_library: object
    from_library: object
    images_are_batch: bool = False


def _refiner_to_library(z: torch.Tensor) -> torch.Tensor:
    if z.dim() != 5 or z.shape[1] % 2:
        raise ValueError(f"the HunyuanImage refiner VAE takes [B, 64, 1, h, w] latents; got shape {tuple(z.shape)}")
    if z.shape[2] != 1:
        raise ValueError(
            f"the HunyuanImage refiner VAE decodes one latent frame per image in PatchRay; this latent has "
            f"{z.shape[2]} frames: decode it with the stock VAE Decode"
        )
    # ComfyUI's decoder unfolds the channel pairs into frames and drops the first: one frame keeps the second half
    return z[:, z.shape[1] // 2 :]


def _refiner_from_library(mean: torch.Tensor) -> torch.Tensor:
    # ComfyUI's encoder repeats the first frame, then folds frame pairs into channels: [m, m] for one frame
    return torch.cat([mean, mean], dim=1)


#: ComfyUI's latent packing of the refiner VAE (``vae_refiner.Encoder/Decoder`` with ``refiner_vae=True``)
REFINER_LATENTS = LatentLayout(_refiner_to_library, _refiner_from_library, images_are_batch=True)


def _conv3d_to_library(z: torch.Tensor) -> torch.Tensor:
    if z.dim() != 5 or z.shape[2] != 1:
        raise ValueError(
            f"the 32-channel plain-Conv3d Hunyuan VAE decodes one latent frame per image in PatchRay; got shape "
            f"{tuple(z.shape)}: decode it with the stock VAE Decode"
        )
    return z


#: the plain-Conv3d variant (``refiner_vae=False``): an image VAE whose latent passes through, one frame per image
CONV3D_LATENTS = LatentLayout(_conv3d_to_library, lambda mean: mean, images_are_batch=True)


# ------------------------------------------------------------------------------------------ key maps


def _renamed(sd: Mapping[str, torch.Tensor], prefix_map: Dict[str, str], leaf_map: Dict[str, str] = None) -> dict:
    """``sd`` with every key under a ``prefix_map`` prefix renamed (longest prefix first; ``leaf_map`` renames
    parts of the rest); any key left unmapped is an error."""
    leaf_map = leaf_map or {}
    out, unmapped = {}, []
    for key, tensor in sd.items():
        for old in sorted(prefix_map, key=len, reverse=True):
            if key.startswith(old):
                rest = key[len(old) :]
                for a, b in leaf_map.items():
                    rest = rest.replace(a, b)
                out[prefix_map[old] + rest] = tensor
                break
        else:
            unmapped.append(key)
    if unmapped:
        raise UnsupportedVaeError(f"keys PatchRay does not map for this VAE: {sorted(unmapped)[:4]}")
    return out


def _levels(sd, half: str, stage: str):
    """``[(level, [block indices], has_resampler)]`` of ComfyUI's ``{half}.{stage}.{i}.block.{j}`` layout."""
    resample = "downsample" if stage == "down" else "upsample"
    levels = []
    for i in indices(sd, rf"{half}\.{stage}\.(\d+)\.block\.0\."):
        blocks = indices(sd, rf"{half}\.{stage}\.{i}\.block\.(\d+)\.")
        has = any(k.startswith(f"{half}.{stage}.{i}.{resample}.") for k in sd)
        levels.append((i, blocks, has))
    if not levels:
        raise UnsupportedVaeError(f"no {half}.{stage}.* blocks")
    return levels


def _mid_map(half: str, target: str, attn_leaves: Dict[str, str]) -> Dict[str, str]:
    m = {
        f"{half}.mid.block_1.": f"{half}.{target}.resnets.0.",
        f"{half}.mid.block_2.": f"{half}.{target}.resnets.1.",
    }
    for a, b in attn_leaves.items():
        m[f"{half}.mid.attn_1.{a}."] = f"{half}.{target}.attentions.0.{b}."
    return m


_ATTN_2D = {"norm": "norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "proj"}
_ATTN_REFINER = {"norm": "norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "proj_out"}
_COMMON = ("conv_in.", "conv_out.", "norm_out.")


def _widths(sd, half: str, stage: str, levels) -> list:
    conv = ".conv1.conv.weight" if f"{half}.{stage}.{levels[0][0]}.block.0.conv1.conv.weight" in sd else ".conv1.weight"
    return [int(sd[f"{half}.{stage}.{i}.block.0{conv}"].shape[0]) for i, _, _ in levels]


# --------------------------------------------------------------------------- HunyuanImage-2.1 (32x, 2-D)


def _is_hunyuan_image(sd) -> bool:
    w = sd.get("decoder.conv_in.weight")
    return w is not None and w.ndim == 4 and w.shape[1] == 64


def _convert_hunyuan_image(sd: Mapping[str, torch.Tensor], **_):
    if any(".nin_shortcut." in k for k in sd):
        # diffusers' HunyuanImageResnetBlock applies its shortcut conv to the residual branch, not the input
        raise UnsupportedVaeError("HunyuanImage VAE with a width-changing resnet, which diffusers' class does not compute as ComfyUI")
    down, up = _levels(sd, "encoder", "down"), _levels(sd, "decoder", "up")
    widths = _widths(sd, "encoder", "down", down)
    if list(reversed(widths)) != _widths(sd, "decoder", "up", up):
        raise UnsupportedVaeError(f"HunyuanImage VAE whose encoder and decoder widths differ ({widths})")
    n_resample = sum(has for _, _, has in down)
    prefix = {f"{h}.{k}": f"{h}.{k}" for h in ("encoder", "decoder") for k in _COMMON}
    for half, stage, levels, target in (("encoder", "down", down, "down_blocks"), ("decoder", "up", up, "up_blocks")):
        flat = 0
        for i, blocks, has in levels:
            for j in blocks:
                prefix[f"{half}.{stage}.{i}.block.{j}."] = f"{half}.{target}.{flat}."
                flat += 1
            if has:
                resample = "downsample" if stage == "down" else "upsample"
                prefix[f"{half}.{stage}.{i}.{resample}.conv."] = f"{half}.{target}.{flat}.conv."
                flat += 1
        prefix.update(_mid_map(half, "mid_block", _ATTN_2D))
    config = dict(
        in_channels=int(sd["encoder.conv_in.weight"].shape[1]),
        out_channels=int(sd["decoder.conv_out.weight"].shape[0]),
        latent_channels=int(sd["decoder.conv_in.weight"].shape[1]),
        block_out_channels=tuple(widths),
        layers_per_block=len(down[0][1]),
        spatial_compression_ratio=2**n_resample,
        sample_size=384,
    )
    return "AutoencoderKLHunyuanImage", config, _renamed(sd, prefix)


# ------------------------------------------------------------------ HunyuanImage-2.1 refiner (16x, 3-D)


def _is_refiner(sd) -> bool:
    w = sd.get("decoder.conv_in.conv.weight")
    return w is not None and w.shape[1] == 32 and _LTX_KEY not in sd


def _convert_refiner(sd: Mapping[str, torch.Tensor], **_):
    down, up = _levels(sd, "encoder", "down"), _levels(sd, "decoder", "up")
    widths = _widths(sd, "encoder", "down", down)
    n_resample = sum(has for _, _, has in down)
    prefix = {f"{h}.{k}": f"{h}.{k}" for h in ("encoder", "decoder") for k in _COMMON}
    for half, stage, levels, target, resample, res_target in (
        ("encoder", "down", down, "down_blocks", "downsample", "downsamplers"),
        ("decoder", "up", up, "up_blocks", "upsample", "upsamplers"),
    ):
        for i, blocks, has in levels:
            prefix[f"{half}.{stage}.{i}.block."] = f"{half}.{target}.{i}.resnets."
            if has:
                prefix[f"{half}.{stage}.{i}.{resample}."] = f"{half}.{target}.{i}.{res_target}.0."
        prefix.update(_mid_map(half, "mid_block", _ATTN_REFINER))
    config = dict(
        in_channels=int(sd["encoder.conv_in.conv.weight"].shape[1]),
        out_channels=int(sd["decoder.conv_out.conv.weight"].shape[0]),
        latent_channels=int(sd["decoder.conv_in.conv.weight"].shape[1]),
        block_out_channels=tuple(widths),
        layers_per_block=len(down[0][1]),
        spatial_compression_ratio=2**n_resample,
        temporal_compression_ratio=4,  # ComfyUI's ffactor_temporal; the resamplers' shapes are checked against it
    )
    # ResnetBlock's 1x1 shortcut is a VideoConv3d (``.conv.``) in ComfyUI, a bare Conv3d in diffusers
    out = _renamed(sd, prefix, {"nin_shortcut.conv.": "conv_shortcut."})
    return "AutoencoderKLHunyuanImageRefiner", config, out


def _is_plain_conv3d_refiner(sd) -> bool:
    w = sd.get("decoder.conv_in.weight")
    return w is not None and w.ndim == 5 and w.shape[1] == 32


_CONV3D_LEAF = re.compile(r"^(.*\.(?:conv_in|conv_out|conv1|conv2|conv|nin_shortcut))\.(weight|bias)$")


def _convert_plain_conv3d_refiner(sd: Mapping[str, torch.Tensor], **_):
    """The refiner's key map, after naming each plain ``Conv3d`` as the refiner's wrapped one (``x.conv.weight``)."""
    wrapped = {}
    for key, tensor in sd.items():
        m = _CONV3D_LEAF.match(key)
        wrapped[f"{m.group(1)}.conv.{m.group(2)}" if m and tensor.ndim in (1, 5) and ".attn_1." not in key else key] = tensor
    _, config, out = _convert_refiner(wrapped)
    if any(k.endswith(".gamma") for k in out):
        raise UnsupportedVaeError("a 32-channel Conv3d Hunyuan VAE with RMS norms, which ComfyUI's class does not build")
    return "AutoencoderKLHunyuanImageRefinerConv3d", config, out


def _pixel_shuffle_kl(sd) -> bool:
    """A 2-D KL-style VAE with pixel-shuffle upsampling that is not HunyuanImage's 64-channel one."""
    if "decoder.conv_in.weight" not in sd or "decoder.mid.block_1.mix_factor" in sd:
        return False
    for k, w in sd.items():
        if k.startswith("decoder.up.") and k.endswith(".upsample.conv.weight") and w.shape[0] != w.shape[1]:
            return True
    return False


def _is_hunyuan_video(sd) -> bool:
    return "decoder.conv_in.conv.weight" in sd and _LTX_KEY not in sd and not any(k in sd for k in _MOCHI_KEYS)


_ATTN_KL = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _convert_hunyuan_video(sd: Mapping[str, torch.Tensor], *, norm_num_groups: int = 32, **_):
    down, up = _levels(sd, "encoder", "down"), _levels(sd, "decoder", "up")
    widths = _widths(sd, "encoder", "down", down)
    n = len(widths)
    if len(up) != n:
        raise UnsupportedVaeError(f"HunyuanVideo VAE with {n} encoder levels but {len(up)} decoder levels")
    prefix = {f"{h}.conv_in.": f"{h}.conv_in." for h in ("encoder", "decoder")}
    prefix.update({f"{h}.conv_out.": f"{h}.conv_out." for h in ("encoder", "decoder")})
    prefix.update({f"{h}.norm_out.": f"{h}.conv_norm_out." for h in ("encoder", "decoder")})
    prefix.update({"quant_conv.": "quant_conv.", "post_quant_conv.": "post_quant_conv."})
    for i, _, _ in down:
        prefix[f"encoder.down.{i}.block."] = f"encoder.down_blocks.{i}.resnets."
        prefix[f"encoder.down.{i}.downsample."] = f"encoder.down_blocks.{i}.downsamplers.0."
    for i, _, _ in up:  # ComfyUI numbers the decoder levels from the full resolution, diffusers from the latent
        prefix[f"decoder.up.{i}.block."] = f"decoder.up_blocks.{n - 1 - i}.resnets."
        prefix[f"decoder.up.{i}.upsample."] = f"decoder.up_blocks.{n - 1 - i}.upsamplers.0."
    for half in ("encoder", "decoder"):
        prefix.update(_mid_map(half, "mid_block", _ATTN_KL))
    new = _renamed(sd, prefix, {"nin_shortcut.": "conv_shortcut."})
    for key in list(new):
        if ".attentions.0.to_" in key and key.endswith(".weight"):
            new[key] = new[key].reshape(new[key].shape[0], -1)  # 1x1x1 Conv3d -> Linear
    config = dict(
        in_channels=int(sd["encoder.conv_in.conv.weight"].shape[1]),
        out_channels=int(sd["decoder.conv_out.conv.weight"].shape[0]),
        latent_channels=int(sd["decoder.conv_in.conv.weight"].shape[1]),
        down_block_types=("HunyuanVideoDownBlock3D",) * n,
        up_block_types=("HunyuanVideoUpBlock3D",) * n,
        block_out_channels=tuple(widths),
        layers_per_block=len(down[0][1]),
        norm_num_groups=norm_num_groups,
        spatial_compression_ratio=2 ** (n - 1),
        temporal_compression_ratio=4,  # ComfyUI's time_compress; the resamplers' shapes are checked against it
    )
    return "AutoencoderKLHunyuanVideoFullAttention", config, new


ROWS = [
    LayoutRow("HunyuanImage-2.1 VAE", "hunyuan_image", _is_hunyuan_image, _convert_hunyuan_image),
    LayoutRow("HunyuanImage-2.1 refiner VAE", "hunyuan_image_refiner", _is_refiner, _convert_refiner, latents=REFINER_LATENTS),
    LayoutRow("32-channel 16x Hunyuan VAE (plain Conv3d)", "hunyuan_refiner_conv3d", _is_plain_conv3d_refiner,
              _convert_plain_conv3d_refiner, latents=CONV3D_LATENTS),
    LayoutRow("HunyuanVideo VAE", "hunyuan_video_full_attention", _is_hunyuan_video, _convert_hunyuan_video),
    refuse(
        "Hunyuan-style pixel-shuffle VAE",
        _pixel_shuffle_kl,
        "Hunyuan-style VAE (pixel-shuffle upsampling) without HunyuanImage-2.1's 64 latent channels: ComfyUI "
        "and PatchRay only know the 64-channel one",
    ),
]
