"""Tiled decode modes: local, tile-runs and row-tiled, plus GroupNorm-synced tiles.

Design decisions:

* **Every family decodes unchanged.** A tile is a latent rectangle (all frames, all channels) handed to
  the VAE's own ``decode``; nothing inside the model is patched for plain tiles, so the seven families
  (2-D and causal video) share one code path. Video latents ``[B, C, T, h, w]`` are tiled spatially and
  keep every frame: the family's decode keeps control of time (see ``planner.py``).
* **An order-independent blend.** Each tile is weighted by separable linear ramps across the overlaps it
  shares with its neighbours; ``sum(weight * tile)`` and ``sum(weight)`` are accumulated in fp32 in
  raster order and divided at the end. Two complementary ramps sum to one, so a seam is a linear
  crossfade; dividing by the accumulated weight keeps any geometry (thin exact-case blends, triple
  overlaps) correct. Because weights depend only on geometry, a pixel's value does not depend on which
  process decoded which tile, and tile-runs reproduces local for the same plan (bitwise on CPU, where
  both add the same products in the same order).
* **tile-runs: one exchange, one gather, to the caller.** Ranks decode their contiguous run of whole
  tiles (balanced by area by the planner). The image is partitioned into tile *cores* (each seam cut in
  the middle of its overlap); a rank blends the cores of its own tiles and so needs only the strips of
  its neighbours' tiles that reach into them. All strips travel in one ``batch_isend_irecv`` (sizes from
  geometry, no metadata collective), then the blended cores go once to group rank 0 with
  :func:`~patchray.distributed.comm.gather_to`. Every other rank returns ``None``.
* **local** decodes every tile in one process with no collective: the memory floor of that window.
* **row-tiled** row-shards inside each tile with ``row.row_decode`` (a diagnostic that separates tile
  overhead from communication overhead; it pays a gather per tile by construction).
* **GroupNorm-synced tiles** (``gn_sync``). Plain tiles normalize with each tile's own statistics, so
  tiles drift in tone. With ``gn_sync`` every ``nn.GroupNorm`` call is normalized with *image-wide*
  statistics instead (the GroupNorm adapter's image-wide mode, driven pass by pass by ``tile_gn.py``, whose
  docstring describes the ``"levels"``, ``"two-pass"`` and ``"exact"`` modes). On the synthetic-weight tests
  ``"levels"`` cut the mean error against the untiled decode by 5-56% on every geometry tried; ``"two-pass"``
  was worse than plain tiles on some geometries (large overlaps); ``"exact"`` matched a decode fed the untiled
  decode's own statistics, at about ten times the cost of plain tiles. Families whose decoders have no
  ``GroupNorm`` (Wan, Qwen-Image, HunyuanVideo-1.5 and LTX-2 use per-position RMS norms, which hold no spatial
  statistics to drift) skip the extra passes: their output equals plain tiles. Attention in the mid-block and
  zero padding at tile borders stay per tile in every mode.

The geometry and the blend are in ``tile_geometry.py``.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from ..comm import exchange_pieces, gather_to
from ..context import ParallelContext
from .planner import TilePlan
from .tile_geometry import Blend, Geometry, blend_cores, check_latent, crop, intersect, seam_error
from .tile_gn import GN_SYNC_MODES, decode_tile, gn_mode, image_wide_norms, sync_statistics

__all__ = ["decode_local", "decode_tile_runs", "decode_row_tiled", "seam_error", "GN_SYNC_MODES"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def decode_local(vae, z: torch.Tensor, plan: TilePlan, gn_sync: bool = False) -> torch.Tensor:
    """Decode every tile of ``plan`` in this process and blend them (no collectives).

    Args:
        vae: a diffusers VAE (any family; its ``decode`` is called once per tile, plus the statistics passes).
        z: latent ``[B, C, h, w]`` or ``[B, C, T, h, w]`` whose ``(h, w)`` is the plan's latent size.
        plan: a :class:`~patchray.distributed.vae.planner.TilePlan` (its runs only order the GN merge).
        gn_sync: normalize every tile with image-wide GroupNorm statistics: ``False``, ``True`` (``"levels"``),
            ``"two-pass"`` or ``"exact"`` (see the module docstring).

    Returns:
        The decoded image ``[B, C, H, W]`` (or ``[B, C, T', H, W]``) in the VAE's output dtype.

    Example:
        >>> image = decode_local(vae, z, exact_plan("kl", 1024, 1024, 1, 1, (512, 1024), (128, 0)))
    """
    check_latent(z, plan)
    geo = Geometry(plan)
    mode = gn_mode(gn_sync)
    with image_wide_norms(vae, mode is not None) as gn:
        if gn is not None:
            sync_statistics(vae, z, plan, geo, gn, None, mode)
        blend = Blend(plan, geo)
        for t in range(plan.tile_count):
            blend.add(t, decode_tile(vae, z, plan, geo, t, gn))
    return blend.result()


@torch.no_grad()
def decode_tile_runs(
    vae, z: torch.Tensor, plan: TilePlan, ctx: ParallelContext, gn_sync: bool = False
) -> Optional[torch.Tensor]:
    """Each rank decodes its run of whole tiles; one edge exchange; the image is gathered once to rank 0.

    Every rank holds the full latent ``z`` (it is small) and the same ``plan`` (made for ``ctx.world_size``).

    Args:
        vae: a diffusers VAE, the same weights on every rank.
        z: latent ``[B, C, h, w]`` or ``[B, C, T, h, w]``.
        plan: a :class:`~patchray.distributed.vae.planner.TilePlan` with ``world_size == ctx.world_size``.
        ctx: the parallel context.
        gn_sync: as in :func:`decode_local`; each statistics pass adds one all-gather (all layers at once).

    Returns:
        The image on group rank 0 (equal to :func:`decode_local` with the same plan); ``None`` elsewhere.
    """
    check_latent(z, plan)
    if plan.world_size != ctx.world_size:
        raise ValueError(
            f"the plan balances {plan.world_size} ranks but the group has {ctx.world_size}; plan for world_size={ctx.world_size}"
        )
    geo = Geometry(plan)
    me = ctx.rank
    mine = list(plan.run_of(me))
    mode = gn_mode(gn_sync)
    outs: Dict[int, torch.Tensor] = {}
    with image_wide_norms(vae, mode is not None) as gn:
        if gn is not None:
            sync_statistics(vae, z, plan, geo, gn, ctx, mode)
        for t in mine:
            outs[t] = decode_tile(vae, z, plan, geo, t, gn)
    lead = outs[mine[0]]
    prefix = lead.shape[:-2]

    # what crosses ranks: the part of tile t (owned by src) inside core k (owned by dst), per (src, dst)
    sends: Dict[int, List[torch.Tensor]] = {}
    recv_shapes: Dict[int, List[torch.Size]] = {}
    recv_keys: Dict[int, List[Tuple[int, int]]] = {}
    for k, covering in enumerate(geo.covering):
        dst = plan.owner_of(k)
        for t in covering:
            src = plan.owner_of(t)
            if src == dst or me not in (src, dst):
                continue
            rect = intersect(geo.tiles[t], geo.cores[k])
            if src == me:
                sends.setdefault(dst, []).append(crop(outs[t], geo.tiles[t], rect))
            else:
                recv_shapes.setdefault(src, []).append(prefix + (rect[1] - rect[0], rect[3] - rect[2]))
                recv_keys.setdefault(src, []).append((t, k))
    received = exchange_pieces(ctx, sends, recv_shapes, lead.dtype, lead.device)

    pieces: Dict[Tuple[int, int], torch.Tensor] = {}
    for src, keys in recv_keys.items():
        pieces.update(zip(keys, received[src]))
    for k in mine:
        for t in geo.covering[k]:
            if t in outs:
                pieces[(t, k)] = crop(outs[t], geo.tiles[t], intersect(geo.tiles[t], geo.cores[k]))
    blended = blend_cores(mine, geo, pieces, lead)
    del outs, pieces

    flat = torch.cat([b.reshape(-1) for b in blended])
    sizes = []
    for rank in range(ctx.world_size):
        area = sum((geo.cores[k][1] - geo.cores[k][0]) * (geo.cores[k][3] - geo.cores[k][2]) for k in plan.run_of(rank))
        sizes.append(area * int(torch.Size(prefix).numel()))
    gathered = gather_to(flat, ctx, dim=0, sizes=sizes, dst=0)
    if gathered is None:
        return None
    image = torch.empty(prefix + (plan.height, plan.width), dtype=lead.dtype, device=lead.device)
    offset = 0
    for k in range(plan.tile_count):
        y0, y1, x0, x1 = geo.cores[k]
        n = (y1 - y0) * (x1 - x0) * int(torch.Size(prefix).numel())
        image[..., y0:y1, x0:x1] = gathered[offset : offset + n].view(prefix + (y1 - y0, x1 - x0))
        offset += n
    return image


@torch.no_grad()
def decode_row_tiled(vae, z: torch.Tensor, plan: TilePlan, ctx: ParallelContext) -> Optional[torch.Tensor]:
    """Row sharding inside each tile (every rank works on every tile); rank 0 blends. A diagnostic.

    Returns:
        The image on group rank 0; ``None`` elsewhere.
    """
    from .row import row_decode

    check_latent(z, plan)
    geo = Geometry(plan)
    blend = Blend(plan, geo)
    for t in range(plan.tile_count):
        y0, y1, x0, x1 = plan.tiles_latent[t]
        out = row_decode(vae, z[..., y0:y1, x0:x1].contiguous(), ctx)
        if out is not None:
            blend.add(t, out)
    return blend.result()
