"""Patch-parallel sampling with OTIL: the UNet plan (adapters from ``distributed/parallel``), OTIL, presets.

Public API (imported lazily, so ``import patchray.distributed.sampling`` stays cheap):

* :class:`~.config.PatchConfig`, :data:`~.config.PRESETS`, :func:`~.config.preset`
* :func:`~.denoiser.parallelize_unet`, :func:`~.denoiser.unet_plan`, :class:`~.denoiser.PatchParallelDenoiser`
* :class:`~.otil.OtilExchange`
* DiTs: :func:`~.dit.parallelize_dit`, :data:`~.dit.DIT_FAMILIES` (sequence parallelism on diffusers' DiT classes)
* :func:`~.split.plan_split`, :class:`~.split.RankGroups`, :func:`~.split.cfg_parallel`,
  :func:`~.split.batch_parallel`, :func:`~.split.evaluate_split` (CFG- and batch-parallel over rank groups)
"""

from __future__ import annotations

import importlib

__all__ = [
    "PatchConfig",
    "PRESETS",
    "preset",
    "parallelize_unet",
    "unet_plan",
    "PatchParallelDenoiser",
    "OtilExchange",
    "parallelize_dit",
    "DIT_FAMILIES",
    "plan_split",
    "RankGroups",
    "cfg_parallel",
    "batch_parallel",
    "evaluate_split",
]

_WHERE = {
    "PatchConfig": ".config",
    "PRESETS": ".config",
    "preset": ".config",
    "parallelize_unet": ".denoiser",
    "unet_plan": ".denoiser",
    "PatchParallelDenoiser": ".denoiser",
    "OtilExchange": ".otil",
    "parallelize_dit": ".dit",
    "DIT_FAMILIES": ".dit",
    "plan_split": ".split",
    "RankGroups": ".split",
    "cfg_parallel": ".split",
    "batch_parallel": ".split",
    "evaluate_split": ".split",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
