"""Decoding one tile, and GroupNorm-synced tiles (``gn_sync``): the statistics passes of a tiled decode.

Design decisions:

* **The adapter lives in ``parallel/``.** Every ``nn.GroupNorm`` of the VAE gets
  :class:`~patchray.distributed.parallel.groupnorm.ShardedGroupNorm` in its image-wide mode
  (:class:`~patchray.distributed.parallel.imagewide.ImageWideStats`) for the duration of one tiled decode, through
  the plan machinery's one undo path; a module that already carries an instance-level forward is refused
  (the final pass recomputes the normalization, which would bypass it). This module only drives the passes.
* **Three modes.** The statistics are only as good as the activations they are measured on, which depend on how
  the earlier layers were normalized:

  - ``"levels"`` (``gn_sync=True``): one statistics pass per resolution level of the decoder (latent
    resolution, x2, x4, ...), each run under the final statistics of the levels before it and stopped as
    soon as it leaves its level. About 1.5x the cost of ``"two-pass"``.
  - ``"two-pass"``: one statistics pass with per-tile normalization upstream, then the final pass (the
    classic SyncGN scheme). Cheapest, but its estimate is biased by the per-tile upstream.
  - ``"exact"``: one pass per GroupNorm call (lockstep across tiles): the statistics equal those of a
    decode with image-wide normalization everywhere, at about ten times the cost of plain tiles.

* **Collective-safe.** The number of passes depends on the decoder's structure only; whether another pass is
  needed travels with the statistics (one all-gather per pass carrying every layer), so every rank makes the
  same collectives.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from ..comm import all_gather_padded
from ..context import ParallelContext
from ..parallel.groupnorm import ShardedGroupNorm
from ..parallel.imagewide import CoreStats, ImageWideStats, StopTile, TileStatistics
from ..parallel.plan import apply_plan, undo_all
from .planner import TilePlan
from .tile_geometry import Geometry

__all__ = ["GN_SYNC_MODES", "gn_mode", "image_wide_norms", "decode_tile", "sync_statistics"]

logger = logging.getLogger(__name__)

GN_SYNC_MODES = ("levels", "two-pass", "exact")

_IMAGE_WIDE_PLAN = {"GroupNorm": ShardedGroupNorm(stats=ImageWideStats())}


def gn_mode(gn_sync) -> Optional[str]:
    """``None`` (off) or one of :data:`GN_SYNC_MODES` (``True`` means ``"levels"``)."""
    if gn_sync is False or gn_sync is None:
        return None
    if gn_sync is True:
        return "levels"
    if gn_sync in GN_SYNC_MODES:
        return gn_sync
    raise ValueError(f"gn_sync must be False, True or one of {GN_SYNC_MODES} (got {gn_sync!r})")


@contextlib.contextmanager
def image_wide_norms(vae: nn.Module, enabled: bool):
    """Image-wide GroupNorms on ``vae`` for the block; yields their :class:`TileStatistics` (``None`` when not
    ``enabled`` or when the decoder has no GroupNorm: nothing to sync, no extra pass). Always undone."""
    norms = [(name, m) for name, m in vae.named_modules() if isinstance(m, nn.GroupNorm)]
    if not enabled or not norms:
        yield None
        return
    for name, module in norms:
        if "forward" in module.__dict__:
            raise RuntimeError(
                f"{name} already has an instance-level forward (another adapter is applied); remove it before gn_sync"
            )
    state = TileStatistics()
    applied = apply_plan([("", vae)], _IMAGE_WIDE_PLAN, state, strict=False)
    try:
        yield state
    finally:
        undo_all(applied)


def _decode(vae, z: torch.Tensor) -> torch.Tensor:
    if hasattr(vae, "config") and hasattr(vae.config, "get"):  # a diffusers VAE: with its PatchRay options
        from .families import plain_decode

        return plain_decode(vae, z)
    out = vae.decode(z)
    if isinstance(out, torch.Tensor):
        return out
    sample = getattr(out, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"{type(vae).__name__}.decode returned {type(out).__name__}, not a tensor or DecoderOutput")


def decode_tile(vae, z: torch.Tensor, plan: TilePlan, geo: Geometry, index: int, gn: Optional[TileStatistics]):
    """Decode tile ``index`` of ``plan`` (``None`` when a statistics pass stopped after its level)."""
    y0, y1, x0, x1 = plan.tiles_latent[index]
    param = next(vae.parameters(), None)
    tile = z[..., y0:y1, x0:x1].to(dtype=param.dtype if param is not None else z.dtype).contiguous()
    if gn is None:
        out = _decode(vae, tile)
    else:
        gn.begin_tile(plan.tiles_latent[index], plan.cores_latent[index])
        try:
            out = _decode(vae, tile)
        except StopTile:
            return None  # a statistics pass stopped after the level it collects
        gn.end_tile()
    py0, py1, px0, px1 = geo.tiles[index]
    if tuple(out.shape[-2:]) != (py1 - py0, px1 - px0):
        raise ValueError(
            f"{type(vae).__name__} decoded a {y1 - y0}x{x1 - x0} latent tile to {tuple(out.shape[-2:])} px, "
            f"expected {(py1 - py0, px1 - px0)} at the plan's ratio {plan.ratio}; the plan's family does not match the VAE"
        )
    return out


def _collect_pass(vae, z, plan, geo, gn: TileStatistics, tiles: Sequence[int]) -> Dict[tuple, CoreStats]:
    gn.collecting = True
    gn.call_count = None
    try:
        for t in tiles:
            decode_tile(vae, z, plan, geo, t, gn)
    finally:
        gn.collecting = False
    return gn.take_run()


def sync_statistics(vae, z, plan, geo, gn: TileStatistics, ctx: Optional[ParallelContext], mode: str) -> None:
    """Fill ``gn.image``: one statistics pass, or one per resolution level (each under the levels before it).

    Without ``ctx`` every run is collected here, merged run by run and then across runs: the order tile-runs
    uses, so the two agree bitwise. With ``ctx`` each rank collects its run and one all-gather per pass carries
    every layer's statistics. The number of passes depends on the decoder's structure only, so every rank
    makes the same collectives.
    """
    level = 0
    gn.per_call = mode == "exact"
    while True:
        gn.collect_level, gn.beyond = (None if mode == "two-pass" else level), False
        if ctx is None:
            parts = [_collect_pass(vae, z, plan, geo, gn, plan.run_of(rank)) for rank in range(plan.world_size)]
        else:
            mine = _collect_pass(vae, z, plan, geo, gn, plan.run_of(ctx.rank))
            keys = list(mine)
            packed = torch.stack([mine[k].pack() for k in keys])  # [K, 4, B, G]: one collective for all layers
            # plus one row saying whether this rank saw a later level: whether to go on is decided from shared data
            flag = torch.full_like(packed[:1], float(gn.beyond))
            gathered = all_gather_padded(torch.cat([packed, flag]).unsqueeze(0), ctx, dim=0, sizes=[1] * ctx.world_size)
            parts = [{k: CoreStats.unpack(gathered[r, i]) for i, k in enumerate(keys)} for r in range(ctx.world_size)]
            gn.beyond = bool((gathered[:, -1] > 0).any())
        gn.set_image(parts)
        if not gn.beyond:
            logger.debug("gn_sync %s: %d statistics pass(es)", mode, level + 1)
            return
        level += 1
