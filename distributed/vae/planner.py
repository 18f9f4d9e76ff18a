"""The tile planner: which spatial windows a tiled decode uses, chosen from geometry alone.

Design decisions:

* **Geometry only, deterministic.** A plan depends on the family's spatial compression ratio, the
  image shape and the world size, nothing measured, so every rank (and every machine) derives the
  same plans without a collective, and a plan can travel to a Ray actor as a plain dict
  (:meth:`TilePlan.to_dict` / :meth:`TilePlan.from_dict`).
* **Tiles live on the latent grid.** A tile is a rectangle of latent units; its output-pixel rectangle
  is that times the spatial ratio. Windows and overlaps are reported in output pixels (seed 000's
  ``MODE:WINDOW_HxW@OVERLAP_HxW``) and must be whole multiples of the ratio.
* **Tiles step by ``window - overlap`` and the last one is clipped** to the image edge (never shifted
  back), so edge tiles are cheaper and ranks are balanced by *area*, not by tile count. The grid on an
  axis is the fewest tiles that cover it, so no tile is wholly inside its neighbours.
* **Overlap is searched, not pinned.** ``window = pitch + overlap``; pinning overlap at a VAE's native
  value puts a floor under every window, so the search runs from half the pitch down to the smallest
  overlap that is still a quarter of its window (a blend narrower than that reads as a band, seed 000).
* **Constraints** (seed 000 and issue 4): up to four tiles per rank (and at least ``max(2, ranks)``),
  every tile at least :data:`MIN_TILE_LATENT` latent units on its narrow axis (below that a tile
  normalizes over content too unrepresentative of the image), an untiled axis has zero overlap, a
  tiled axis's overlap is at least a quarter of the window, and there are at least as many tiles as
  ranks. Exact plans (``--case local:...``) are validated structurally (whole latent units, overlap
  smaller than the window, zero overlap on an untiled axis, tile size, tiles >= ranks) but may use a
  thinner blend: they exist to reproduce a measurement, not to choose one.
* **Selection.** Candidates worse on all of window area, decoded area, rank imbalance and tile columns
  are dropped (Pareto frontier). ``coarse`` has the largest window, ``fine`` the smallest, and
  ``balanced`` minimizes the worst normalized (window area, decoded area, imbalance) score among the
  rest (``None`` where only two distinct windows remain).
* **Video: spatial tiles over all frames.** Every tile carries every latent frame. The causal video
  decoders thread a temporal cache (or a framewise loop) through the frames, and their temporal
  compression is not invertible per chunk; cutting time would need a second, temporal blend and would
  break that cache. The family's own decode keeps control of time, so a plan for a video depends only
  on (height, width, ranks); ``frames`` is recorded so the report states the decoded volume.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, replace
from functools import cached_property
from typing import List, NamedTuple, Optional, Sequence, Tuple

__all__ = [
    "MIN_TILE_LATENT",
    "TILES_PER_RANK",
    "TilePlan",
    "PlanReport",
    "CaseSpec",
    "plan_tiles",
    "exact_plan",
    "parse_case",
    "plan_main",
]

MIN_TILE_LATENT = 16
"""Smallest latent extent of a tile on its narrow axis (seed 000; measured on FLUX.2 between 12 and 16)."""

TILES_PER_RANK = 4
"""The search considers grids of ``max(2, ranks)`` up to ``4 * ranks`` tiles."""

PLAN_NAMES = ("coarse", "balanced", "fine")
MODES = ("unsharded", "row", "local", "tile-runs", "row-tiled")
TILED_MODES = ("local", "tile-runs", "row-tiled")

Rect = Tuple[int, int, int, int]  # (y0, y1, x0, x1), half-open


# --------------------------------------------------------------------------------------------------
# family lookup (lazy: families.py is optional for the geometry)


def _spatial_ratio(family) -> Tuple[str, int]:
    """``(name, spatial_ratio)`` for a family name or any object with ``spatial_ratio``."""
    if isinstance(family, str):
        try:
            from .families import FAMILIES
        except ImportError as exc:  # pragma: no cover - families.py is part of the package
            raise ValueError(f"family {family!r}: the families table is unavailable ({exc})") from exc
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; choose one of {', '.join(sorted(FAMILIES))}")
        return family, int(FAMILIES[family].spatial_ratio)
    ratio = getattr(family, "spatial_ratio", None)
    if not isinstance(ratio, int) or ratio < 1:
        raise TypeError(f"family must be a family name or carry an int spatial_ratio (got {family!r})")
    return str(getattr(family, "name", "custom")), ratio


def _latent_hw(ratio: int, height: int, width: int) -> Tuple[int, int]:
    for label, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{label} must be a positive int (got {value!r})")
        if value % ratio:
            lower, upper = value // ratio * ratio, -(-value // ratio) * ratio
            nearest = [v for v in (lower, upper) if v > 0]
            raise ValueError(
                f"{label} {value} is not a multiple of the family's spatial ratio {ratio}; "
                f"nearest valid: {' or '.join(str(v) for v in nearest)}"
            )
    return height // ratio, width // ratio


# --------------------------------------------------------------------------------------------------
# geometry


def _axis_tiles(length: int, window: int, overlap: int) -> List[Tuple[int, int]]:
    """Fewest tiles of ``window`` stepping by ``window - overlap`` that cover ``[0, length)``, last clipped."""
    if window >= length:
        return [(0, length)]
    stride = window - overlap
    count = 1 + -(-(length - window) // stride)
    return [(i * stride, min(i * stride + window, length)) for i in range(count)]


def _axis_cuts(spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Partition of the axis into per-tile cores: each seam is cut in the middle of its overlap."""
    cuts = [0]
    for (a_prev, b_prev), (a, _b) in zip(spans, spans[1:]):
        cuts.append((a + b_prev) // 2)
    cuts.append(spans[-1][1])
    return [(cuts[i], cuts[i + 1]) for i in range(len(spans))]


def _contiguous_runs(weights: Sequence[int], ranks: int) -> Tuple[Tuple[int, int], ...]:
    """Split ``weights`` (raster order) into ``ranks`` non-empty contiguous runs minimizing the largest sum.

    The smallest feasible bound is found by bisection over integer loads; the runs are then filled
    greedily under that bound while leaving at least one tile for every later rank (which never makes
    the bound infeasible: a capped run leaves exactly one tile per remaining rank, each below the bound).
    """
    n = len(weights)
    if n < ranks:
        raise ValueError(f"{n} tiles cannot be split over {ranks} ranks")  # backstop, not the guard
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def parts_needed(bound: int) -> int:
        parts, load = 1, 0
        for w in weights:
            if load + w > bound:
                parts, load = parts + 1, 0
            load += w
        return parts

    lo, hi = max(weights), prefix[-1]
    while lo < hi:  # the smallest bound that ``ranks`` runs can meet
        mid = (lo + hi) // 2
        if parts_needed(mid) <= ranks:
            hi = mid
        else:
            lo = mid + 1
    bound = lo
    runs, start = [], 0
    for r in range(ranks):
        stop = start + 1
        keep_for_rest = ranks - r - 1
        while stop < n - keep_for_rest and prefix[stop + 1] - prefix[start] <= bound:
            stop += 1
        if r == ranks - 1:
            stop = n
        runs.append((start, stop))
        start = stop
    return tuple(runs)


def _imbalance(max_load: int, total: int, ranks: int) -> float:
    return max_load * ranks / total - 1.0


# --------------------------------------------------------------------------------------------------
# the plan value


@dataclass(frozen=True)
class TilePlan:
    """One tile plan: a window, an overlap, the tiles they make and the ranks' runs of tiles.

    All geometry is derived from ``(ratio, height, width, world_size, latent_window, latent_overlap)``;
    the other fields are computed once by :func:`_build_plan` and recorded so a plan reads as data.

    Args:
        name: ``"coarse"``, ``"balanced"``, ``"fine"`` or ``"exact"``.
        family: the family name the plan was made for (informational; ``ratio`` is what geometry uses).
        ratio: the family's spatial compression ratio (output pixels per latent unit).
        height, width: the output image, pixels. ``frames``: output frames (every tile carries all).
        world_size: ranks the runs are balanced over.
        latent_window, latent_overlap: ``(h, w)`` in latent units.
        grid: ``(rows, cols)`` of tiles.
        tiles_latent: tile rectangles ``(y0, y1, x0, x1)`` in latent units, raster order (clipped).
        runs: per rank ``(start, stop)`` into ``tiles_latent``: contiguous, non-empty, balanced by area.

    Example:
        >>> from collections import namedtuple
        >>> kl = namedtuple("Fam", "name spatial_ratio")("kl", 8)
        >>> plan = exact_plan(kl, 1024, 1536, 1, 4, window=(480, 736), overlap=(64, 32))
        >>> plan.grid, plan.window, plan.overlap
        ((3, 3), (480, 736), (64, 32))
    """

    name: str
    family: str
    ratio: int
    height: int
    width: int
    frames: int
    world_size: int
    latent_window: Tuple[int, int]
    latent_overlap: Tuple[int, int]
    grid: Tuple[int, int]
    tiles_latent: Tuple[Rect, ...]
    runs: Tuple[Tuple[int, int], ...]

    # ---- derived geometry
    @property
    def window(self) -> Tuple[int, int]:
        """Window ``(h, w)`` in output pixels."""
        return (self.latent_window[0] * self.ratio, self.latent_window[1] * self.ratio)

    @property
    def overlap(self) -> Tuple[int, int]:
        """Overlap ``(h, w)`` in output pixels."""
        return (self.latent_overlap[0] * self.ratio, self.latent_overlap[1] * self.ratio)

    @property
    def latent_size(self) -> Tuple[int, int]:
        return (self.height // self.ratio, self.width // self.ratio)

    @property
    def tiles_pixels(self) -> Tuple[Rect, ...]:
        r = self.ratio
        return tuple((y0 * r, y1 * r, x0 * r, x1 * r) for y0, y1, x0, x1 in self.tiles_latent)

    @property
    def cores_latent(self) -> Tuple[Rect, ...]:
        """Each tile's core: a partition of the image, seams cut mid-overlap (the pixels a tile owns)."""
        rows, cols = self.grid
        ys = _axis_cuts([(t[0], t[1]) for t in self.tiles_latent[::cols]])
        xs = _axis_cuts([(t[2], t[3]) for t in self.tiles_latent[:cols]])
        return tuple((y0, y1, x0, x1) for (y0, y1) in ys for (x0, x1) in xs)

    def run_of(self, rank: int) -> range:
        start, stop = self.runs[rank]
        return range(start, stop)

    def owner_of(self, tile: int) -> int:
        for rank, (start, stop) in enumerate(self.runs):
            if start <= tile < stop:
                return rank
        raise IndexError(f"tile {tile} is outside the plan's {len(self.tiles_latent)} tiles")

    # ---- objectives (output pixels)
    @property
    def tile_count(self) -> int:
        return len(self.tiles_latent)

    @property
    def window_area(self) -> int:
        return self.window[0] * self.window[1]

    def _area(self, t: Rect) -> int:
        return (t[1] - t[0]) * (t[3] - t[2]) * self.ratio * self.ratio

    @cached_property
    def decoded_area(self) -> int:
        return sum(self._area(t) for t in self.tiles_latent)

    @cached_property
    def rank_areas(self) -> Tuple[int, ...]:
        return tuple(sum(self._area(self.tiles_latent[i]) for i in range(a, b)) for a, b in self.runs)

    @property
    def coverage(self) -> float:
        """Decoded area over image area (overlap raises it above one)."""
        return self.decoded_area / (self.height * self.width)

    @cached_property
    def imbalance(self) -> float:
        """Busiest rank's decoded area over the mean, minus one."""
        return _imbalance(max(self.rank_areas), self.decoded_area, self.world_size)

    @property
    def tile_columns(self) -> int:
        return self.grid[1]

    @property
    def row_shard_area(self) -> float:
        return self.height / self.world_size * self.width

    @property
    def beats_row_sharding(self) -> bool:
        """Whether the window is smaller than one row-sharded rank's ``(height / ranks) * width``."""
        return self.window_area * self.world_size < self.height * self.width

    def objectives(self) -> dict:
        return {
            "window_area": self.window_area,
            "decoded_area": self.decoded_area,
            "coverage": round(self.coverage, 6),
            "imbalance": round(self.imbalance, 6),
            "tile_columns": self.tile_columns,
            "tile_count": self.tile_count,
            "max_rank_area": max(self.rank_areas),
            "row_shard_area": self.row_shard_area,
            "beats_row_sharding": self.beats_row_sharding,
        }

    @cached_property
    def _key(self) -> tuple:
        """Objective vector for dominance: all minimized."""
        return (self.window_area, self.decoded_area, self.imbalance, self.tile_columns)

    def case(self, mode: str = "tile-runs") -> str:
        """The seed-000 exact case string that reproduces this plan, e.g. ``tile-runs:480x736@64x32``."""
        (wh, ww), (oh, ow) = self.window, self.overlap
        return f"{mode}:{wh}x{ww}@{oh}x{ow}"

    # ---- data
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "family": self.family,
            "ratio": self.ratio,
            "height": self.height,
            "width": self.width,
            "frames": self.frames,
            "world_size": self.world_size,
            "window": list(self.window),
            "overlap": list(self.overlap),
            "latent_window": list(self.latent_window),
            "latent_overlap": list(self.latent_overlap),
            "grid": list(self.grid),
            "tiles_latent": [list(t) for t in self.tiles_latent],
            "tiles_pixels": [list(t) for t in self.tiles_pixels],
            "runs": [list(r) for r in self.runs],
            "objectives": self.objectives(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TilePlan":
        """Rebuild a plan from :meth:`to_dict`; the geometry is recomputed and checked against the dict."""
        try:
            plan = _build_plan(
                name=str(data["name"]),
                family=str(data["family"]),
                ratio=int(data["ratio"]),
                height=int(data["height"]),
                width=int(data["width"]),
                frames=int(data.get("frames", 1)),
                world_size=int(data["world_size"]),
                latent_window=tuple(int(v) for v in data["latent_window"]),
                latent_overlap=tuple(int(v) for v in data["latent_overlap"]),
            )
        except KeyError as exc:
            raise ValueError(f"plan dict lacks the field {exc.args[0]!r}") from None
        for field_name in ("tiles_latent", "runs", "grid"):
            if field_name in data:
                got = [list(v) if isinstance(v, (list, tuple)) else v for v in data[field_name]]
                want = plan.to_dict()[field_name]
                if got != want:
                    raise ValueError(f"plan dict's {field_name} does not match its geometry ({got} vs {want})")
        return plan


def _build_plan(name, family, ratio, height, width, frames, world_size, latent_window, latent_overlap) -> TilePlan:
    lat_h, lat_w = height // ratio, width // ratio
    ys = _axis_tiles(lat_h, latent_window[0], latent_overlap[0])
    xs = _axis_tiles(lat_w, latent_window[1], latent_overlap[1])
    tiles = tuple((y0, y1, x0, x1) for (y0, y1) in ys for (x0, x1) in xs)
    if len(tiles) < world_size:
        raise ValueError(f"{len(tiles)} tiles cannot be split over {world_size} ranks")
    areas = [(t[1] - t[0]) * (t[3] - t[2]) for t in tiles]
    return TilePlan(
        name=name,
        family=family,
        ratio=ratio,
        height=height,
        width=width,
        frames=frames,
        world_size=world_size,
        latent_window=(min(latent_window[0], lat_h), min(latent_window[1], lat_w)),
        latent_overlap=tuple(latent_overlap),
        grid=(len(ys), len(xs)),
        tiles_latent=tiles,
        runs=_contiguous_runs(areas, world_size),
    )


def _violations(plan: TilePlan, min_tile_latent: int, quarter_blend: bool) -> List[str]:
    """Every constraint the plan breaks, as readable reasons (empty: valid)."""
    reasons = []
    lat = plan.latent_size
    for axis, label in ((0, "height"), (1, "width")):
        window, overlap = plan.latent_window[axis], plan.latent_overlap[axis]
        tiled = plan.grid[axis] > 1
        if not tiled and overlap:
            reasons.append(f"the {label} axis is untiled, so its overlap must be 0 (got {overlap * plan.ratio} px)")
        if tiled and not 0 <= overlap < window:
            reasons.append(f"{label} overlap {overlap * plan.ratio} px must be below the window {window * plan.ratio} px")
        if tiled and quarter_blend and overlap * 4 < window:
            reasons.append(
                f"{label} overlap {overlap * plan.ratio} px is under a quarter of its window {window * plan.ratio} px"
            )
        if window > lat[axis]:
            reasons.append(f"{label} window exceeds the image")
    narrow = min(plan.latent_window)
    if narrow < min_tile_latent:
        reasons.append(
            f"the window is {narrow} latent units ({narrow * plan.ratio} px) on its narrow axis; "
            f"a tile needs at least {min_tile_latent} ({min_tile_latent * plan.ratio} px)"
        )
    return reasons


# --------------------------------------------------------------------------------------------------
# search


class PlanReport(NamedTuple):
    """What :func:`plan_tiles` found.

    ``balanced`` is ``None`` where the frontier holds only two distinct windows; ``frontier`` is sorted
    by window area, largest first.
    """

    coarse: TilePlan
    balanced: Optional[TilePlan]
    fine: TilePlan
    frontier: List[TilePlan]
    candidate_limit: int
    frontier_size: int
    candidates_considered: int

    @property
    def plans(self) -> List[TilePlan]:
        return [p for p in (self.coarse, self.balanced, self.fine) if p is not None]

    def to_dict(self) -> dict:
        return {
            "plans": [p.to_dict() for p in self.plans],
            "frontier": [p.to_dict() for p in self.frontier],
            "candidate_limit": self.candidate_limit,
            "frontier_size": self.frontier_size,
            "candidates_considered": self.candidates_considered,
            "frames": "spatial tiles only: every tile carries all frames (the family's decode keeps control of time)",
        }


def _overlap_options(length: int, count: int) -> Tuple[int, ...]:
    """Overlaps (latent units) to try on an axis cut into ``count`` tiles, widest first.

    From half the pitch down to the narrowest blend that is still a quarter of its window
    (``4 * overlap >= pitch + overlap``, i.e. a third of the pitch), with the midpoint between them.
    """
    if count == 1:
        return (0,)
    pitch = -(-length // count)
    low, high = -(-pitch // 3), max(-(-pitch // 3), pitch // 2)
    return tuple(sorted({low, (low + high) // 2, high}, reverse=True))


def _dominates(ka: tuple, kb: tuple) -> bool:
    """Objective vector ``ka`` is no worse than ``kb`` everywhere and better somewhere."""
    return ka[0] <= kb[0] and ka[1] <= kb[1] and ka[2] <= kb[2] and ka[3] <= kb[3] and ka != kb


def _pareto(candidates: List[TilePlan]) -> List[TilePlan]:
    keys = [c._key for c in candidates]
    return [c for c, kc in zip(candidates, keys) if not any(_dominates(ko, kc) for ko in keys)]


def _tie(plan: TilePlan) -> tuple:
    return (plan.latent_window, plan.latent_overlap)


def _search(name: str, ratio: int, height: int, width: int, frames: int, world_size: int):
    lat_h, lat_w = height // ratio, width // ratio
    max_tiles = TILES_PER_RANK * world_size
    min_tiles = max(2, world_size)
    seen = {}
    considered = 0
    for rows in range(1, max_tiles + 1):
        for cols in range(1, max_tiles // rows + 1):
            if rows * cols < min_tiles:
                continue
            for oh in _overlap_options(lat_h, rows):
                for ow in _overlap_options(lat_w, cols):
                    wh = -(-lat_h // rows) + oh if rows > 1 else lat_h
                    ww = -(-lat_w // cols) + ow if cols > 1 else lat_w
                    if (rows > 1 and wh >= lat_h) or (cols > 1 and ww >= lat_w):
                        continue  # a window as large as the image is an untiled axis, found at count 1
                    key = ((wh, ww), (oh, ow))
                    if key in seen:
                        continue
                    considered += 1
                    ys = _axis_tiles(lat_h, wh, oh)
                    xs = _axis_tiles(lat_w, ww, ow)
                    if not min_tiles <= len(ys) * len(xs) <= max_tiles or len(ys) * len(xs) < world_size:
                        seen[key] = None
                        continue
                    plan = _build_plan("candidate", name, ratio, height, width, frames, world_size, (wh, ww), (oh, ow))
                    seen[key] = plan if not _violations(plan, MIN_TILE_LATENT, quarter_blend=True) else None
    candidates = [p for p in seen.values() if p is not None]
    return candidates, considered, max_tiles


def _select(frontier: List[TilePlan]):
    coarse = min(frontier, key=lambda p: (-p.window_area, p.decoded_area, p.imbalance, p.tile_columns, _tie(p)))
    fine = min(frontier, key=lambda p: (p.window_area, p.decoded_area, p.imbalance, p.tile_columns, _tie(p)))
    if fine.window_area >= coarse.window_area:
        return coarse, None, None
    taken = {coarse.latent_window, fine.latent_window}
    rest = [p for p in frontier if p.latent_window not in taken]
    balanced = None
    if rest:
        spans = []
        for attr in ("window_area", "decoded_area", "imbalance"):
            values = [getattr(p, attr) for p in frontier]
            spans.append((attr, min(values), max(values)))

        def score(p):
            d = [0.0 if hi == lo else (getattr(p, attr) - lo) / (hi - lo) for attr, lo, hi in spans]
            return (max(d), sum(d), _tie(p))

        balanced = min(rest, key=score)
    return coarse, balanced, fine


def _renamed(plan: TilePlan, name: str) -> TilePlan:
    return replace(plan, name=name)


def _try_plan(name, ratio, height, width, frames, world_size) -> Optional[PlanReport]:
    candidates, considered, limit = _search(name, ratio, height, width, frames, world_size)
    if not candidates:
        return None
    frontier = sorted(_pareto(candidates), key=lambda p: (-p.window_area, p.decoded_area, p.imbalance, _tie(p)))
    coarse, balanced, fine = _select(frontier)
    if fine is None:
        return None
    return PlanReport(
        coarse=_renamed(coarse, "coarse"),
        balanced=_renamed(balanced, "balanced") if balanced is not None else None,
        fine=_renamed(fine, "fine"),
        frontier=frontier,
        candidate_limit=limit,
        frontier_size=len(frontier),
        candidates_considered=considered,
    )


def _nearest_request(name, ratio, height, width, frames, world_size) -> str:
    """The closest request that plans: fewer ranks first, else the smallest proportional enlargement."""
    suggestions = []
    for ranks in range(world_size - 1, 0, -1):
        if _try_plan(name, ratio, height, width, frames, ranks) is not None:
            suggestions.append(f"--ranks {ranks}")
            break
    lat_h, lat_w = height // ratio, width // ratio
    for step in range(1, 65):
        scale = 1 + step / 8
        h = max(math.ceil(lat_h * scale), lat_h + 1) * ratio
        w = max(math.ceil(lat_w * scale), lat_w + 1) * ratio
        if _try_plan(name, ratio, h, w, frames, world_size) is not None:
            suggestions.append(f"--height {h} --width {w} at --ranks {world_size}")
            break
    return " or ".join(suggestions) if suggestions else "a larger image and fewer ranks"


def plan_tiles(family, height: int, width: int, frames: int = 1, world_size: int = 1) -> PlanReport:
    """Search tile plans for one image and world size; return coarse, balanced, fine and the frontier.

    Args:
        family: a family name from ``families.FAMILIES`` (or any object with ``spatial_ratio``).
        height, width: output image size in pixels (multiples of the spatial ratio).
        frames: output frames (video); every tile carries all of them, so plans do not depend on it.
        world_size: ranks the tiles are shared by (1: local tiling on one device).

    Returns:
        :class:`PlanReport`.

    Raises:
        ValueError: the request cannot be planned (image too small for sixteen-latent tiles, more ranks
            than useful tiles, fewer than two distinct plans); the message names the reason and the
            nearest valid request.

    Example:
        >>> from collections import namedtuple
        >>> kl = namedtuple("Fam", "name spatial_ratio")("kl", 8)
        >>> report = plan_tiles(kl, 1024, 1024, world_size=4)
        >>> report.coarse.window_area > report.fine.window_area
        True
    """
    name, ratio = _spatial_ratio(family)
    lat_h, lat_w = _latent_hw(ratio, height, width)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (got {world_size!r})")
    if not isinstance(frames, int) or frames < 1:
        raise ValueError(f"frames must be a positive int (got {frames!r})")
    report = _try_plan(name, ratio, height, width, frames, world_size)
    if report is not None:
        return report
    if min(lat_h, lat_w) < MIN_TILE_LATENT:
        reason = (
            f"{height}x{width} is {lat_h}x{lat_w} latent units; a tile needs at least {MIN_TILE_LATENT} "
            f"({MIN_TILE_LATENT * ratio} px) on its narrow axis"
        )
    elif _search(name, ratio, height, width, frames, world_size)[0]:
        reason = f"{height}x{width} at {world_size} ranks admits only one distinct tile window"
    else:
        reason = (
            f"{height}x{width} ({lat_h}x{lat_w} latent) cannot be cut into at least {max(2, world_size)} tiles of "
            f">= {MIN_TILE_LATENT} latent units with a quarter-window blend: more ranks than useful tiles"
        )
    raise ValueError(f"{reason}; nearest valid request: {_nearest_request(name, ratio, height, width, frames, world_size)}")


def _pair(value, label) -> Tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{label} must be a (height, width) pair (got {value!r})")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{label} must hold ints (got {value!r})")
    return int(value[0]), int(value[1])


def exact_plan(
    family,
    height: int,
    width: int,
    frames: int,
    world_size: int,
    window: Tuple[int, int],
    overlap: Tuple[int, int],
    *,
    min_tile_latent: int = MIN_TILE_LATENT,
    name: str = "exact",
) -> TilePlan:
    """Validate and build the plan for an exact window and overlap (output pixels), as in seed 000's cases.

    A window at least as large as the image on an axis leaves that axis untiled (its overlap must be 0).
    The quarter-window blend is not enforced here: exact cases reproduce measurements.

    Raises:
        ValueError: naming the broken constraint and the nearest valid window/overlap or rank count.

    Example:
        >>> from collections import namedtuple
        >>> kl = namedtuple("Fam", "name spatial_ratio")("kl", 8)
        >>> exact_plan(kl, 1024, 1536, 1, 4, (480, 736), (64, 32)).tile_count
        9
    """
    fam, ratio = _spatial_ratio(family)
    lat_h, lat_w = _latent_hw(ratio, height, width)
    window, overlap = _pair(window, "window"), _pair(overlap, "overlap")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (got {world_size!r})")
    lat_win, lat_ov = [], []
    for axis, label, length in ((0, "height", lat_h), (1, "width", lat_w)):
        w, o = window[axis], overlap[axis]
        if w <= 0 or o < 0:
            raise ValueError(f"window {label} must be > 0 and overlap >= 0 (got {w} and {o})")
        for what, v in (("window", w), ("overlap", o)):
            if v % ratio:
                near = max(ratio, round(v / ratio) * ratio) if what == "window" else round(v / ratio) * ratio
                raise ValueError(
                    f"{what} {label} {v} px is not a whole number of latent units (ratio {ratio}); nearest valid: {near}"
                )
        lw, lo = w // ratio, o // ratio
        if lw >= length:
            if lo:
                raise ValueError(
                    f"window {label} {w} px covers the image ({length * ratio} px), so that axis is untiled and its "
                    f"overlap must be 0 (got {o}); nearest valid: overlap {label} 0"
                )
            lw = length
        elif lo >= lw:
            raise ValueError(
                f"overlap {label} {o} px must be smaller than its window {w} px; nearest valid: {(lw - 1) * ratio}"
            )
        lat_win.append(lw)
        lat_ov.append(lo)
    ys = _axis_tiles(lat_h, lat_win[0], lat_ov[0])
    xs = _axis_tiles(lat_w, lat_win[1], lat_ov[1])
    if len(ys) * len(xs) < world_size:
        raise ValueError(
            f"window {window[0]}x{window[1]}@{overlap[0]}x{overlap[1]} makes {len(ys) * len(xs)} tiles, fewer than "
            f"{world_size} ranks (more ranks than useful tiles); nearest valid: --ranks {len(ys) * len(xs)} or a "
            f"smaller window"
        )
    plan = _build_plan(name, fam, ratio, height, width, frames, world_size, tuple(lat_win), tuple(lat_ov))
    reasons = _violations(plan, min_tile_latent, quarter_blend=False)
    if reasons:
        raise ValueError(
            f"window {window[0]}x{window[1]}@{overlap[0]}x{overlap[1]} is invalid for {height}x{width}: "
            + "; ".join(reasons)
            + f"; nearest valid: a window of at least {min_tile_latent * ratio} px on each tiled axis"
        )
    return plan


# --------------------------------------------------------------------------------------------------
# case strings


class CaseSpec(NamedTuple):
    """A parsed ``--case``: ``mode`` plus, for tiled modes, window and overlap ``(h, w)`` in output pixels."""

    mode: str
    window: Optional[Tuple[int, int]]
    overlap: Optional[Tuple[int, int]]

    @property
    def label(self) -> str:
        if self.window is None:
            return self.mode
        return f"{self.mode}-{self.window[0]}x{self.window[1]}-ov{self.overlap[0]}x{self.overlap[1]}"

    @property
    def tiled(self) -> bool:
        return self.mode in TILED_MODES


_CASE_EXAMPLE = "e.g. 'unsharded', 'row' or 'tile-runs:480x736@64x32' (MODE:WINDOW_HxW@OVERLAP_HxW, output pixels)"
_PAIR = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_case(text: str) -> CaseSpec:
    """Parse seed 000's case strings: ``unsharded``, ``row`` or ``MODE:WINDOW_HxW@OVERLAP_HxW``.

    ``MODE`` is ``local``, ``tile-runs`` or ``row-tiled``; window and overlap are output pixels. Whether
    the window fits an image is checked later, by :func:`exact_plan`, which knows the image.

    Raises:
        ValueError: the reason and an example of the valid form.

    Example:
        >>> parse_case("local:480x736@64x32")
        CaseSpec(mode='local', window=(480, 736), overlap=(64, 32))
    """
    if not isinstance(text, str):
        raise ValueError(f"a case must be a string ({_CASE_EXAMPLE}), got {text!r}")
    value = text.strip()
    if value in ("unsharded", "row"):
        return CaseSpec(value, None, None)
    if ":" not in value:
        if value in TILED_MODES:
            raise ValueError(f"case {text!r} needs a window and an overlap: {value}:480x736@64x32")
        raise ValueError(f"unknown case {text!r}; valid cases: {_CASE_EXAMPLE}")
    mode, _, rest = value.partition(":")
    mode = mode.strip()
    if mode not in TILED_MODES:
        raise ValueError(f"unknown tiled mode {mode!r} in case {text!r}; choose local, tile-runs or row-tiled, {_CASE_EXAMPLE}")
    if rest.count("@") != 1:
        raise ValueError(f"case {text!r} must have one '@' between window and overlap, {_CASE_EXAMPLE}")
    win_text, ov_text = rest.split("@")
    pairs = []
    for label, part in (("window", win_text), ("overlap", ov_text)):
        match = _PAIR.match(part)
        if not match:
            raise ValueError(f"case {text!r}: {label} {part!r} must be HEIGHTxWIDTH in whole pixels, {_CASE_EXAMPLE}")
        pairs.append((int(match.group(1)), int(match.group(2))))
    window, overlap = pairs
    if min(window) <= 0:
        raise ValueError(f"case {text!r}: window axes must be positive, {_CASE_EXAMPLE}")
    for axis, label in ((0, "height"), (1, "width")):
        if overlap[axis] and overlap[axis] >= window[axis]:
            raise ValueError(
                f"case {text!r}: overlap {label} {overlap[axis]} must be smaller than the window {window[axis]}, "
                f"{_CASE_EXAMPLE}"
            )
    return CaseSpec(mode, window, overlap)


# --------------------------------------------------------------------------------------------------
# CLI: python -m patchray plan ...


def _plan_line(plan: TilePlan) -> str:
    o = plan.objectives()
    return (
        f"{plan.name:>9}  window {plan.window[0]}x{plan.window[1]} @ {plan.overlap[0]}x{plan.overlap[1]}  "
        f"grid {plan.grid[0]}x{plan.grid[1]} ({plan.tile_count} tiles)  coverage {o['coverage']:.3f}  "
        f"imbalance {o['imbalance']:.3f}  beats_row_sharding {o['beats_row_sharding']}  case {plan.case()}"
    )


def plan_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m patchray plan --family F --height H --width W [--frames T] --ranks N [--json]``."""
    parser = argparse.ArgumentParser(prog="python -m patchray plan", description="Tile plans for a tiled VAE decode.")
    parser.add_argument("--family", required=True, help="VAE family, e.g. kl, flux2, wan")
    parser.add_argument("--height", type=int, required=True, help="output height in pixels")
    parser.add_argument("--width", type=int, required=True, help="output width in pixels")
    parser.add_argument("--frames", type=int, default=1, help="output frames (video); tiles carry all frames")
    parser.add_argument("--ranks", type=int, required=True, help="ranks sharing the tiles")
    parser.add_argument("--json", action="store_true", help="print the plans and the frontier as JSON")
    args = parser.parse_args(argv)
    try:
        report = plan_tiles(args.family, args.height, args.width, args.frames, args.ranks)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(
        f"{args.family} {args.height}x{args.width}x{args.frames} on {args.ranks} ranks: "
        f"{report.candidates_considered} candidates (<= {report.candidate_limit} tiles), frontier {report.frontier_size}"
    )
    for plan in report.plans:
        print(_plan_line(plan))
    print("frontier:")
    for plan in report.frontier:
        print("  " + _plan_line(plan))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(plan_main())
