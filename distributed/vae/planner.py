"""The tile planner: which spatial windows a tiled decode uses, chosen from geometry alone.

This module is the planner's public face; the work is split along its seams:

* :mod:`.planner_geometry`: a plan as data (:class:`TilePlan`: window, overlap, tiles, the ranks' runs and the
  objectives), its validation, and :func:`exact_plan` for a window given by the caller;
* :mod:`.planner_search`: :func:`plan_tiles`, the search over grids and overlaps, the Pareto frontier and the
  coarse / balanced / fine selection (:class:`PlanReport`);
* :mod:`.planner_cases`: the benchmark's case strings (:func:`parse_case`, ``MODE:WINDOW_HxW@OVERLAP_HxW``),
  kept apart so the benchmark imports them without the runtime importing the benchmark;
* :mod:`.planner_cli`: ``python -m patchray plan``.

Design decision: a plan depends only on the family's spatial ratio, the image shape and the world size, so
every rank derives the same plans without a collective and a plan travels as a plain dict. The rules (tiles per
rank, the sixteen-latent minimum, the quarter-window blend, the objectives) are written out in docs/vae.md, "The
tile planner"; the case strings in docs/benchmark.md, "Cases".

Example:
    >>> from patchray.distributed.vae.planner import plan_tiles
    >>> report = plan_tiles("kl", 1024, 1024, world_size=4)
    >>> report.coarse.window_area > report.fine.window_area
    True
"""

from __future__ import annotations

from .planner_cases import MODES, TILED_MODES, CaseSpec, format_case, parse_case
from .planner_cli import plan_main
from .planner_geometry import MIN_TILE_LATENT, Rect, TilePlan, exact_plan
from .planner_search import PLAN_NAMES, TILES_PER_RANK, PlanReport, plan_tiles

__all__ = [
    "MIN_TILE_LATENT",
    "TILES_PER_RANK",
    "PLAN_NAMES",
    "MODES",
    "TILED_MODES",
    "Rect",
    "TilePlan",
    "PlanReport",
    "CaseSpec",
    "plan_tiles",
    "exact_plan",
    "parse_case",
    "format_case",
    "plan_main",
]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(plan_main())
