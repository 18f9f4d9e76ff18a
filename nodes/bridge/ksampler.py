"""The Distributed KSampler nodes' one call: the stock KSampler on a PatchRay Parallel Model.

There is one way PatchRay samples on the cluster: a MODEL patched by :func:`.parallel_model.patch_model`, sampled by
ComfyUI's own sampling functions. The Distributed KSampler and KSampler (Advanced) are that composition: the MODEL is
patched with the node's cluster widgets, then ComfyUI's own ``nodes.common_ksampler`` (the function behind the stock
KSampler and KSampler (Advanced)) samples it, so seeds, noise, start/end steps and leftover noise are the stock node's
by construction. Saved workflows that use these nodes keep working; new workflows can put PatchRay Parallel Model in
front of any sampler node instead.
"""

from __future__ import annotations

from typing import Optional

from . import parallel_model
from .parallel_model import Hooks
from .sampling_options import SamplingOptions

__all__ = ["ksample", "sequence_families"]


def sequence_families() -> str:
    """The models ``parallelism=sequence`` covers, as the nodes' descriptions name them (from the DiT table, so the
    descriptions follow the table)."""
    from .dit_models import ROWS

    names = []
    for row in ROWS:
        name = row.family.split(" (")[0]
        if name not in names:
            names.append(name)
    return "UNets SD 1.x/2.x/SDXL and the DiTs " + ", ".join(names)


def ksample(
    model, options: SamplingOptions, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
    denoise: float = 1.0, *, add_noise: bool = True, start_step: Optional[int] = None, last_step: Optional[int] = None,
    force_full_denoise: bool = False, hooks: Hooks = Hooks(),
) -> dict:
    """The stock KSampler (Advanced) on ``model`` patched with ``options``; returns the LATENT dict.

    Args:
        add_noise, start_step, last_step, force_full_denoise: KSampler (Advanced)'s part of the schedule, as the stock
            node passes them to ComfyUI's sampler (the defaults are the plain KSampler's: the whole schedule).
        hooks: the node's cancel check, progress bar and report sink (:class:`.parallel_model.Hooks`).

    Raises:
        ValueError / TypeError / NotImplementedError: refused inputs, before any rank starts.
        RankFailure: a rank failed (clean message; the trace is chained for the log).
    """
    for name, value in (("start_at_step", start_step), ("end_at_step", last_step)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a step number >= 0 (got {value!r})")
    if not isinstance(latent_image, dict) or "samples" not in latent_image:
        raise TypeError("latent_image must be a ComfyUI LATENT (a dict with 'samples')")
    patched = parallel_model.patch_model(model, options, hooks)
    import nodes as comfy_nodes  # ComfyUI's own node module (the stock KSampler's function)

    (out,) = comfy_nodes.common_ksampler(
        patched, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise=denoise,
        disable_noise=not add_noise, start_step=start_step, last_step=last_step, force_full_denoise=force_full_denoise,
    )
    return out
