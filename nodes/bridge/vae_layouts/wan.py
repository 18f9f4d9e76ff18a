"""Wan VAEs ComfyUI loads with ``comfy/ldm/wan/vae.py`` (Wan 2.1, and the Qwen-Image VAE, released in the same
layout) and ``comfy/ldm/wan/vae2_2.py`` (Wan 2.2) -> diffusers ``AutoencoderKLWan`` (families ``wan`` and ``wan22``).

ComfyUI tells them apart by ``decoder.upsamples.0.upsamples.0.residual.2.weight`` (``comfy.sd.VAE.__init__``): the
Wan 2.2 VAE nests its residual blocks inside residual up/down blocks. ComfyUI builds that one with fixed options
(``comfy/ldm/wan/vae2_2.py`` ``WanVAE``: 2x2 patchify to 12 channels, 48 latent channels in the 5B model's file,
``temperal_downsample=[False, True, True]``, 16x spatial); the widths below are read from the weights.
"""

from __future__ import annotations

import re
from typing import Dict, Mapping

import torch

from ....distributed.vae.convert import UnsupportedVaeError
from .table import LayoutRow, indices

__all__ = ["ROWS"]

_LEVELS = 4  # dim_mult (1, 2, 4, 4) is fixed in both ComfyUI's classes and diffusers' default


def _wan_config(sd: Mapping[str, torch.Tensor]) -> dict:
    base_dim = int(sd["decoder.head.2.weight"].shape[1]) if "decoder.head.2.weight" in sd else None
    if base_dim is None:
        raise UnsupportedVaeError("Wan VAE without decoder.head: cannot infer its width")
    z_dim = int(sd["conv2.weight"].shape[0]) if "conv2.weight" in sd else int(sd["decoder.conv1.weight"].shape[1])
    # encoder.downsamples holds, per level, num_res_blocks residual blocks then one resample (not on the last level)
    n_down = len(indices(sd, r"encoder\.downsamples\.(\d+)\."))
    n_res_total = len(indices(sd, r"encoder\.downsamples\.(\d+)\.residual\.0\.gamma"))
    resamples = n_down - n_res_total
    if resamples != _LEVELS - 1 or n_res_total % _LEVELS:
        raise UnsupportedVaeError(f"Wan VAE with an unexpected encoder layout ({n_down} down modules)")
    return dict(base_dim=base_dim, z_dim=z_dim, num_res_blocks=n_res_total // _LEVELS)


def _convert_wan(sd: Mapping[str, torch.Tensor], **_):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    config = _wan_config(sd)
    return "AutoencoderKLWan", config, convert_wan_vae_to_diffusers(dict(sd))


# ------------------------------------------------------------------------------------------------ Wan 2.2

_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
             "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
             "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_FIXED = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
          "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias",
          "encoder.conv1.weight": "encoder.conv_in.weight", "encoder.conv1.bias": "encoder.conv_in.bias",
          "decoder.conv1.weight": "decoder.conv_in.weight", "decoder.conv1.bias": "decoder.conv_in.bias",
          "encoder.head.0.gamma": "encoder.norm_out.gamma", "encoder.head.2.weight": "encoder.conv_out.weight",
          "encoder.head.2.bias": "encoder.conv_out.bias", "decoder.head.0.gamma": "decoder.norm_out.gamma",
          "decoder.head.2.weight": "decoder.conv_out.weight", "decoder.head.2.bias": "decoder.conv_out.bias"}
_MIDDLE = re.compile(r"(encoder|decoder)\.middle\.(\d+)\.(.+)$")
_LEVEL = re.compile(r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.+)$")


def _wan22_config(sd: Mapping[str, torch.Tensor]) -> dict:
    for key in ("decoder.head.2.weight", "encoder.conv1.weight", "conv2.weight"):
        if key not in sd:
            raise UnsupportedVaeError(f"Wan 2.2 VAE without {key}: PatchRay needs the full VAE (encoder and decoder)")
    levels = indices(sd, r"encoder\.downsamples\.(\d+)\.")
    per_level = indices(sd, r"encoder\.downsamples\.0\.downsamples\.(\d+)\.residual\.0\.gamma")
    if len(levels) != _LEVELS or not per_level:
        raise UnsupportedVaeError(f"Wan 2.2 VAE with {len(levels)} encoder levels; ComfyUI's class (and PatchRay) has {_LEVELS}")
    in_ch = int(sd["encoder.conv1.weight"].shape[1])
    out_ch = int(sd["decoder.head.2.weight"].shape[0])
    if in_ch != 12 or out_ch != 12:
        raise UnsupportedVaeError(f"Wan 2.2 VAE with {in_ch}/{out_ch} patchified channels; ComfyUI's class has 12 (3 x 2 x 2)")
    return dict(
        base_dim=int(sd["encoder.conv1.weight"].shape[0]),
        decoder_base_dim=int(sd["decoder.head.2.weight"].shape[1]),
        z_dim=int(sd["conv2.weight"].shape[0]),
        num_res_blocks=len(per_level),
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_temporal=4,
        scale_factor_spatial=16,
    )


def _wan22_key(key: str) -> str:
    if key in _FIXED:
        return _FIXED[key]
    m = _MIDDLE.match(key)
    if m:
        half, i, rest = m.groups()
        if i == "1":  # the attention block
            return f"{half}.mid_block.attentions.0.{rest}"
        return f"{half}.mid_block.resnets.{int(i) // 2}.{_RESIDUAL.get(rest, rest)}"
    m = _LEVEL.match(key)
    if m:
        where, level, j, rest = m.groups()
        half, block, sampler = (
            ("encoder", "down_blocks", "downsampler") if where.startswith("encoder") else ("decoder", "up_blocks", "upsampler")
        )
        # per level: the residual blocks (num_res_blocks in the encoder, one more in the decoder), then the resample
        if rest.startswith(("resample.", "time_conv.")):
            return f"{half}.{block}.{level}.{sampler}.{rest}"
        if rest in _RESIDUAL:
            return f"{half}.{block}.{level}.resnets.{j}.{_RESIDUAL[rest]}"
    return key  # left as is: check_state_dict then names it as unexpected


def _convert_wan22(sd: Mapping[str, torch.Tensor], **_):
    config = _wan22_config(sd)
    out: Dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        new = _wan22_key(key)
        if new in out:
            raise UnsupportedVaeError(f"Wan 2.2 VAE: two weights map to {new}")
        out[new] = value
    return "AutoencoderKLWan", config, out


def _is_wan(sd) -> bool:
    return "decoder.middle.0.residual.0.gamma" in sd


def _is_wan22(sd) -> bool:
    return _is_wan(sd) and "decoder.upsamples.0.upsamples.0.residual.2.weight" in sd


ROWS = [
    LayoutRow("Wan 2.2 VAE", "wan22", _is_wan22, _convert_wan22),
    LayoutRow("Wan 2.1 / Qwen-Image VAE", "wan", _is_wan, _convert_wan),
]
