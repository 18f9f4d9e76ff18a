"""The Cosmos tokenizer VAE ComfyUI loads (``comfy/ldm/cosmos/vae.py``, ``CausalContinuousVideoTokenizer``: NVIDIA's
CV8x8x8 continuous video tokenizer) -> the diffusers ``AutoencoderKLCosmos`` layout, built as
``AutoencoderKLCosmosLatentStats`` (family ``cosmos``, ``distributed/vae/variants.py``).

The modules are the same (factorised causal convolutions ``conv_s`` + ``conv_t``, per-frame GroupNorm(1),
spatial and temporal attention, Haar wavelet patching, hybrid resamplers); ComfyUI's factorised convolutions are
``nn.Sequential`` pairs of ``conv3d`` wrappers, its decoder levels are numbered from the image side (diffusers' from
the latent side), and its model normalises the latent itself with ``latent_mean`` / ``latent_std`` and
``sigma_data``, which the derived class does as well. ComfyUI detects the layout by ``decoder.unpatcher3d.wavelets``,
a constant that the state dict of the loaded model no longer holds; the model's own keys are matched here.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from ....distributed.vae.convert import UnsupportedVaeError
from .table import LayoutRow, indices

__all__ = ["ROWS"]

_RESOLUTION = 1024  # ComfyUI's ddconfig; attention resolutions are read from the weights against it
_COMFY_ATTENTION = 32  # ComfyUI's ddconfig attn_resolutions

_RENAMES = [
    (r"\.conv3d\.", "."),
    (r"(conv_in|conv_out|conv1|conv2)\.0\.", r"\1.conv_s."),
    (r"(conv_in|conv_out|conv1|conv2)\.1\.", r"\1.conv_t."),
    (r"nin_shortcut\.", "conv_shortcut."),
    (r"\.downsample\.", ".downsamplers.0."),
    (r"\.upsample\.", ".upsamplers.0."),
    (r"\.(down|up)\.(\d+)\.block\.", r".\1_blocks.\2.resnets."),
    (r"\.(down|up)\.(\d+)\.attn\.(\d+)\.0\.", r".\1_blocks.\2.attentions.\3."),
    (r"\.(down|up)\.(\d+)\.attn\.(\d+)\.1\.", r".\1_blocks.\2.temp_attentions.\3."),
    (r"\.(down|up)\.(\d+)\.", r".\1_blocks.\2."),
    (r"\.mid\.block_1\.", ".mid_block.resnets.0."),
    (r"\.mid\.block_2\.", ".mid_block.resnets.1."),
    (r"\.mid\.attn_1\.0\.", ".mid_block.attentions.0."),
    (r"\.mid\.attn_1\.1\.", ".mid_block.temp_attentions.0."),
    (r"\.q\.(weight|bias)$", r".to_q.\1"),
    (r"\.k\.(weight|bias)$", r".to_k.\1"),
    (r"\.v\.(weight|bias)$", r".to_v.\1"),
    (r"\.proj_out\.(weight|bias)$", r".to_out.0.\1"),
]


def _is_cosmos(sd) -> bool:
    return "decoder.unpatcher3d.wavelets" in sd or ("decoder.conv_in.0.conv3d.weight" in sd and "latent_mean" in sd)


def _key(key: str, n_up: int) -> str:
    for a, b in _RENAMES:
        key = re.sub(a, b, key)
    # ComfyUI numbers the decoder levels from the full resolution, diffusers from the latent
    return re.sub(r"^decoder\.up_blocks\.(\d+)\.", lambda m: f"decoder.up_blocks.{n_up - 1 - int(m.group(1))}.", key)


def _width(sd, prefix: str) -> int:
    return int(sd[f"{prefix}.conv1.0.conv3d.weight"].shape[0])


def _convert_cosmos(sd: Mapping[str, torch.Tensor], **_):
    for key in ("encoder.conv_in.0.conv3d.weight", "decoder.conv_out.0.conv3d.weight", "post_quant_conv.conv3d.weight"):
        if key not in sd:
            raise UnsupportedVaeError(f"Cosmos VAE without {key}: PatchRay needs the full tokenizer (encoder and decoder)")
    down = indices(sd, r"encoder\.down\.(\d+)\.block\.0\.")
    up = indices(sd, r"decoder\.up\.(\d+)\.block\.0\.")
    if not down or len(up) != len(down):
        raise UnsupportedVaeError(f"Cosmos VAE with {len(down)} encoder and {len(up)} decoder levels")
    packed = int(sd["encoder.conv_in.0.conv3d.weight"].shape[1])  # 3 channels x patch^3 after the Haar patching
    patch = round((packed / 3) ** (1 / 3))
    if 3 * patch**3 != packed:
        raise UnsupportedVaeError(f"Cosmos VAE whose input convolution takes {packed} channels (not 3 x patch^3)")
    post = sd["post_quant_conv.conv3d.weight"]
    if post.shape[0] != post.shape[1]:
        raise UnsupportedVaeError("Cosmos VAE whose latent and z channels differ, which diffusers' class does not build")
    spatial = sum(f"encoder.down.{i}.downsample.conv1.0.conv3d.weight" in sd or
                  f"encoder.down.{i}.downsample.conv1.conv3d.weight" in sd for i in down)
    temporal = sum(f"encoder.down.{i}.downsample.conv2.conv3d.weight" in sd for i in down)
    levels = {_RESOLUTION // patch // 2**i: f"encoder.down.{i}.attn.0.0.q.conv3d.weight" in sd for i in down}
    attention = tuple(res for res, has in levels.items() if has)
    if _COMFY_ATTENTION not in levels:  # ComfyUI's value, which no level of this model reaches (the released one)
        attention = tuple(sorted(attention + (_COMFY_ATTENTION,), reverse=True))
    config = dict(
        in_channels=3,
        out_channels=int(sd["decoder.conv_out.1.conv3d.weight"].shape[0]) // patch**3,
        latent_channels=int(post.shape[0]),
        encoder_block_out_channels=(int(sd["encoder.conv_in.0.conv3d.weight"].shape[0]),)
        + tuple(_width(sd, f"encoder.down.{i}.block.0") for i in down),
        decode_block_out_channels=tuple(_width(sd, f"decoder.up.{i}.block.0") for i in up)
        + (int(sd["decoder.conv_in.0.conv3d.weight"].shape[0]),),
        attention_resolutions=attention,
        resolution=_RESOLUTION,
        num_layers=len(indices(sd, rf"encoder\.down\.{down[0]}\.block\.(\d+)\.")),
        patch_size=patch,
        spatial_compression_ratio=patch * 2**spatial,
        temporal_compression_ratio=patch * 2**temporal,
    )
    out = {}
    for key, tensor in sd.items():
        if key.endswith(("wavelets", "_arange")):
            continue  # the Haar filters: constants of the class, not weights
        new = key if key in ("latent_mean", "latent_std") else _key(key, len(up))
        if new in out:
            raise UnsupportedVaeError(f"Cosmos VAE: two weights map to {new}")
        out[new] = tensor
    return "AutoencoderKLCosmosLatentStats", config, out


ROWS = [LayoutRow("Cosmos VAE", "cosmos", _is_cosmos, _convert_cosmos)]
