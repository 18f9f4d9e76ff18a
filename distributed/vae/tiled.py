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
  statistics instead: statistics passes record, at each call, the per-group count, mean and M2 over the
  tile's *core* (so every image pixel counts once), merge them with Chan's parallel formula in fp64 (run
  by run, then across ranks with one all-gather per pass carrying every layer), and the final pass
  decodes every tile with them. The estimate is only as good as the activations it is measured on, which
  depend on how the earlier layers were normalized, hence three modes:

  - ``"levels"`` (``gn_sync=True``): one statistics pass per resolution level of the decoder (latent
    resolution, x2, x4, ...), each run under the final statistics of the levels before it and stopped as
    soon as it leaves its level. About 1.5x the cost of ``"two-pass"``; on the synthetic-weight tests it
    cut the mean error against the untiled decode by 5-56% on every geometry tried.
  - ``"two-pass"``: one statistics pass with per-tile normalization upstream, then the final pass (the
    classic SyncGN scheme). Cheapest, but its estimate is biased by the per-tile upstream; it was worse
    than plain tiles on some geometries (large overlaps), and re-collecting it iteratively diverges.
  - ``"exact"``: one pass per GroupNorm call (lockstep across tiles): the statistics equal those of a
    decode with image-wide normalization everywhere; its error matched a decode fed the untiled decode's
    own statistics, at about ten times the cost of plain tiles. A diagnostic and an upper bound.

  Families whose decoders have no ``GroupNorm`` (Wan, Qwen-Image, HunyuanVideo-1.5 and LTX-2 use
  per-position RMS norms, which hold no spatial statistics to drift) skip the extra passes: their output
  equals plain tiles. Attention in the mid-block and zero padding at tile borders stay per tile in every
  mode. The GroupNorm forwards are replaced for the call and always restored (parameters are used by
  reference, nothing is copied).
"""

from __future__ import annotations

import functools
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..comm import all_gather_padded, exchange_pieces, gather_to
from ..context import ParallelContext
from .planner import TilePlan

__all__ = ["decode_local", "decode_tile_runs", "decode_row_tiled", "seam_error", "GN_SYNC_HOOK", "GN_SYNC_MODES"]

logger = logging.getLogger(__name__)

GN_SYNC_HOOK = "_patchray_gn_sync"
"""Marker attribute set on a GroupNorm while its forward is temporarily replaced by the GN-sync one."""

Rect = Tuple[int, int, int, int]


# --------------------------------------------------------------------------------------------------
# geometry shared by every mode


def _intersect(a: Rect, b: Rect) -> Optional[Rect]:
    y0, y1, x0, x1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (y0, y1, x0, x1) if y0 < y1 and x0 < x1 else None


def _ramps(spans: Sequence[Tuple[int, int]], index: int) -> torch.Tensor:
    """1-D fp32 weights of tile ``index`` along one axis: linear ramps over the overlaps with its neighbours."""
    a, b = spans[index]
    length = b - a
    pos = torch.arange(length, dtype=torch.float64) + 0.5
    w = torch.ones(length, dtype=torch.float64)
    if index > 0:
        ov = spans[index - 1][1] - a
        if ov > 0:
            w = w * torch.clamp(pos / ov, max=1.0)
    if index + 1 < len(spans):
        ov = b - spans[index + 1][0]
        if ov > 0:
            w = w * torch.clamp((length - pos) / ov, max=1.0)
    return w.to(torch.float32)


class _Geometry:
    """Pixel rectangles, cores and blend ramps of a plan (derived identically on every rank)."""

    def __init__(self, plan: TilePlan):
        self.plan = plan
        r = plan.ratio
        rows, cols = plan.grid
        self.tiles = plan.tiles_pixels
        self.cores = tuple((y0 * r, y1 * r, x0 * r, x1 * r) for y0, y1, x0, x1 in plan.cores_latent)
        ys = [(t[0], t[1]) for t in self.tiles[::cols]]
        xs = [(t[2], t[3]) for t in self.tiles[:cols]]
        wy = [_ramps(ys, i) for i in range(rows)]
        wx = [_ramps(xs, j) for j in range(cols)]
        self.ramps = [(wy[i // cols], wx[i % cols]) for i in range(len(self.tiles))]
        # which tiles reach into each core, in raster order (the blend order)
        self.covering = [
            [t for t, rect in enumerate(self.tiles) if _intersect(rect, core) is not None] for core in self.cores
        ]

    def weight(self, tile: int, rect: Rect) -> torch.Tensor:
        """Blend weight of ``tile`` over the absolute pixel ``rect`` (inside the tile)."""
        ty0, _, tx0, _ = self.tiles[tile]
        wy, wx = self.ramps[tile]
        return torch.outer(wy[rect[0] - ty0 : rect[1] - ty0], wx[rect[2] - tx0 : rect[3] - tx0])


def _crop(t: torch.Tensor, origin: Rect, rect: Rect) -> torch.Tensor:
    """The part of ``t`` (whose last two dims start at ``origin``) covering absolute ``rect``."""
    return t[..., rect[0] - origin[0] : rect[1] - origin[0], rect[2] - origin[2] : rect[3] - origin[2]]


def _check_latent(z: torch.Tensor, plan: TilePlan) -> None:
    if not isinstance(z, torch.Tensor) or z.dim() not in (4, 5):
        raise ValueError(f"z must be a 4-D [B,C,h,w] or 5-D [B,C,T,h,w] latent (got {getattr(z, 'shape', z)})")
    if tuple(z.shape[-2:]) != plan.latent_size:
        raise ValueError(
            f"latent is {tuple(z.shape[-2:])} but the plan was made for {plan.latent_size} "
            f"({plan.height}x{plan.width} px at ratio {plan.ratio}); plan for this latent's image size"
        )


def _decode(vae, z: torch.Tensor) -> torch.Tensor:
    out = vae.decode(z)
    if isinstance(out, torch.Tensor):
        return out
    sample = getattr(out, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"{type(vae).__name__}.decode returned {type(out).__name__}, not a tensor or DecoderOutput")


def _decode_tile(vae, z: torch.Tensor, plan: TilePlan, geo: _Geometry, index: int, gn: "Optional[_GroupNormSync]"):
    y0, y1, x0, x1 = plan.tiles_latent[index]
    param = next(vae.parameters(), None)
    tile = z[..., y0:y1, x0:x1].to(dtype=param.dtype if param is not None else z.dtype).contiguous()
    if gn is None:
        out = _decode(vae, tile)
    else:
        gn.begin_tile(plan, index)
        try:
            out = _decode(vae, tile)
        except _StopTile:
            return None  # a statistics pass stopped after the level it collects
        gn.end_tile()
    py0, py1, px0, px1 = geo.tiles[index]
    if tuple(out.shape[-2:]) != (py1 - py0, px1 - px0):
        raise ValueError(
            f"{type(vae).__name__} decoded a {y1 - y0}x{x1 - x0} latent tile to {tuple(out.shape[-2:])} px, "
            f"expected {(py1 - py0, px1 - px0)} at the plan's ratio {plan.ratio}; the plan's family does not match the VAE"
        )
    return out


# --------------------------------------------------------------------------------------------------
# GroupNorm-synced tiles


class _Stats:
    """Per-(sample, group) count, mean and M2 in fp64; merged with Chan's parallel formula."""

    __slots__ = ("n", "mean", "m2", "invalid")

    def __init__(self, n, mean, m2, invalid):
        self.n, self.mean, self.m2, self.invalid = n, mean, m2, invalid

    def merge(self, other: "_Stats") -> "_Stats":
        n = self.n + other.n
        safe = torch.where(n > 0, n, torch.ones_like(n))
        delta = other.mean - self.mean
        mean = self.mean + delta * other.n / safe
        m2 = self.m2 + other.m2 + delta * delta * self.n * other.n / safe
        return _Stats(n, mean, m2, self.invalid + other.invalid)

    def pack(self) -> torch.Tensor:
        return torch.stack([self.n, self.mean, self.m2, self.invalid])

    @classmethod
    def unpack(cls, t: torch.Tensor) -> "_Stats":
        return cls(t[0], t[1], t[2], t[3])


def _merge_all(parts: Sequence[_Stats]) -> _Stats:
    total = parts[0]
    for p in parts[1:]:
        total = total.merge(p)
    return total


def _group_chunk(groups: int) -> int:
    """Groups handled per step where fp32 temporaries are made: an eighth of the layer, at least one."""
    return max(1, groups // 8)


class _StopTile(Exception):
    """Raised inside a statistics pass once the collected level is done: the tile's decode stops there."""


class _GroupNormSync:
    """A temporary forward on every ``nn.GroupNorm``: collect core statistics, or apply image-wide ones.

    GroupNorm calls are keyed by (module name, call index within one tile's decode), so a module called
    several times per decode (framewise video loops) gets one statistic per call.
    """

    def __init__(self, vae: nn.Module):
        self.norms = [(name, m) for name, m in vae.named_modules() if isinstance(m, nn.GroupNorm)]
        self.installed: List[nn.Module] = []
        self.collecting = False  # a statistics pass (else: the final pass, image-wide statistics everywhere)
        self.collect_level: Optional[int] = None  # the resolution level collected (None: every level at once)
        self.level = -1  # resolution level of the current call within this tile's decode
        self.last_scale: Optional[int] = None
        self.beyond = False  # a statistics pass reached a level after the collected one
        self.per_call = False  # every GroupNorm call is its own level (exact lockstep; one pass per call)
        self.tile_hw: Tuple[int, int] = (0, 0)
        self.core: Rect = (0, 0, 0, 0)
        self.calls: Dict[str, int] = {}
        self.current: Dict[tuple, _Stats] = {}  # merged over the tiles of the run being collected
        self.image: Dict[tuple, _Stats] = {}  # image-wide statistics applied in the apply pass
        self.call_count: Optional[int] = None

    def __bool__(self) -> bool:
        return bool(self.norms)

    # ---- install / remove
    def install(self) -> None:
        for name, module in self.norms:
            if "forward" in module.__dict__:
                raise RuntimeError(
                    f"{name} already has an instance-level forward (another adapter is applied); remove it before gn_sync"
                )
            # a temporary replacement of the instance's forward (not a post-hook): the apply pass then normalizes
            # once instead of running GroupNorm and overwriting its output
            module.forward = functools.partial(self._forward, name, module)
            setattr(module, GN_SYNC_HOOK, True)
            self.installed.append(module)

    def remove(self) -> None:
        for module in self.installed:
            module.__dict__.pop("forward", None)
            module.__dict__.pop(GN_SYNC_HOOK, None)
        self.installed.clear()

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    # ---- per tile
    def begin_tile(self, plan: TilePlan, index: int) -> None:
        y0, y1, x0, x1 = plan.tiles_latent[index]
        cy0, cy1, cx0, cx1 = plan.cores_latent[index]
        self.tile_hw = (y1 - y0, x1 - x0)
        self.core = (cy0 - y0, cy1 - y0, cx0 - x0, cx1 - x0)
        self.calls = {}
        self.level, self.last_scale = -1, None

    def end_tile(self) -> None:
        count = sum(self.calls.values())
        if self.call_count is None:
            self.call_count = count
        elif count != self.call_count:
            # backstop, not the guard: a decoder's GroupNorm calls depend on its structure and frames only
            raise RuntimeError(f"a tile made {count} GroupNorm calls, another {self.call_count}; cannot sync them")

    # ---- the replacement forward
    def _core_view(self, x: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[int]]:
        """This tile's core inside activation ``x`` and the activation's spatial scale over the latent tile."""
        th, tw = self.tile_hw
        if x.dim() == 3:  # attention's group_norm on [B, C, h*w]
            length = x.shape[-1]
            scale = next((s for s in (1, 2, 4, 8, 16, 32, 64) if th * s * tw * s == length), None)
            if scale is None:
                return None, None
            x = x.reshape(x.shape[0], x.shape[1], th * scale, tw * scale)
        if x.dim() < 4:
            return None, None
        h, w = x.shape[-2:]
        if h % th or w % tw or h // th != w // tw:
            return None, None
        s = h // th
        cy0, cy1, cx0, cx1 = self.core
        return x[..., cy0 * s : cy1 * s, cx0 * s : cx1 * s], s

    def _core_stats(self, core: Optional[torch.Tensor], x: torch.Tensor, b: int, g: int) -> _Stats:
        if core is None:
            zeros = torch.zeros(b, g, dtype=torch.float64, device=x.device)
            return _Stats(zeros, zeros, zeros, zeros + 1)
        cpg = x.shape[1] // g
        means, m2s = [], []
        for g0 in range(0, g, _group_chunk(g)):  # fp32 copies of a few groups at a time, not of the whole core
            g1 = min(g, g0 + _group_chunk(g))
            xs = core[:, g0 * cpg : g1 * cpg].reshape(b, g1 - g0, -1).float()
            var, mean = torch.var_mean(xs, dim=-1, correction=0)
            means.append(mean)
            m2s.append(var * xs.shape[-1])
        mean, m2 = torch.cat(means, 1).double(), torch.cat(m2s, 1).double()
        n = torch.full_like(mean, xs.shape[-1])
        return _Stats(n, mean, m2, torch.zeros_like(n))

    def _forward(self, name: str, module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        idx = self.calls.get(name, 0)
        self.calls[name] = idx + 1
        key = (name, idx)
        b, c, g = x.shape[0], x.shape[1], module.num_groups
        core, scale = self._core_view(x)
        if self.per_call:
            self.level += 1
        elif scale is not None and scale != self.last_scale:
            self.level, self.last_scale = self.level + 1, scale
        level = max(self.level, 0)
        if self.collecting:
            if self.collect_level is None or level == self.collect_level:
                now = self._core_stats(core, x, b, g)
                self.current[key] = self.current[key].merge(now) if key in self.current else now
                return type(module).forward(module, x)  # collected calls use each tile's own statistics
            if level > self.collect_level:
                self.beyond = True
                raise _StopTile  # the rest of this tile's decode cannot change the collected level
        stats = self.image.get(key)
        if stats is None:
            raise RuntimeError(f"no image-wide statistics for GroupNorm call {key}")  # backstop, not the guard
        if bool((stats.invalid > 0).any()):
            return type(module).forward(module, x)  # not mappable onto tile cores: keep per-tile statistics
        # nn.GroupNorm's biased variance, image-wide, folded with the affine into one per-channel scale and shift
        inv = torch.rsqrt(stats.m2 / stats.n + module.eps).to(torch.float32).repeat_interleave(c // g, dim=1)
        mean = stats.mean.to(torch.float32).repeat_interleave(c // g, dim=1)
        scale = inv * module.weight.float() if module.affine else inv
        shift = (module.bias.float() if module.affine else 0.0) - mean * scale
        view = (b, c) + (1,) * (x.dim() - 2)
        scale, shift = scale.view(view), shift.view(view)
        if x.dtype == torch.float32:
            return torch.addcmul(shift, x, scale)
        # fp32 arithmetic like GroupNorm's kernels, a few groups at a time (no whole-activation fp32 copy)
        out = torch.empty_like(x)
        step = _group_chunk(g) * (c // g)
        for c0 in range(0, c, step):
            sl = slice(c0, c0 + step)
            out[:, sl] = torch.addcmul(shift[:, sl], x[:, sl].float(), scale[:, sl]).to(x.dtype)
        return out

    # ---- statistics transport
    def take_run(self) -> Dict[tuple, _Stats]:
        run, self.current = self.current, {}
        return run

    def set_image(self, parts: Sequence[Dict[tuple, _Stats]]) -> None:
        """Merge per-run statistics (in run order) into the image-wide ones."""
        keys = list(parts[0])
        self.image.update({k: _merge_all([p[k] for p in parts]) for k in keys})


def _collect_pass(vae, z, plan, geo, gn: _GroupNormSync, tiles: Sequence[int]) -> Dict[tuple, _Stats]:
    gn.collecting = True
    gn.call_count = None
    try:
        for t in tiles:
            _decode_tile(vae, z, plan, geo, t, gn)
    finally:
        gn.collecting = False
    return gn.take_run()


GN_SYNC_MODES = ("levels", "two-pass", "exact")


def _gn_mode(gn_sync) -> Optional[str]:
    """``None`` (off) or one of :data:`GN_SYNC_MODES` (``True`` means ``"levels"``)."""
    if gn_sync is False or gn_sync is None:
        return None
    if gn_sync is True:
        return "levels"
    if gn_sync in GN_SYNC_MODES:
        return gn_sync
    raise ValueError(f"gn_sync must be False, True or one of {GN_SYNC_MODES} (got {gn_sync!r})")


def _sync_statistics(vae, z, plan, geo, gn: _GroupNormSync, ctx: Optional[ParallelContext], mode: str) -> None:
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
            parts = [{k: _Stats.unpack(gathered[r, i]) for i, k in enumerate(keys)} for r in range(ctx.world_size)]
            gn.beyond = bool((gathered[:, -1] > 0).any())
        gn.set_image(parts)
        if not gn.beyond:
            logger.debug("gn_sync %s: %d statistics pass(es)", mode, level + 1)
            return
        level += 1


# --------------------------------------------------------------------------------------------------
# modes


class _Blend:
    """Order-independent blend of whole tiles into the image: accumulate weight * tile and weight, divide once."""

    def __init__(self, plan: TilePlan, geo: _Geometry):
        self.plan, self.geo = plan, geo
        self.acc = self.wsum = self.dtype = None

    def add(self, t: int, out: torch.Tensor) -> None:
        if self.acc is None:
            self.dtype = out.dtype
            self.acc = torch.zeros(out.shape[:-2] + (self.plan.height, self.plan.width), dtype=torch.float32, device=out.device)
            self.wsum = torch.zeros(self.plan.height, self.plan.width, dtype=torch.float32, device=out.device)
        y0, y1, x0, x1 = self.geo.tiles[t]
        w = self.geo.weight(t, self.geo.tiles[t]).to(out.device)
        self.acc[..., y0:y1, x0:x1] += out.float() * w
        self.wsum[y0:y1, x0:x1] += w

    def result(self) -> Optional[torch.Tensor]:
        """The blended image, or ``None`` if no tile was added (a rank that received no output)."""
        return None if self.acc is None else (self.acc / self.wsum).to(self.dtype)


def _blend_cores(
    cores: Sequence[int], geo: _Geometry, pieces: Dict[Tuple[int, int], torch.Tensor], lead: torch.Tensor
) -> List[torch.Tensor]:
    """Blend each core from its covering tiles' pieces (``pieces[(tile, core)]``), in raster order."""
    out = []
    for k in cores:
        core = geo.cores[k]
        hk, wk = core[1] - core[0], core[3] - core[2]
        acc = torch.zeros(lead.shape[:-2] + (hk, wk), dtype=torch.float32, device=lead.device)
        wsum = torch.zeros(hk, wk, dtype=torch.float32, device=lead.device)
        for t in geo.covering[k]:
            rect = _intersect(geo.tiles[t], core)
            w = geo.weight(t, rect).to(lead.device)
            y0, y1, x0, x1 = (rect[0] - core[0], rect[1] - core[0], rect[2] - core[2], rect[3] - core[2])
            acc[..., y0:y1, x0:x1] += pieces[(t, k)].float() * w
            wsum[y0:y1, x0:x1] += w
        out.append((acc / wsum).to(lead.dtype))
    return out


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
    _check_latent(z, plan)
    geo = _Geometry(plan)
    gn_mode = _gn_mode(gn_sync)
    gn = _GroupNormSync(vae) if gn_mode is not None else None
    if gn is not None and not gn:
        gn = None  # no GroupNorm in this decoder: nothing to sync, no extra pass
    try:
        if gn is not None:
            gn.install()
            _sync_statistics(vae, z, plan, geo, gn, None, gn_mode)
        blend = _Blend(plan, geo)
        for t in range(plan.tile_count):
            blend.add(t, _decode_tile(vae, z, plan, geo, t, gn))
    finally:
        if gn is not None:
            gn.remove()
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
    _check_latent(z, plan)
    if plan.world_size != ctx.world_size:
        raise ValueError(
            f"the plan balances {plan.world_size} ranks but the group has {ctx.world_size}; plan for world_size={ctx.world_size}"
        )
    geo = _Geometry(plan)
    me = ctx.rank
    mine = list(plan.run_of(me))
    gn_mode = _gn_mode(gn_sync)
    gn = _GroupNormSync(vae) if gn_mode is not None else None
    if gn is not None and not gn:
        gn = None
    outs: Dict[int, torch.Tensor] = {}
    try:
        if gn is not None:
            gn.install()
            _sync_statistics(vae, z, plan, geo, gn, ctx, gn_mode)
        for t in mine:
            outs[t] = _decode_tile(vae, z, plan, geo, t, gn)
    finally:
        if gn is not None:
            gn.remove()
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
            rect = _intersect(geo.tiles[t], geo.cores[k])
            if src == me:
                sends.setdefault(dst, []).append(_crop(outs[t], geo.tiles[t], rect))
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
                pieces[(t, k)] = _crop(outs[t], geo.tiles[t], _intersect(geo.tiles[t], geo.cores[k]))
    blended = _blend_cores(mine, geo, pieces, lead)
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

    _check_latent(z, plan)
    geo = _Geometry(plan)
    blend = _Blend(plan, geo)
    for t in range(plan.tile_count):
        y0, y1, x0, x1 = plan.tiles_latent[t]
        out = row_decode(vae, z[..., y0:y1, x0:x1].contiguous(), ctx)
        if out is not None:
            blend.add(t, out)
    return blend.result()


def seam_error(image: torch.Tensor, reference: torch.Tensor, plan: TilePlan, band: int = 0) -> dict:
    """Mean absolute error of a tiled decode against a reference, overall and inside the overlap bands.

    Args:
        band: half-width in pixels of the band around each seam's centre; 0 means the full overlap.

    Returns:
        ``{"mean_abs": ..., "max_abs": ..., "seam_mean_abs": ..., "interior_mean_abs": ...}`` (floats).
    """
    diff = (image.float() - reference.float()).abs()
    mask = torch.zeros(plan.height, plan.width, dtype=torch.bool, device=diff.device)
    rows, cols = plan.grid
    tiles = plan.tiles_pixels
    ys = [(t[0], t[1]) for t in tiles[::cols]]
    xs = [(t[2], t[3]) for t in tiles[:cols]]
    for (a0, b0), (a1, _) in zip(ys, ys[1:]):
        lo, hi = (a1, b0) if not band else ((a1 + b0) // 2 - band, (a1 + b0) // 2 + band)
        mask[max(lo, 0) : hi, :] = True
    for (a0, b0), (a1, _) in zip(xs, xs[1:]):
        lo, hi = (a1, b0) if not band else ((a1 + b0) // 2 - band, (a1 + b0) // 2 + band)
        mask[:, max(lo, 0) : hi] = True
    per_pixel = diff.reshape(-1, plan.height, plan.width).mean(0)
    seam = per_pixel[mask]
    interior = per_pixel[~mask]
    return {
        "mean_abs": float(diff.mean()),
        "max_abs": float(diff.max()),
        "seam_mean_abs": float(seam.mean()) if seam.numel() else 0.0,
        "interior_mean_abs": float(interior.mean()) if interior.numel() else 0.0,
    }
