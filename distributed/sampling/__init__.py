"""Patch-parallel sampling with OTIL: row-band UNet adapters, the OTIL latent exchange, presets.

Public API (imported lazily, so ``import patchray.distributed.sampling`` stays cheap):

* :class:`~.config.PatchConfig`, :data:`~.config.PRESETS`, :func:`~.config.preset`
* :func:`~.denoiser.parallelize_unet`, :class:`~.denoiser.PatchParallelDenoiser`
* :class:`~.otil.OtilExchange`
"""

from __future__ import annotations

import importlib

__all__ = ["PatchConfig", "PRESETS", "preset", "parallelize_unet", "PatchParallelDenoiser", "OtilExchange"]

_WHERE = {
    "PatchConfig": ".config",
    "PRESETS": ".config",
    "preset": ".config",
    "parallelize_unet": ".denoiser",
    "PatchParallelDenoiser": ".denoiser",
    "OtilExchange": ".otil",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
