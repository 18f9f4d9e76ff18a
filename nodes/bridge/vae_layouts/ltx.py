"""LTX-Video VAEs ComfyUI loads with ``comfy/ldm/lightricks/vae/causal_video_autoencoder.py``. No row yet: they fall back."""

from __future__ import annotations

from .table import refuse

__all__ = ["ROWS"]

ROWS = [
    refuse(
        "LTX-Video VAE",
        lambda sd: "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight" in sd,
        "LTX-Video VAE: PatchRay has no converter from ComfyUI's layout yet",
    ),
]
