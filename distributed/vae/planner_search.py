"""The tile-plan search: every admissible window, the Pareto frontier, and the coarse, balanced and fine plans.

Design decisions:

* **Overlap is searched, not pinned.** ``window = pitch + overlap``; pinning the overlap at a VAE's native value
  puts a floor under every window (on a 1024x1024 image at four ranks that made every tiled plan hold as much as
  a row-sharded rank), so for each grid the search tries overlaps from half the pitch down to the narrowest
  blend that is still a quarter of its window (a blend narrower than that reads as a band, not a gradient).
* **Constraints.** Grids of ``max(2, ranks)`` up to ``TILES_PER_RANK * ranks`` tiles, at least as many tiles as
  ranks, every window at least :data:`~.planner_geometry.MIN_TILE_LATENT` latent units on its narrow axis, an
  untiled axis has zero overlap, a tiled axis's overlap is at least a quarter of its window.
* **Selection.** Candidates worse on all of window area, decoded area, rank imbalance and tile columns are
  dropped (Pareto frontier). ``coarse`` has the largest window, ``fine`` the smallest, and ``balanced``
  minimizes the worst normalized (window area, decoded area, imbalance) score among the rest (``None`` where
  only two distinct windows remain). The names describe geometry; which plan is fastest or lightest on a device
  is the benchmark's to measure.
* **A refusal names the nearest request that plans** (fewer ranks, or the smallest proportional enlargement).
* **Video: spatial tiles over all frames.** Every tile carries every latent frame: the causal video decoders
  thread a temporal cache through the frames and their temporal compression is not invertible per chunk, so
  cutting time would need a second, temporal blend and would break that cache. A plan for a video therefore
  depends only on (height, width, ranks); ``frames`` is recorded so the report states the decoded volume.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import List, NamedTuple, Optional, Tuple

from .planner_geometry import MIN_TILE_LATENT, TilePlan, _axis_tiles, _build_plan, _latent_hw, _spatial_ratio, _violations

__all__ = ["TILES_PER_RANK", "PLAN_NAMES", "PlanReport", "plan_tiles"]

TILES_PER_RANK = 4
"""The search considers grids of ``max(2, ranks)`` up to ``4 * ranks`` tiles."""

PLAN_NAMES = ("coarse", "balanced", "fine")


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
