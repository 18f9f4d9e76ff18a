"""The rank side of a distributed decode/encode: build (or reuse) the VAE, run the mode, hand back the output.

Design decisions:

* **Weights travel once per VAE and dtype, the way every model does** (``sampling.ship.ship_model``): the
  skeleton (family, config, dtype) first, which each rank builds on the meta device and allocates on its device
  (:func:`begin_vae`), then the state dict in parts. A rank keeps one VAE, in :data:`VAE_SLOT` of its
  :func:`~patchray.distributed.cluster.rank_cache`; a task finds it there by :func:`vae_key`. A rank without it (one
  replaced after the driver shipped) raises :class:`NeedWeights` and the driver ships again.
* **The output goes to the caller only.** Row and tile-runs modes gather the image to group rank 0; the other ranks
  return ``None``, so only one copy crosses back to the driver.
* **A rank that runs out of memory frees what its call allocated before it returns** (the driver may retry).
* **Band weights travel with the call** (``None``: equal bands): every rank receives the same figures and derives
  the same band table from them.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..context import ParallelContext
from .spec import VaeSpec

__all__ = ["decode_task", "encode_task", "NeedWeights", "VAE_SLOT", "vae_key", "begin_vae", "end_vae"]

#: the rank_cache() entry of the rank's VAE: ``(vae_key(spec, dtype), vae)``; a new VAE or dtype replaces it
VAE_SLOT = "patchray.vae.model"


def vae_key(spec: VaeSpec, dtype: torch.dtype) -> tuple:
    """What a rank's VAE is cached under: the spec's content key and the dtype it computes in."""
    return ("vae", spec.key, str(dtype))


def begin_vae(ctx: ParallelContext, skeleton: dict):
    """``ship_model``'s ``begin`` for a VAE: the diffusers model of ``skeleton["family"]`` / ``["config"]`` built on
    the meta device and allocated on the rank's device in ``skeleton["dtype"]``; the parts fill it."""
    from ..sampling.ship import materialize_meta
    from .families import instantiate

    with torch.device("meta"):
        vae = instantiate(skeleton["family"], skeleton["config"])
    vae = vae.to(dtype=skeleton["dtype"])
    materialize_meta(vae, ctx.device)
    return vae, vae


def end_vae(ctx: ParallelContext, vae):
    return vae.eval()


def _rank_vae(ctx: ParallelContext, spec: VaeSpec, dtype: torch.dtype):
    from ..cluster import rank_cache
    from .families import build_vae

    cache = rank_cache()
    key = vae_key(spec, dtype)
    entry = cache.get(VAE_SLOT)
    if entry is not None and entry[0] == key:
        return entry[1]
    if spec.config is not None:  # a shipped VAE this rank does not hold
        raise NeedWeights(spec.key)
    # a synthetic VAE (benchmarks, tests): built here from its seed, never shipped
    cache.pop(VAE_SLOT, None)
    seed = int(spec.key.rsplit(":", 1)[-1]) if spec.key.startswith("synthetic:") else 0
    vae = build_vae(spec.family, size=spec.size, seed=seed, dtype=dtype, device=ctx.device)
    cache[VAE_SLOT] = (key, vae)
    return vae


class NeedWeights(RuntimeError):
    """The rank has no cached model for this key (e.g. the cluster was rebuilt): the driver resends."""

    #: the driver expects it and recovers (it resends the weights): the cluster logs it without a warning
    patchray_expected = True


def _pieces(mode: str, plan: Optional[dict], rank: int) -> int:
    """How many times rank 0 decodes a whole piece of the input (for its progress total)."""
    if mode == "row" or plan is None:
        return 1
    if mode == "row-tiled":
        return len(plan["tiles_latent"])
    start, stop = plan["runs"][rank]
    return stop - start


def _frames(x: torch.Tensor) -> Optional[int]:
    return int(x.shape[2]) if x.dim() == 5 else None


def _release_after_oom(device: torch.device) -> None:
    """Give back what a failed call allocated: its frames are gone once the exception is; cycles and caches next."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_task(ctx: ParallelContext, spec: VaeSpec, z: torch.Tensor, mode: str, plan: Optional[dict], dtype: torch.dtype,
                gn_sync: bool, band_weights=None):
    from .planner import TilePlan
    from .row import row_decode
    from .stages import stage_progress
    from .tiled import decode_row_tiled, decode_tile_runs

    vae = _rank_vae(ctx, spec, dtype)
    z = z.to(device=ctx.device)
    oom = None
    try:
        with stage_progress(vae.decoder, ctx, frames=_frames(z), pieces=_pieces(mode, plan, ctx.rank)):
            if mode == "row":
                out = row_decode(vae, z, ctx, weights=band_weights)
            elif mode == "row-tiled":
                out = decode_row_tiled(vae, z, TilePlan.from_dict(plan), ctx)
            else:
                out = decode_tile_runs(vae, z, TilePlan.from_dict(plan), ctx, gn_sync=gn_sync)
    except torch.OutOfMemoryError as exc:
        oom = str(exc)
    if oom is not None:  # outside the except block: the traceback (and the activations its frames hold) is gone
        _release_after_oom(ctx.device)
        raise torch.OutOfMemoryError(oom)
    return None if out is None else out.float().cpu()


decode_task.patchray_task = "decoding"


def encode_task(ctx: ParallelContext, spec: VaeSpec, x: torch.Tensor, dtype: torch.dtype, band_weights=None):
    from .row import row_encode
    from .stages import stage_progress

    vae = _rank_vae(ctx, spec, dtype)
    x = x.to(device=ctx.device)
    oom = None
    try:
        with stage_progress(vae.encoder, ctx, frames=_frames(x)):
            out = row_encode(vae, x, ctx, weights=band_weights)
    except torch.OutOfMemoryError as exc:
        oom = str(exc)
    if oom is not None:
        _release_after_oom(ctx.device)
        raise torch.OutOfMemoryError(oom)
    return None if out is None else out.float().cpu()


encode_task.patchray_task = "encoding"
