"""Patch-parallel sampling with OTIL: the UNet plan (adapters from ``distributed/parallel``), OTIL, presets.

Public API (imported lazily, so ``import patchray.distributed.sampling`` stays cheap):

* :class:`~.config.PatchConfig`, :data:`~.config.PRESETS`, :func:`~.config.preset`
* :func:`~.denoiser.parallelize_unet`, :func:`~.denoiser.unet_plan`, :class:`~.denoiser.PatchParallelDenoiser`
* :class:`~.otil.OtilExchange`
"""

from __future__ import annotations

import importlib

__all__ = ["PatchConfig", "PRESETS", "preset", "parallelize_unet", "unet_plan", "PatchParallelDenoiser", "OtilExchange"]

_WHERE = {
    "PatchConfig": ".config",
    "PRESETS": ".config",
    "preset": ".config",
    "parallelize_unet": ".denoiser",
    "unet_plan": ".denoiser",
    "PatchParallelDenoiser": ".denoiser",
    "OtilExchange": ".otil",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
