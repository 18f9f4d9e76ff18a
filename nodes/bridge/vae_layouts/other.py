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
]
