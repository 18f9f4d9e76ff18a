"""Hunyuan VAEs ComfyUI loads (HunyuanVideo's 3-D KL autoencoder, the 32-channel refiner VAE of
``comfy/ldm/hunyuan_video/vae_refiner.py``, HunyuanImage-2.1's 64-channel VAE). No row yet: they fall back."""

from __future__ import annotations

from .table import refuse

__all__ = ["ROWS"]


def _pixel_shuffle_kl(sd) -> bool:
    if "decoder.conv_in.weight" not in sd or "decoder.mid.block_1.mix_factor" in sd:
        return False
    for k, w in sd.items():
        if k.startswith("decoder.up.") and k.endswith(".upsample.conv.weight") and w.shape[0] != w.shape[1]:
            return True
    return False


ROWS = [
    refuse(
        "Hunyuan image/video-1.5 VAE",
        _pixel_shuffle_kl,
        "Hunyuan-style VAE (pixel-shuffle upsampling) is not supported by PatchRay yet",
    ),
]
