"""Wan VAEs ComfyUI loads with ``comfy/ldm/wan/vae.py`` (Wan 2.1) -> diffusers ``AutoencoderKLWan`` (family ``wan``)."""

from __future__ import annotations

from typing import Mapping

import torch

from ....distributed.vae.convert import UnsupportedVaeError
from .table import LayoutRow, indices, refuse

__all__ = ["ROWS"]


def _wan_config(sd: Mapping[str, torch.Tensor]) -> dict:
    base_dim = int(sd["decoder.head.2.weight"].shape[1]) if "decoder.head.2.weight" in sd else None
    if base_dim is None:
        raise UnsupportedVaeError("Wan VAE without decoder.head: cannot infer its width")
    z_dim = int(sd["conv2.weight"].shape[0]) if "conv2.weight" in sd else int(sd["decoder.conv1.weight"].shape[1])
    # encoder.downsamples holds, per level, num_res_blocks residual blocks then one resample (not on the last level)
    n_down = len(indices(sd, r"encoder\.downsamples\.(\d+)\."))
    n_res_total = len(indices(sd, r"encoder\.downsamples\.(\d+)\.residual\.0\.gamma"))
    levels = 4  # dim_mult (1, 2, 4, 4) is fixed in both the released model and diffusers' default
    resamples = n_down - n_res_total
    if resamples != levels - 1 or n_res_total % levels:
        raise UnsupportedVaeError(f"Wan VAE with an unexpected encoder layout ({n_down} down modules)")
    return dict(base_dim=base_dim, z_dim=z_dim, num_res_blocks=n_res_total // levels)


def _convert_wan(sd: Mapping[str, torch.Tensor], **_):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    config = _wan_config(sd)
    return "AutoencoderKLWan", config, convert_wan_vae_to_diffusers(dict(sd))


def _is_wan(sd) -> bool:
    return "decoder.middle.0.residual.0.gamma" in sd


def _is_wan22(sd) -> bool:
    return _is_wan(sd) and "decoder.upsamples.0.upsamples.0.residual.2.weight" in sd


ROWS = [
    refuse("Wan 2.2 VAE", _is_wan22, "Wan 2.2 VAE (48 latent channels) has no diffusers converter in PatchRay yet"),
    LayoutRow("Wan 2.1 VAE", "wan", _is_wan, _convert_wan),
]
