"""Tile-plan geometry: a window and an overlap on the latent grid, the tiles they make, the ranks' runs.

Design decisions:

* **Geometry only, deterministic.** A plan depends on the family's spatial compression ratio, the image shape
  and the world size, nothing measured, so every rank (and every machine) derives the same plan without a
  collective, and a plan travels to a Ray actor as a plain dict (:meth:`TilePlan.to_dict` /
  :meth:`TilePlan.from_dict`, which recomputes the geometry and refuses a dict that disagrees with it).
* **Tiles live on the latent grid.** A tile is a rectangle of latent units; its output-pixel rectangle is that
  times the spatial ratio. Windows and overlaps are reported in output pixels, height first, and must be whole
  multiples of the ratio.
* **Tiles step by ``window - overlap`` and the last one is clipped** to the image edge (never shifted back), so
  edge tiles are cheaper and ranks are balanced by *area*, not by tile count. The grid on an axis is the fewest
  tiles that cover it, so no tile is wholly inside its neighbours.
* **Runs, not scattered tiles.** Each rank takes one contiguous run of tiles in raster order, chosen to minimise
  the busiest rank's decoded area (the blend then needs only the strips of the neighbouring runs).
* **Exact plans are validated structurally.** :func:`exact_plan` builds the plan for a window and overlap given
  by the caller (a benchmark case reproducing a measurement): whole latent units, overlap smaller than the
  window, zero overlap on an untiled axis, at least :data:`MIN_TILE_LATENT` latent units on the narrow axis,
  at least as many tiles as ranks. It does not demand the quarter-window blend the search keeps
  (``planner_search``): an exact case exists to reproduce a measurement, not to choose one.

The rules and their reasons are written out in docs/vae.md ("The tile planner").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Sequence, Tuple

from .planner_cases import format_case

__all__ = ["MIN_TILE_LATENT", "Rect", "TilePlan", "exact_plan"]

MIN_TILE_LATENT = 16
"""Smallest latent extent of a tile on its narrow axis. Below it a tile normalizes over content too
unrepresentative of the image for any blend to repair (on FLUX.2 the limit measured between 12 and 16)."""

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
        """The benchmark case string that reproduces this plan, e.g. ``tile-runs:480x736@64x32``."""
        return format_case(mode, self.window, self.overlap)

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
    """Validate and build the plan for an exact window and overlap (output pixels), as a benchmark case names it.

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
