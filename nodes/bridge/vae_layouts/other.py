"""Layouts ComfyUI loads that PatchRay deliberately leaves to the stock nodes, each with its reason."""

from __future__ import annotations

from .table import refuse

__all__ = ["ROWS"]

ROWS = [
    refuse(
        "TAESD",
        lambda sd: any(k.startswith("taesd_") for k in sd),
        "TAESD is a tiny preview VAE; decode it with the stock node",
    ),
    # Cosmos (comfy/ldm/cosmos/vae.py): a wavelet (Haar) patcher, and ComfyUI's key layout differs from diffusers'
    # AutoencoderKLCosmos with no converter in diffusers' single-file utilities
    refuse(
        "Cosmos VAE",
        lambda sd: "decoder.unpatcher3d.wavelets" in sd,
        "the Cosmos video tokenizer VAE (wavelet patching) has no converter from ComfyUI's layout in PatchRay",
    ),
]
