"""The VAE benchmark's options: the command line, its defaults, and the checks that refuse a bad request.

Design decision: every check that can be made from the options alone is made here, on the driver, before any
rank starts, and fails with :class:`SetupError` (exit status 2) naming the option, the bad value and the fix.
The ranks receive :class:`Options` as plain data (``dataclasses.asdict``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .catalog import CPU_DEFAULT, canonical_shapes, format_shape, parse_shape

__all__ = [
    "SCHEMA_VERSION",
    "DTYPES",
    "ROW_TOLERANCE",
    "RESOURCE_LIMITS",
    "FAILING_ERRORS",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_SETUP",
    "DEFAULT_REPORT_DIR",
    "TILED",
    "SetupError",
    "Options",
    "build_parser",
    "resolve_options",
]

SCHEMA_VERSION = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Row mode's enforced agreement with the unsharded decode, per dtype. Row mode changes only the order of
#: reductions (GroupNorm statistics merged across ranks, convolutions on bands that a backend may tile
#: differently), so the two decodes differ by rounding: about u * sqrt(depth) * |activation| per element, with u the
#: unit roundoff (fp32 6e-8, fp16 4.9e-4, bf16 3.9e-3), ~100 layers in a full decoder and activations that reach
#: 10-100x the output scale under synthetic weights. A structural error (a missing or shifted halo row, a wrong
#: GroupNorm merge) changes whole rows by the output's own scale (~1 for outputs in about [-1, 1]) and the mean by
#: far more than rounding does. The bounds sit between: ~2^14 u (max) and ~2^10 u (mean) for fp32 (TF32 is
#: switched off for fp32 runs), and the same for fp16 and bf16 capped below the structural scale.
ROW_TOLERANCE = {
    "fp32": {"max_abs": 1e-3, "mean_abs": 1e-4},
    "fp16": {"max_abs": 6.25e-2, "mean_abs": 4e-3},
    "bf16": {"max_abs": 2.5e-1, "mean_abs": 3e-2},
}

RESOURCE_LIMITS = ("oom", "index_limit")
FAILING_ERRORS = ("execution", "structural")
EXIT_OK, EXIT_FAILED, EXIT_SETUP = 0, 1, 2
DEFAULT_REPORT_DIR = "patchray-report"
TILED = ("local", "tile-runs", "row-tiled")


class SetupError(ValueError):
    """Bad options or a refused request: reported before any rank measures anything (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m patchray bench",
        description=(
            "Benchmark PatchRay's distributed VAE modes (cases, counting rules and JSON schema: docs/benchmark.md). With no options: a short default "
            "suite (CPU: the full kl decoder at 192x192 on 2 CPU ranks; GPU: kl at 1024x1024 on every GPU), JSON + PNG in "
            f"./{DEFAULT_REPORT_DIR}/. Shapes are HEIGHTxWIDTH[xFRAMES]."
        ),
    )
    p.add_argument("--family", help="VAE family (kl, flux2, qwen_image, wan, hunyuan_video, hunyuan_video_15, ltx2); default kl")
    p.add_argument("--half", choices=("decoder", "encoder"), default="decoder", help="which VAE half (tiling is decode-only)")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int, help="video frames (video families; default: the family's first canonical count)")
    p.add_argument("--matrix", action="store_true", help="run the family's canonical shapes (catalog.py)")
    p.add_argument("--shape", action="append", default=[], help="HEIGHTxWIDTH[xFRAMES]; repeatable; each gets its own suite")
    p.add_argument("--case", action="append", default=[],
                   help="exact case: unsharded, row, or MODE:WINDOW_HxW@OVERLAP_HxW with MODE local|tile-runs|row-tiled; repeatable")
    p.add_argument("--diagnostics", action="store_true", help="add local tiling per plan and row-tiled in the finest plan")
    p.add_argument("--gn-sync", action="store_true", help="tiled modes normalize with image-wide GroupNorm statistics")
    p.add_argument("--tile-shape-costs", action="store_true", help="measure single-tile decode costs (decoder only)")
    p.add_argument("--tile-shape-windows", help="latent windows HxW,HxW,... for --tile-shape-costs (default: the plans' windows)")
    p.add_argument("--tile-shape-batch", type=int, default=1, help="tiles decoded together per --tile-shape-costs call")
    p.add_argument("--profile", action="store_true", help="one profiled invocation per case: operator table")
    p.add_argument("--profile-trace", action="store_true", help="... and a Chrome trace")
    p.add_argument("--profile-memory", action="store_true", help="... with memory profiling")
    p.add_argument("--profile-dir", help=f"profiler artifacts (default ./{DEFAULT_REPORT_DIR}/profiles)")
    p.add_argument("--out", help=f"schema-8 JSON path (default ./{DEFAULT_REPORT_DIR}/<run>.json); the PNG goes next to it")
    p.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    p.add_argument("--size", choices=("full", "tiny"), default="full",
                   help="full: the released architecture; tiny: the reduced-width CI config (smoke runs)")
    p.add_argument("--warmup", type=int, help="warm-up invocations per case")
    p.add_argument("--iters", type=int, help="timed invocations per case (latency_ms is their median)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the input")
    p.add_argument("--ranks", type=int, help="number of ranks (Ray or spawn launcher; torchrun sets its own)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--address", help="an existing Ray cluster (default: embedded local Ray)")
    p.add_argument("--launcher", choices=("ray", "spawn"), default="ray",
                   help="ray: the PatchRay cluster; spawn: local processes without Ray")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="torchrun/spawn process-group backend (auto: nccl on CUDA, gloo on CPU). gloo with CUDA lets "
                        "several ranks share one GPU to measure per-rank memory (NCCL refuses two ranks on one device)")
    p.add_argument("--link", help="throttle every exchange to a link profile of linkmodel.py (e.g. pcie4_x16_no_p2p)")
    p.add_argument("--max-memory-mb", type=float,
                   help="cap per-rank memory: CUDA: the allocator's limit; CPU: a simulated cap on weights + one layer's input and output")
    p.add_argument("--reference-limit-mpix", type=float, default=64.0,
                   help="largest output (height*width*frames, megapixels) compared against an unsharded reference")
    p.add_argument("--row-tolerance", type=float, help="override the enforced row max_abs tolerance")
    p.add_argument("--threads", type=int, help="torch threads per CPU rank (default: cores / ranks)")
    p.add_argument("--timing", choices=("auto", "concurrent", "alone", "both"), default="auto",
                   help="concurrent: ranks run at once (latency_ms); alone: ranks also take turns so each rank's compute "
                        "is timed with the device to itself (the 'alone' block, the link model's basis); auto: both when "
                        "the ranks share a device (more ranks than GPUs, or more rank threads than CPU cores)")
    p.add_argument("--alone-clock", choices=("prefilled", "idle"), default="prefilled",
                   help="CUDA turn-taking clock: prefilled (each stage's GPU time with the launch queue filled ahead "
                        "of it, and the CPU's issue time beside it; the link model takes the longer per invocation) "
                        "or idle (each stage timed from an idle GPU, launch gaps included: the earlier clock). CPU "
                        "ranks always time wall clock")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the whole run on the ranks")
    return p


@dataclass
class Options:
    """Resolved options: what the ranks receive (plain data, picklable)."""

    family: str
    half: str
    size: str
    dtype: str
    device: str
    ranks: int
    shapes: List[Tuple[int, int, int]]
    cases: List[str]
    diagnostics: bool
    gn_sync: bool
    tile_shape_costs: bool
    tile_shape_windows: Optional[List[Tuple[int, int]]]
    tile_shape_batch: int
    warmup: int
    iters: int
    batch: int
    profile: bool
    profile_trace: bool
    profile_memory: bool
    profile_dir: str
    out: str
    chart: bool
    launcher: str
    backend: str
    address: Optional[str]
    link: Optional[str]
    max_memory_mb: Optional[float]
    reference_limit_mpix: float
    row_tolerance: Optional[float]
    threads: Optional[int]
    timeout_s: float
    timing: str = "concurrent"
    alone_clock: str = "prefilled"
    defaults_used: str = ""
    progress_path: Optional[str] = None
    torchrun: bool = False
    hw_family: Optional[str] = None

    @property
    def single_object(self) -> bool:
        """One exact case is written as an object, a suite as an array."""
        return len(self.cases) == 1 and len(self.shapes) == 1


def _is_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _parse_windows(text: str) -> List[Tuple[int, int]]:
    out = []
    for part in text.split(","):
        s = parse_shape(part)
        if s.frames != 1:
            raise SetupError(f"--tile-shape-windows takes latent HxW windows (got {part!r})")
        out.append((s.height, s.width))
    return out


def resolve_options(args: argparse.Namespace, cuda_available: Optional[bool] = None) -> Options:
    """Validate the parsed options and fill the defaults (CPU or GPU profile). Raises :class:`SetupError`."""
    from ..vae.families import FAMILIES

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    torchrun = _is_torchrun()
    if args.device == "cuda" and not cuda_available and args.address is None:
        raise SetupError("--device cuda but this machine has no CUDA device; use --device cpu or --address of a GPU Ray cluster")
    on_gpu = args.device == "cuda" or (args.device == "auto" and cuda_available)
    device = "cuda" if on_gpu else "cpu"
    explicit_shape = args.height is not None or args.width is not None or args.frames is not None
    no_request = args.family is None and not explicit_shape and not args.shape and not args.matrix and not args.case
    defaults_used = ""

    family = args.family or "kl"
    if family not in FAMILIES:
        raise SetupError(f"unknown family {family!r}; choose one of {', '.join(sorted(FAMILIES))}")
    spec = FAMILIES[family]

    if args.case and (args.shape or args.matrix):
        raise SetupError("exact cases (--case) and --shape/--matrix cannot be combined; run a second command to change both "
                         "the input and the execution mode")
    if args.matrix and (args.shape or explicit_shape):
        raise SetupError("--matrix runs the canonical shapes; drop --height/--width/--frames/--shape, or drop --matrix")
    if args.shape and explicit_shape:
        raise SetupError("give the input either as --height/--width[/--frames] or as --shape HxW[xF], not both")

    first = canonical_shapes(family)[0]
    if args.matrix:
        shapes = [tuple(s) for s in canonical_shapes(family)]
    elif args.shape:
        try:
            shapes = [tuple(parse_shape(s)) for s in args.shape]
        except ValueError as exc:
            raise SetupError(str(exc)) from None
    elif explicit_shape:
        if args.height is None or args.width is None:
            raise SetupError("give both --height and --width")
        frames = args.frames if args.frames is not None else (first.frames if spec.is_video else 1)
        shapes = [(args.height, args.width, frames)]
    elif no_request and not on_gpu:
        shapes = [(CPU_DEFAULT["height"], CPU_DEFAULT["width"], CPU_DEFAULT["frames"])]
        defaults_used = "cpu"
    else:
        shapes = [tuple(first)]
        defaults_used = "gpu" if no_request else ""
    for h, w, f in shapes:
        if not spec.is_video and f != 1:
            raise SetupError(f"{family} is an image VAE: frames must be 1 (got {h}x{w}x{f})")
        try:
            from ..vae.families import latent_shape

            latent_shape(family, h, w, f, size=args.size)
        except ValueError as exc:
            raise SetupError(f"shape {h}x{w}x{f}: {exc}") from None

    if torchrun:
        ranks = int(os.environ["WORLD_SIZE"])
        if args.ranks is not None and args.ranks != ranks:
            raise SetupError(f"--ranks {args.ranks} differs from torchrun's WORLD_SIZE {ranks}; drop --ranks")
    elif args.ranks is not None:
        ranks = args.ranks
    elif not on_gpu:
        ranks = CPU_DEFAULT["ranks"]
    else:
        ranks = max(1, torch.cuda.device_count()) if cuda_available else 2
    if ranks < 1:
        raise SetupError(f"--ranks must be >= 1 (got {ranks})")

    dtype = args.dtype or ("bf16" if on_gpu else CPU_DEFAULT["dtype"])
    warmup = args.warmup if args.warmup is not None else (CPU_DEFAULT["warmup"] if not on_gpu else 2)
    iters = args.iters if args.iters is not None else (CPU_DEFAULT["iters"] if not on_gpu else 5)
    if warmup < 0 or iters < 1:
        raise SetupError(f"--warmup must be >= 0 and --iters >= 1 (got {warmup}, {iters})")
    if args.batch < 1 or args.tile_shape_batch < 1:
        raise SetupError("--batch and --tile-shape-batch must be >= 1")

    from ..vae.planner import exact_plan, parse_case

    cases = []
    for text in args.case:
        try:
            spec_case = parse_case(text)
        except ValueError as exc:
            raise SetupError(str(exc)) from None
        if spec_case.tiled:
            if args.half == "encoder":
                raise SetupError(f"tiling is decode-only: --half encoder runs 'unsharded' and 'row' (got {text!r})")
            h, w, f = shapes[0]
            try:
                exact_plan(family, h, w, f, ranks, spec_case.window, spec_case.overlap)
            except ValueError as exc:
                raise SetupError(f"case {text!r}: {exc}") from None
        cases.append(text.strip())
    if args.half == "encoder" and (args.diagnostics or args.tile_shape_costs):
        raise SetupError("tiling is decode-only: --diagnostics and --tile-shape-costs need --half decoder")
    if args.tile_shape_costs and args.case:
        raise SetupError("--tile-shape-costs is separate from the ordinary suite; drop --case")
    windows = None
    if args.tile_shape_windows:
        if not args.tile_shape_costs:
            raise SetupError("--tile-shape-windows needs --tile-shape-costs")
        try:
            windows = _parse_windows(args.tile_shape_windows)
        except ValueError as exc:
            raise SetupError(str(exc)) from None
    if args.link is not None:
        from .linkmodel import get_profile

        try:
            get_profile(args.link)
        except ValueError as exc:
            raise SetupError(str(exc)) from None
    if args.max_memory_mb is not None and args.max_memory_mb <= 0:
        raise SetupError(f"--max-memory-mb must be positive (got {args.max_memory_mb})")

    timing = getattr(args, "timing", "auto") or "auto"
    if timing == "auto":
        if on_gpu:
            shared = ranks > max(1, torch.cuda.device_count()) if cuda_available and args.address is None else False
        else:
            shared = ranks * (args.threads or 1) > (os.cpu_count() or 1)
        timing = "both" if shared and ranks > 1 else "concurrent"

    out = args.out
    if not out:
        tag = "matrix" if args.matrix else "+".join(format_shape(s) for s in shapes)
        kind = "shape-costs" if args.tile_shape_costs else args.half
        out = os.path.join(DEFAULT_REPORT_DIR, f"{family}-{kind}-{tag}-{ranks}r-{dtype}.json")
    out = os.path.abspath(out)
    profile_dir = os.path.abspath(args.profile_dir or os.path.join(os.path.dirname(out), "profiles"))
    from .provenance import hw_family

    return Options(
        family=family, half=args.half, size=args.size, dtype=dtype, device=device, ranks=ranks, shapes=shapes,
        cases=cases, diagnostics=args.diagnostics, gn_sync=args.gn_sync, tile_shape_costs=args.tile_shape_costs,
        tile_shape_windows=windows, tile_shape_batch=args.tile_shape_batch, warmup=warmup, iters=iters,
        batch=args.batch, profile=args.profile, profile_trace=args.profile_trace, profile_memory=args.profile_memory,
        profile_dir=profile_dir, out=out, chart=not args.no_chart, launcher=args.launcher, backend=args.backend,
        address=args.address,
        link=args.link, max_memory_mb=args.max_memory_mb, reference_limit_mpix=args.reference_limit_mpix,
        row_tolerance=args.row_tolerance, threads=args.threads, timeout_s=args.timeout_s, timing=timing,
        alone_clock=getattr(args, "alone_clock", "prefilled") or "prefilled",
        defaults_used=defaults_used, torchrun=torchrun, hw_family=hw_family(),
    )
