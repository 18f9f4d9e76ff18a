"""The cases of one shape, and what each case runs on a rank.

Design decision: cases are decided from shared data. Plans come from geometry (``planner.plan_tiles``), so every
rank builds the same case list without a collective, and the driver prints the same list before the ranks start.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch

from .options import Options

__all__ = ["Case", "Reference", "plan_cases", "make_runner", "make_input", "expected_shape"]


class Case(NamedTuple):
    mode: str  # unsharded | row | local | tile-runs | row-tiled | tile-shape-cost
    name: str  # the label on stdout and in the chart
    case: str  # the case string (``docs/benchmark.md``): unsharded, row or MODE:WINDOW@OVERLAP
    plan: Any = None  # TilePlan for tiled modes
    plan_report: Any = None  # PlanReport when the plan was selected automatically
    latent_window: Optional[Tuple[int, int]] = None  # tile-shape-cost
    skipped: Optional[str] = None  # why the case could not be built (recorded, not run)


def plan_cases(opts: Options, shape: Tuple[int, int, int], world_size: int) -> List[Case]:
    from ..vae.planner import exact_plan, parse_case, plan_tiles

    family = opts.family
    h, w, f = shape
    if opts.cases:
        out = []
        for text in opts.cases:
            spec = parse_case(text)
            if spec.tiled:
                plan = exact_plan(family, h, w, f, world_size, spec.window, spec.overlap)
                out.append(Case(spec.mode, text.strip(), text.strip(), plan))
            else:
                out.append(Case(spec.mode, spec.mode, spec.mode))
        return out
    try:
        report = plan_tiles(family, h, w, f, world_size)
        plans, reason = _distinct(report.plans), None
    except ValueError as exc:
        report, plans, reason = None, [], str(exc)
    if opts.tile_shape_costs:
        if opts.tile_shape_windows:
            windows = [tuple(x) for x in opts.tile_shape_windows]
        elif plans:
            windows = [tuple(p.latent_window) for p in plans]
        else:
            return [Case("tile-shape-cost", "tile-shape-cost", "tile-shape-cost", skipped=f"no plans: {reason}")]
        return [Case("tile-shape-cost", f"tile {a}x{b}", f"tile-shape-cost:{a}x{b}", latent_window=(a, b)) for a, b in windows]
    cases = [Case("unsharded", "unsharded", "unsharded"), Case("row", "row", "row")]
    if opts.half == "encoder":
        return cases
    if not plans:
        cases.append(Case("tile-runs", "tile-runs", "tile-runs", skipped=f"no tile plans: {reason}"))
        return cases
    for p in plans:
        cases.append(Case("tile-runs", f"tile-runs {p.name}", p.case("tile-runs"), p, report))
    if opts.diagnostics:
        for p in plans:
            cases.append(Case("local", f"local {p.name}", p.case("local"), p, report))
        fine = plans[-1]
        cases.append(Case("row-tiled", f"row-tiled {fine.name}", fine.case("row-tiled"), fine, report))
    return cases


def _distinct(plans) -> list:
    seen, out = set(), []
    for p in plans:
        key = (tuple(p.latent_window), tuple(p.latent_overlap))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _latent_mean(out):
    if out is None or isinstance(out, torch.Tensor):
        return out
    latent_dist = getattr(out, "latent_dist", out)
    return latent_dist.mean


def make_runner(case: Case, vae, inp, ctx, opts: Options) -> Callable[[], Any]:
    if opts.half == "encoder":
        from ..vae.row import row_encode

        if case.mode == "unsharded":
            return lambda: _latent_mean(vae.encode(inp))
        return lambda: row_encode(vae, inp, ctx)
    if case.mode == "unsharded" or case.mode == "tile-shape-cost":
        return lambda: vae.decode(inp, return_dict=False)[0]
    if case.mode == "row":
        from ..vae.row import row_decode

        return lambda: row_decode(vae, inp, ctx)
    from ..vae import tiled

    if case.mode == "tile-runs":
        return lambda: tiled.decode_tile_runs(vae, inp, case.plan, ctx, gn_sync=opts.gn_sync)
    if case.mode == "local":
        return lambda: tiled.decode_local(vae, inp, case.plan, gn_sync=opts.gn_sync)
    if case.mode == "row-tiled":
        return lambda: tiled.decode_row_tiled(vae, inp, case.plan, ctx)
    raise ValueError(f"unknown mode {case.mode!r}")  # backstop, not the guard: parse_case refuses it first


def make_input(opts: Options, shape, spec, generator_seed: int = 1) -> torch.Tensor:
    from ..vae.families import latent_shape

    h, w, f = shape
    g = torch.Generator().manual_seed(generator_seed)
    if opts.half == "decoder":
        size = latent_shape(opts.family, h, w, f, batch=opts.batch, size=opts.size)
        return torch.randn(size, generator=g)
    size = (opts.batch, 3, f, h, w) if spec.is_video else (opts.batch, 3, h, w)
    return torch.rand(size, generator=g) * 2 - 1  # an image in [-1, 1], what the encoder sees


def expected_shape(opts: Options, shape, spec, case: Case) -> Optional[tuple]:
    from ..vae.families import latent_shape

    h, w, f = shape
    if opts.half == "encoder":
        return tuple(latent_shape(opts.family, h, w, f, batch=opts.batch, size=opts.size))
    if case.mode == "tile-shape-cost":
        return None  # frames of a video tile follow the family's temporal decoder; checked against nothing
    frames = ((f - 1) // spec.temporal_ratio) * spec.temporal_ratio + 1 if spec.is_video else 1
    return (opts.batch, 3, frames, h, w) if spec.is_video else (opts.batch, 3, h, w)


class Reference(NamedTuple):
    """The unsharded output of this shape on rank 0, or why there is none."""

    output: Optional[torch.Tensor]
    note: Optional[str]
