"""ComfyUI's VAE weights -> the diffusers model PatchRay shards (family, diffusers config, diffusers state dict).

Design decision: PatchRay shards *diffusers* VAE modules (one adapter code path, tested in CI without ComfyUI), so
the decode/encode nodes rebuild ComfyUI's VAE as the diffusers model. This module holds the ComfyUI knowledge of
that step, so ``distributed/`` holds none: the key layout of the state dict ComfyUI keeps
(``vae.first_stage_model.state_dict()``, the original released "ldm" layout, because ``comfy.sd.VAE`` converts
diffusers files *to* that layout on load), how ComfyUI tells VAE families apart (``comfy.sd.VAE.__init__``) and
ComfyUI's fixed GroupNorm width. It never imports ComfyUI: it reads a plain state dict.

The key maps come from diffusers' own single-file converters (``diffusers.loaders.single_file_utils``); the config
is inferred from tensor shapes; and every conversion is *checked* by the library
(:func:`patchray.distributed.vae.convert.check_state_dict`): the converted keys and shapes must equal those of the
diffusers model built from the inferred config. A state dict that does not match raises ``UnsupportedVaeError``
naming the first differences, instead of producing a model with silently missing weights.

Families:

* ``kl`` -- SD1.x/SD2.x/SDXL (with ``quant_conv``/``post_quant_conv``) and FLUX.1 ``ae`` (without), any width.
* ``wan`` -- Wan 2.1 VAE (``AutoencoderKLWan``).
* everything else ComfyUI can load (Wan 2.2, HunyuanVideo/-1.5, Hunyuan image, LTX-Video, Mochi, Cosmos,
  Stable Cascade, TAESD, audio VAEs, ...) raises ``UnsupportedVaeError`` with the reason; the decode node
  then falls back to ComfyUI's own decode and says so.
"""

from __future__ import annotations

import re
from typing import Dict, Mapping, NamedTuple

import torch

from ...distributed.vae.convert import UnsupportedVaeError, check_state_dict

__all__ = ["ConvertedVae", "UnsupportedVaeError", "detect_family", "convert_comfy_vae"]


class ConvertedVae(NamedTuple):
    """Result of :func:`convert_comfy_vae`.

    Args:
        family: the PatchRay family key (``"kl"``, ``"wan"``), a key of ``distributed.vae.families.FAMILIES``.
        diffusers_class: the diffusers class name the config is for.
        config: keyword arguments for ``diffusers_class(**config)``.
        state_dict: the diffusers-layout state dict (tensors shared with the input, not copied).
    """

    family: str
    diffusers_class: str
    config: dict
    state_dict: Dict[str, torch.Tensor]


#: ComfyUI hard-codes GroupNorm(32) in its KL encoder/decoder (``comfy/ldm/modules/diffusionmodules/model.py``)
_COMFY_KL_GROUPS = 32


def _indices(sd: Mapping[str, torch.Tensor], pattern: str) -> list:
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in sd for m in [rx.match(k)] if m})


def detect_family(sd: Mapping[str, torch.Tensor]) -> str:
    """Name the VAE family of a ComfyUI (ldm-layout) VAE state dict, or raise :class:`UnsupportedVaeError`.

    The sniffing follows ``comfy.sd.VAE.__init__`` so the same file gets the same verdict here as there.
    """
    keys = set(sd)
    if not keys:
        raise UnsupportedVaeError("the VAE has no weights (pixel-space or empty VAE): nothing to shard")
    if "decoder.middle.0.residual.0.gamma" in keys:
        if "decoder.upsamples.0.upsamples.0.residual.2.weight" in keys:
            raise UnsupportedVaeError("Wan 2.2 VAE (48 latent channels) has no diffusers converter in PatchRay yet")
        return "wan"
    if "decoder.conv_in.weight" in keys and "decoder.mid.block_1.mix_factor" not in keys:
        up = _indices(sd, r"decoder\.up\.(\d+)\.upsample\.conv\.weight")
        for i in up:
            w = sd[f"decoder.up.{i}.upsample.conv.weight"]
            if w.shape[0] != w.shape[1]:
                # Hunyuan image/video-1.5 decoders upsample by pixel shuffle (conv to 4x channels)
                raise UnsupportedVaeError("Hunyuan-style VAE (pixel-shuffle upsampling) is not supported by PatchRay yet")
        if "decoder.mid.attn_1.q.weight" not in keys and "decoder.mid.attn_1.qkv.weight" in keys:
            raise UnsupportedVaeError("this KL-type VAE uses fused qkv attention, which PatchRay does not map")
        return "kl"
    if "decoder.mid.block_1.mix_factor" in keys:
        raise UnsupportedVaeError("the temporal (SVD) KL decoder is not supported by PatchRay")
    if "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight" in keys:
        raise UnsupportedVaeError("LTX-Video VAE: PatchRay has no converter from ComfyUI's layout yet")
    if any(k.startswith("taesd_") for k in keys):
        raise UnsupportedVaeError("TAESD is a tiny preview VAE; decode it with the stock node")
    raise UnsupportedVaeError(
        "unrecognised VAE layout (PatchRay shards KL (SD/SDXL/FLUX.1) and Wan 2.1 VAEs); first keys: "
        + ", ".join(sorted(keys)[:4])
    )


def _kl_config(sd: Mapping[str, torch.Tensor], norm_num_groups: int) -> dict:
    ups = _indices(sd, r"decoder\.up\.(\d+)\.block\.0\.conv2\.weight")
    if not ups:
        raise UnsupportedVaeError("KL VAE without decoder.up.* blocks")
    block_out = [int(sd[f"decoder.up.{i}.block.0.conv2.weight"].shape[0]) for i in ups]
    if "encoder.down.0.block.0.conv1.weight" in sd:
        layers = len(_indices(sd, r"encoder\.down\.0\.block\.(\d+)\.conv1\.weight"))
    else:  # decoder levels hold one more resnet than encoder levels
        layers = len(_indices(sd, r"decoder\.up\.0\.block\.(\d+)\.conv1\.weight")) - 1
    n = len(block_out)
    return dict(
        in_channels=int(sd["encoder.conv_in.weight"].shape[1]) if "encoder.conv_in.weight" in sd else 3,
        out_channels=int(sd["decoder.conv_out.weight"].shape[0]),
        down_block_types=["DownEncoderBlock2D"] * n,
        up_block_types=["UpDecoderBlock2D"] * n,
        block_out_channels=block_out,
        layers_per_block=layers,
        latent_channels=int(sd["decoder.conv_in.weight"].shape[1]),
        norm_num_groups=norm_num_groups,
        use_quant_conv="quant_conv.weight" in sd,
        use_post_quant_conv="post_quant_conv.weight" in sd,
        mid_block_add_attention="decoder.mid.attn_1.q.weight" in sd,
    )


def _convert_kl(sd: Mapping[str, torch.Tensor], norm_num_groups: int):
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    config = _kl_config(sd, norm_num_groups)
    new = convert_ldm_vae_checkpoint(dict(sd), config)
    return "AutoencoderKL", config, new


def _wan_config(sd: Mapping[str, torch.Tensor]) -> dict:
    base_dim = int(sd["decoder.head.2.weight"].shape[1]) if "decoder.head.2.weight" in sd else None
    if base_dim is None:
        raise UnsupportedVaeError("Wan VAE without decoder.head: cannot infer its width")
    z_dim = int(sd["conv2.weight"].shape[0]) if "conv2.weight" in sd else int(sd["decoder.conv1.weight"].shape[1])
    # encoder.downsamples holds, per level, num_res_blocks residual blocks then one resample (not on the last level)
    n_down = len(_indices(sd, r"encoder\.downsamples\.(\d+)\."))
    n_res_total = len(_indices(sd, r"encoder\.downsamples\.(\d+)\.residual\.0\.gamma"))
    levels = 4  # dim_mult (1, 2, 4, 4) is fixed in both the released model and diffusers' default
    resamples = n_down - n_res_total
    if resamples != levels - 1 or n_res_total % levels:
        raise UnsupportedVaeError(f"Wan VAE with an unexpected encoder layout ({n_down} down modules)")
    return dict(base_dim=base_dim, z_dim=z_dim, num_res_blocks=n_res_total // levels)


def _convert_wan(sd: Mapping[str, torch.Tensor]):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    config = _wan_config(sd)
    new = convert_wan_vae_to_diffusers(dict(sd))
    return "AutoencoderKLWan", config, new


def convert_comfy_vae(sd: Mapping[str, torch.Tensor], norm_num_groups: int = _COMFY_KL_GROUPS) -> ConvertedVae:
    """Convert a ComfyUI VAE state dict to the diffusers model PatchRay shards.

    Args:
        sd: ``vae.first_stage_model.state_dict()`` of a ``comfy.sd.VAE`` (ldm / released key layout).
        norm_num_groups: GroupNorm groups of KL VAEs (weights do not record it; ComfyUI always uses 32).

    Returns:
        :class:`ConvertedVae` ``(family, diffusers_class, config, state_dict)``; the tensors are the input's.

    Raises:
        UnsupportedVaeError: the family has no converter, or the converted weights do not fit the model.

    Example:
        >>> conv = convert_comfy_vae(vae.first_stage_model.state_dict())  # doctest: +SKIP
        >>> model = diffusers.AutoencoderKL(**conv.config); model.load_state_dict(conv.state_dict)  # doctest: +SKIP
    """
    family = detect_family(sd)
    if family == "kl":
        class_name, config, new = _convert_kl(sd, norm_num_groups)
    else:
        class_name, config, new = _convert_wan(sd)
    check_state_dict(class_name, config, new)
    return ConvertedVae(family, class_name, config, new)
