"""The rank side of a distributed decode/encode: build (or reuse) the VAE, run the mode, hand back the output.

Design decisions:

* **Weights travel once per VAE.** The first call on a cluster puts the state dict into Ray's object store once
  (every rank reads the same object) and each rank builds the diffusers model and keeps it in its
  :func:`~patchray.distributed.cluster.rank_cache` under ``(key, dtype)``. Later calls send only the key; a rank
  without the model raises :class:`NeedWeights` and the driver resends (a rebuilt cluster starts empty).
* **The output goes to the caller only.** Row and tile-runs modes gather the image to group rank 0; the other ranks
  return ``None``, so only one copy crosses back to the driver.
* **A rank that runs out of memory frees what its call allocated before it returns** (the driver may retry).
* **Band weights travel with the call** (``None``: equal bands): every rank receives the same figures and derives
  the same band table from them.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..context import ParallelContext
from .spec import VaeSpec

__all__ = ["decode_task", "encode_task", "NeedWeights"]


def _rank_vae(ctx: ParallelContext, spec: VaeSpec, weights: Optional[Mapping[str, torch.Tensor]], dtype: torch.dtype):
    from ..cluster import rank_cache
    from .families import build_vae, instantiate

    cache = rank_cache()
    key = ("vae", spec.key, str(dtype), str(ctx.device))
    vae = cache.get(key)
    if vae is not None:
        return vae
    if spec.config is None:
        vae = build_vae(spec.family, size=spec.size, seed=int(spec.key.rsplit(":", 1)[-1]) if spec.key.startswith("synthetic:") else 0, dtype=dtype, device=ctx.device)
    else:
        if weights is None:
            raise NeedWeights(spec.key)
        with torch.device("meta"):
            vae = instantiate(spec.family, spec.config)
        vae.load_state_dict(dict(weights), assign=True)
        vae = vae.to(device=ctx.device, dtype=dtype).eval()
    # keep one VAE per dtype/device at a time: a new checkpoint replaces the old one
    for old in [k for k in cache if isinstance(k, tuple) and k and k[0] == "vae"]:
        del cache[old]
    cache[key] = vae
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


def decode_task(ctx: ParallelContext, spec: VaeSpec, weights, z: torch.Tensor, mode: str, plan: Optional[dict], dtype: torch.dtype,
                gn_sync: bool, band_weights=None):
    from .planner import TilePlan
    from .row import row_decode
    from .stages import stage_progress
    from .tiled import decode_row_tiled, decode_tile_runs

    vae = _rank_vae(ctx, spec, weights, dtype)
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


def encode_task(ctx: ParallelContext, spec: VaeSpec, weights, x: torch.Tensor, dtype: torch.dtype, band_weights=None):
    from .row import row_encode
    from .stages import stage_progress

    vae = _rank_vae(ctx, spec, weights, dtype)
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
