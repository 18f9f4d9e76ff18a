"""KL autoencoders ComfyUI loads with its 2-D ``AutoencoderKL`` (SD1.x/SD2.x/SDXL/SD3 with ``quant_conv``, FLUX.1 ``ae``
without) -> diffusers ``AutoencoderKL`` (family ``kl``), any width. Key maps: diffusers' own single-file converter."""

from __future__ import annotations

from typing import Mapping

import torch

from ....distributed.vae.convert import UnsupportedVaeError
from .table import LayoutRow, indices, refuse

__all__ = ["ROWS", "COMFY_KL_GROUPS"]

#: ComfyUI hard-codes GroupNorm(32) in its KL encoder/decoder (``comfy/ldm/modules/diffusionmodules/model.py``)
COMFY_KL_GROUPS = 32


def _is_kl(sd: Mapping[str, torch.Tensor]) -> bool:
    return "decoder.conv_in.weight" in sd and "decoder.mid.block_1.mix_factor" not in sd and sd["decoder.conv_in.weight"].ndim == 4


def _kl_config(sd: Mapping[str, torch.Tensor], norm_num_groups: int) -> dict:
    ups = indices(sd, r"decoder\.up\.(\d+)\.block\.0\.conv2\.weight")
    if not ups:
        raise UnsupportedVaeError("KL VAE without decoder.up.* blocks")
    for i in ups:
        w = sd.get(f"decoder.up.{i}.upsample.conv.weight")
        if w is not None and w.shape[0] != w.shape[1]:
            raise UnsupportedVaeError("this KL-type VAE upsamples by pixel shuffle, which the plain KL decoder does not")
    if "decoder.mid.attn_1.q.weight" not in sd and "decoder.mid.attn_1.qkv.weight" in sd:
        raise UnsupportedVaeError("this KL-type VAE uses fused qkv attention, which PatchRay does not map")
    block_out = [int(sd[f"decoder.up.{i}.block.0.conv2.weight"].shape[0]) for i in ups]
    if "encoder.down.0.block.0.conv1.weight" in sd:
        layers = len(indices(sd, r"encoder\.down\.0\.block\.(\d+)\.conv1\.weight"))
    else:  # decoder levels hold one more resnet than encoder levels
        layers = len(indices(sd, r"decoder\.up\.0\.block\.(\d+)\.conv1\.weight")) - 1
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


def _convert_kl(sd: Mapping[str, torch.Tensor], *, norm_num_groups: int = COMFY_KL_GROUPS):
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    config = _kl_config(sd, norm_num_groups)
    return "AutoencoderKL", config, convert_ldm_vae_checkpoint(dict(sd), config)


ROWS = [
    refuse(
        "temporal (SVD) KL VAE",
        lambda sd: "decoder.mid.block_1.mix_factor" in sd,
        "the temporal (SVD) KL decoder is not supported by PatchRay",
    ),
    LayoutRow("SD / SDXL / SD3 / FLUX.1 KL VAE", "kl", _is_kl, _convert_kl),
]
