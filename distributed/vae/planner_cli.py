"""``python -m patchray plan``: the tile plans for one request, as text or JSON.

Design decision: the command only formats what :func:`~.planner_search.plan_tiles` returns (the plans, the
Pareto frontier and the benchmark case string that reproduces each plan), so what it prints is what a decode on
the same family, shape and world size would use. A refused request exits with status 2 and the reason, which
names the nearest request that plans.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .planner_geometry import TilePlan
from .planner_search import plan_tiles

__all__ = ["plan_main"]


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
