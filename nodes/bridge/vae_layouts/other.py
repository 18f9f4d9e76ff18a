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
    # Mochi (comfy/ldm/genmo/vae/model.py): its decoder normalises every frame by its own GroupNorm statistics in
    # chunks and pads by replication in causal 3-D convs; diffusers' AutoencoderKLMochi mirrors it, but its
    # per-frame chunked norm and conv wrappers have no row adapter yet (a new adapter, not a table row)
    refuse(
        "Mochi VAE",
        lambda sd: any(k.endswith(("blocks.2.blocks.3.stack.5.weight", "layers.4.layers.1.attn_block.attn.qkv.weight")) for k in sd),
        "the Mochi VAE has no row adapter for its per-frame GroupNorm and causal convolutions in PatchRay yet",
    ),
    # Cosmos (comfy/ldm/cosmos/vae.py): a wavelet (Haar) patcher, and ComfyUI's key layout differs from diffusers'
    # AutoencoderKLCosmos with no converter in diffusers' single-file utilities
    refuse(
        "Cosmos VAE",
        lambda sd: "decoder.unpatcher3d.wavelets" in sd,
        "the Cosmos video tokenizer VAE (wavelet patching) has no converter from ComfyUI's layout in PatchRay",
    ),
]
