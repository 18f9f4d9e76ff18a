"""PatchRay's VAE benchmark: seed 000's harness, measuring PatchRay's own modes.

``torchrun --nproc_per_node=N -m patchray bench ...`` and ``python -m patchray bench --ranks N ...`` (the Ray
cluster) run the same per-rank body, :func:`bench_rank`, and write the same schema-7 JSON.

Design decisions:

* **One body, three launchers.** :func:`bench_rank` does everything a rank does (build the VAE with seed-0
  weights, the input with seed 1, plan the cases, warm up, log one invocation, time, profile) and ends every case
  with one ``all_gather_object`` so *every* rank returns the finished records. The launchers (torchrun, the Ray
  cluster, ``spawn.run_ranks`` for tests) only start ranks and take rank 0's list, so the JSON cannot depend on
  how the ranks were started.
* **Cases are decided from shared data.** Plans come from geometry (``planner.plan_tiles``), so every rank
  builds the same case list without a collective; an error in one case is caught on each rank, recorded, and the
  ranks move on together to the next case (an out-of-memory case is recorded as ``"oom"``).
* **Seed 000's counting and timing rules.** Warm-up, then one invocation with :func:`~patchray.distributed.comm.log_comm`
  on (and the time spent in communication calls measured, for the link model), then timed iterations with
  logging off, each preceded by a barrier. ``latency_ms`` is the median over iterations of the slowest rank's
  time (CUDA events on CUDA, ``perf_counter`` on CPU).
* **Exit status.** 0: everything ran and row-sharded agreement held. 1: an execution or structural failure in
  any mode, or row agreement outside its tolerance. 2: a setup error (bad options, a refused case, the cluster
  could not start). Resource limits (out of memory, PyTorch's 32-bit index limit) are recorded per case and do not
  fail the run: finding them is what the benchmark is for. Tiling differences are reported, never enforced.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..cluster import report_progress
from .catalog import CATALOG_VERSION, CPU_DEFAULT, architecture_digest, canonical_shapes, format_shape, parse_shape

__all__ = [
    "SCHEMA_VERSION",
    "ROW_TOLERANCE",
    "BenchResult",
    "SetupError",
    "build_parser",
    "resolve_options",
    "bench_rank",
    "run_bench",
    "bench_main",
    "exit_status",
    "comm_block",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 7
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


# --------------------------------------------------------------------------------------------------
# options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m patchray bench",
        description=(
            "Benchmark PatchRay's distributed VAE modes (seed 000's harness). With no options: a short default "
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
    p.add_argument("--out", help=f"schema-7 JSON path (default ./{DEFAULT_REPORT_DIR}/<run>.json); the PNG goes next to it")
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
    defaults_used: str = ""
    progress_path: Optional[str] = None
    torchrun: bool = False
    hw_family: Optional[str] = None

    @property
    def single_object(self) -> bool:
        """Seed 000: one exact case is written as an object, a suite as an array."""
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
        row_tolerance=args.row_tolerance, threads=args.threads, timeout_s=args.timeout_s,
        defaults_used=defaults_used, torchrun=torchrun, hw_family=hw_family(),
    )


# --------------------------------------------------------------------------------------------------
# the cases of one shape (the same on every rank: geometry only)


def _progress(opts: "Options", line: str) -> None:
    """Rank 0's progress: logged (torchrun prints it), and appended to ``progress_path`` when the driver tails one
    (Ray actors and spawned ranks do not share the driver's stdout)."""
    log.info("%s", line)
    if opts.progress_path:
        try:
            with open(opts.progress_path, "a") as fh:
                fh.write(line + "\n")
        except OSError:  # progress is a courtesy; a remote rank may not see the driver's folder
            pass


@contextlib.contextmanager
def _tail_progress(path: str):
    """Print the lines rank 0 appends to ``path`` while the ranks run (local launchers only)."""
    import threading

    stop = threading.Event()

    def tail():
        pos = 0
        while True:
            done = stop.wait(1.0)
            try:
                with open(path) as fh:
                    fh.seek(pos)
                    text = fh.read()
                    pos = fh.tell()
            except OSError:
                text = ""
            if text:
                print(text, end="", flush=True)
            if done:
                return

    thread = threading.Thread(target=tail, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.remove(path)


class _Case(NamedTuple):
    mode: str  # unsharded | row | local | tile-runs | row-tiled | tile-shape-cost
    name: str  # the label on stdout and in the chart
    case: str  # seed 000's case string
    plan: Any = None  # TilePlan for tiled modes
    plan_report: Any = None  # PlanReport when the plan was selected automatically
    latent_window: Optional[Tuple[int, int]] = None  # tile-shape-cost
    skipped: Optional[str] = None  # why the case could not be built (recorded, not run)


def _plan_cases(opts: Options, shape: Tuple[int, int, int], world_size: int) -> List[_Case]:
    from ..vae.planner import exact_plan, parse_case, plan_tiles

    family = opts.family
    h, w, f = shape
    if opts.cases:
        out = []
        for text in opts.cases:
            spec = parse_case(text)
            if spec.tiled:
                plan = exact_plan(family, h, w, f, world_size, spec.window, spec.overlap)
                out.append(_Case(spec.mode, text.strip(), text.strip(), plan))
            else:
                out.append(_Case(spec.mode, spec.mode, spec.mode))
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
            return [_Case("tile-shape-cost", "tile-shape-cost", "tile-shape-cost", skipped=f"no plans: {reason}")]
        return [_Case("tile-shape-cost", f"tile {a}x{b}", f"tile-shape-cost:{a}x{b}", latent_window=(a, b)) for a, b in windows]
    cases = [_Case("unsharded", "unsharded", "unsharded"), _Case("row", "row", "row")]
    if opts.half == "encoder":
        return cases
    if not plans:
        cases.append(_Case("tile-runs", "tile-runs", "tile-runs", skipped=f"no tile plans: {reason}"))
        return cases
    for p in plans:
        cases.append(_Case("tile-runs", f"tile-runs {p.name}", p.case("tile-runs"), p, report))
    if opts.diagnostics:
        for p in plans:
            cases.append(_Case("local", f"local {p.name}", p.case("local"), p, report))
        fine = plans[-1]
        cases.append(_Case("row-tiled", f"row-tiled {fine.name}", fine.case("row-tiled"), fine, report))
    return cases


def _distinct(plans) -> list:
    seen, out = set(), []
    for p in plans:
        key = (tuple(p.latent_window), tuple(p.latent_overlap))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# --------------------------------------------------------------------------------------------------
# measuring on one rank


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _barrier(ctx) -> None:
    if ctx.world_size > 1:
        import torch.distributed as dist

        if ctx.device.type == "cuda" and ctx.backend == "nccl":
            dist.barrier(group=ctx.group, device_ids=[ctx.device.index or 0])
        else:
            dist.barrier(group=ctx.group)


def _gather_objects(ctx, obj) -> list:
    if ctx.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time_ms(self, fn) -> Tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) of this process
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass


def _read_peak(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"metric": "cuda_max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return {"metric": "process_rss_peak", "bytes": int(line.split()[1]) * 1024}
    except OSError:
        pass
    return {"metric": None, "bytes": None}


def _classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text or "can't allocate memory" in text:
        return "oom"
    if "32-bit index" in text or "32bit index" in text or "canuse32bitindexmath" in text:
        return "index_limit"
    return "execution"


def _error(kind: str, message: str, rank: Optional[int] = None, tb: str = "") -> dict:
    return {"kind": kind, "message": message[:2000], "rank": rank, "traceback": tb[-3000:] if tb else None}


@contextlib.contextmanager
def _memory_cap(device: torch.device, cap_mb: Optional[float]):
    """``--max-memory-mb``: a real allocator limit on CUDA; on CPU a cap on an allocation estimate.

    CPU ranks have no allocator to limit, so the estimate is the weights plus the input and output of the layer
    running now (a lower bound of what is live), checked after every leaf module; exceeding it raises
    ``torch.OutOfMemoryError`` like the CUDA allocator would.
    """
    if cap_mb is None:
        yield None
        return
    cap = int(cap_mb * 2**20)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        try:
            yield None
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    param_bytes = {}

    from ..comm import tensor_bytes as nbytes

    def hook(module, inputs, output):
        if next(module.children(), None) is not None:
            return
        est = nbytes(inputs) + nbytes(output) + param_bytes.get("weights", 0)
        if est > cap:
            raise torch.OutOfMemoryError(
                f"simulated out of memory: weights + {type(module).__name__}'s input and output need "
                f"{est / 2**20:.1f} MiB, over --max-memory-mb {cap_mb:g} (a cap simulated on a CPU rank)"
            )

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield param_bytes
    finally:
        handle.remove()


def _unique_path(path: str) -> str:
    if not os.path.exists(path):
        return path
    stem, ext = os.path.splitext(path)
    if stem.endswith(".trace") or stem.endswith(".memory"):
        stem, sub = os.path.splitext(stem)
        ext = sub + ext
    i = 1
    while os.path.exists(f"{stem}-{i}{ext}"):
        i += 1
    return f"{stem}-{i}{ext}"


def _profile_once(fn, opts: Options, ctx, stem: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(opts.profile_dir, exist_ok=True)
    cuda = ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = _sync(ctx.device)
    with profile(activities=activities, record_shapes=True, profile_memory=opts.profile_memory) as prof:
        fn()
        sync()
    files = []
    base = os.path.join(opts.profile_dir, f"{stem}-rank{ctx.rank}")
    averages = prof.key_averages()
    if opts.profile:
        path = _unique_path(base + ".txt")
        with open(path, "w") as fh:
            fh.write(averages.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=50))
        files.append(path)
    if opts.profile_trace:
        path = _unique_path(base + ".trace.json")
        prof.export_chrome_trace(path)
        files.append(path)
    if opts.profile_memory:
        path = _unique_path(base + ".memory.txt")
        with open(path, "w") as fh:
            fh.write(averages.table(sort_by="self_cuda_memory_usage" if cuda else "self_cpu_memory_usage", row_limit=50))
            if cuda:
                fh.write("\n\n" + torch.cuda.memory_summary(ctx.device))
        files.append(path)
    return {"files": files}


def _measure(ctx, opts: Options, fn: Callable[[], Any], stem: str) -> Tuple[dict, Any]:
    """Warm up, log one invocation, time ``opts.iters``; return this rank's measurements and the logged output."""
    from ..comm import log_comm
    from .linkmodel import time_comm

    sync = _sync(ctx.device)
    timer = _Timer(ctx.device)
    m: Dict[str, Any] = {"rank": ctx.rank, "error": None, "times_ms": [], "comm": None, "comm_ms": None,
                         "peak": {"metric": None, "bytes": None}, "profile": None, "device": str(ctx.device)}
    output = None
    cpu_start = time.process_time()
    try:
        _reset_peak(ctx.device)
        for _ in range(opts.warmup):
            fn()
        sync()
        _barrier(ctx)
        with time_comm(sync) as comm_time:
            with log_comm() as comm_log:
                output = fn()
                sync()
        m["comm"] = comm_log.to_dict()
        m["comm_ms"] = comm_time["ms"]
        # keep the logged output on the host: held on the device it would add to every later invocation's peak
        if isinstance(output, torch.Tensor) and output.device.type != "cpu":
            output = output.cpu()
        for _ in range(opts.iters):
            _barrier(ctx)
            sync()
            ms, _ = timer.time_ms(fn)
            m["times_ms"].append(ms)
        m["peak"] = _read_peak(ctx.device)
        if opts.profile or opts.profile_trace or opts.profile_memory:
            _barrier(ctx)
            m["profile"] = _profile_once(fn, opts, ctx, stem)
    except Exception as exc:  # recorded per case; the ranks continue with the next case
        m["error"] = _error(_classify(exc), f"{type(exc).__name__}: {exc}", ctx.rank, traceback.format_exc())
        output = None
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    m["cpu_s"] = time.process_time() - cpu_start
    return m, output


# --------------------------------------------------------------------------------------------------
# comparing against the reference (rank 0)


def _agreement(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max_abs, mean_abs and PSNR (data range: the reference's max - min) in fp32, chunked to bound memory."""
    a, b = out.reshape(-1), ref.reshape(-1)
    n = a.numel()
    max_abs, abs_sum, sq_sum = 0.0, 0.0, 0.0
    lo, hi = math.inf, -math.inf
    step = 1 << 24
    for i in range(0, n, step):
        x, y = a[i:i + step].float().cpu(), b[i:i + step].float().cpu()
        d = (x - y).abs()
        max_abs = max(max_abs, float(d.max()))
        abs_sum += float(d.double().sum())
        sq_sum += float((d.double() ** 2).sum())
        lo, hi = min(lo, float(y.min())), max(hi, float(y.max()))
    mse = sq_sum / n
    data_range = hi - lo if hi > lo else 1.0
    psnr = None if mse == 0 else 10 * math.log10(data_range**2 / mse)
    result = {"max_abs": max_abs, "mean_abs": abs_sum / n, "psnr_db": psnr, "data_range": data_range, "identical": mse == 0}
    return result


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


# --------------------------------------------------------------------------------------------------
# the per-rank body


def _latent_mean(out):
    if out is None or isinstance(out, torch.Tensor):
        return out
    dist = getattr(out, "latent_dist", out)
    return dist.mean


def _make_runner(case: _Case, vae, inp, ctx, opts: Options) -> Callable[[], Any]:
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


def _make_input(opts: Options, shape, spec, generator_seed: int = 1) -> torch.Tensor:
    from ..vae.families import latent_shape

    h, w, f = shape
    g = torch.Generator().manual_seed(generator_seed)
    if opts.half == "decoder":
        size = latent_shape(opts.family, h, w, f, batch=opts.batch, size=opts.size)
        return torch.randn(size, generator=g)
    size = (opts.batch, 3, f, h, w) if spec.is_video else (opts.batch, 3, h, w)
    return torch.rand(size, generator=g) * 2 - 1  # an image in [-1, 1], what the encoder sees


def _expected_shape(opts: Options, shape, spec, case: _Case) -> Optional[tuple]:
    from ..vae.families import latent_shape

    h, w, f = shape
    if opts.half == "encoder":
        return tuple(latent_shape(opts.family, h, w, f, batch=opts.batch, size=opts.size))
    if case.mode == "tile-shape-cost":
        return None  # frames of a video tile follow the family's temporal decoder; checked against nothing
    frames = ((f - 1) // spec.temporal_ratio) * spec.temporal_ratio + 1 if spec.is_video else 1
    return (opts.batch, 3, frames, h, w) if spec.is_video else (opts.batch, 3, h, w)


def bench_rank(ctx, payload: dict) -> List[dict]:
    """Everything one rank does; returns the finished records (identical on every rank).

    Args:
        ctx: this rank's :class:`~patchray.distributed.context.ParallelContext`.
        payload: :class:`Options` as a dict (``dataclasses.asdict``).
    """
    # a Ray actor outlives the run (ComfyUI reuses the cluster): put the process-wide settings back afterwards
    saved = (torch.get_num_threads(), torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    try:
        return _bench_rank(ctx, Options(**payload))
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[1], saved[2]


def _bench_rank(ctx, opts: Options) -> List[dict]:
    from ..vae.families import FAMILIES, build_vae
    from . import provenance
    from .linkmodel import throttle_link

    device = ctx.device
    if device.type == "cpu":
        torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 1) // max(1, ctx.world_size)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # fp32 means fp32: TF32 convolutions/matmuls would make row vs unsharded differ by ~1e-3 for no reason
    torch.backends.cudnn.allow_tf32 = opts.dtype != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = opts.dtype != "fp32"
    spec = FAMILIES[opts.family]
    dtype = DTYPES[opts.dtype]
    # rank 0's provenance, with every rank's device name, goes into every rank's records
    mine = provenance.collect(device) if ctx.rank == 0 else provenance.device_info(device).get("name")
    gathered = _gather_objects(ctx, mine)
    prov = gathered[0]
    prov["device"]["names_by_rank"] = [prov["device"].get("name")] + gathered[1:]
    prov["launcher"] = "torchrun" if opts.torchrun else opts.launcher
    prov["backend"] = ctx.backend

    records: List[dict] = []
    with contextlib.ExitStack() as stack:
        throttle = stack.enter_context(throttle_link(opts.link, ctx.world_size)) if opts.link else None
        cap = stack.enter_context(_memory_cap(device, opts.max_memory_mb))
        stack.enter_context(torch.no_grad())
        vae = build_vae(opts.family, size=opts.size, seed=0, dtype=dtype, device=device)
        if cap is not None:
            cap["weights"] = sum(p.numel() * p.element_size() for p in vae.parameters())
        planned = [(tuple(shape), _plan_cases(opts, tuple(shape), ctx.world_size)) for shape in opts.shapes]
        total, done = sum(len(c) for _, c in planned), 0
        for shape, cases in planned:
            inp = _make_input(opts, shape, spec).to(device=device, dtype=dtype)
            within_limit = shape[0] * shape[1] * shape[2] / 1e6 <= opts.reference_limit_mpix
            ref = _Reference(None, None if within_limit else (
                f"output {format_shape(shape)} is over the reference-size limit "
                f"({opts.reference_limit_mpix:g} megapixels; --reference-limit-mpix)"))
            if within_limit and not any(c.mode == "unsharded" for c in cases):
                ref = _Reference(None, "no unsharded reference in this run (add --case unsharded)")
            for case in cases:
                rec, output = _run_case(ctx, opts, spec, vae, inp, shape, case, prov, throttle, ref)
                if case.mode == "unsharded" and within_limit:
                    if output is not None:
                        ref = _Reference(output, None)
                    else:
                        kind = (rec.get("error") or {}).get("kind") or rec.get("status")
                        ref = _Reference(None, f"the unsharded reference failed ({kind})")
                del output
                records.append(rec)
                done += 1
                report_progress(done, total)  # the driver's progress bar (ComfyUI), if it asked for one
            del inp, ref
            gc.collect()
        del vae
    return records


class _Reference(NamedTuple):
    """The unsharded output of this shape on rank 0, or why there is none."""

    output: Optional[torch.Tensor]
    note: Optional[str]


def _run_case(ctx, opts, spec, vae, inp, shape, case: _Case, prov, throttle, ref: _Reference) -> Tuple[dict, Any]:
    """Run one case on this rank; return the finished record and rank 0's output of an unsharded case."""
    from .linkmodel import model_record

    world = ctx.world_size
    stem = f"{opts.family}-{opts.half}-{format_shape(shape)}-{case.name.replace(' ', '-')}"
    rec = _base_record(opts, spec, shape, case, world, prov)
    if case.skipped:
        rec["status"] = "skipped"
        rec["error"] = _error("plan", case.skipped)
        if ctx.rank == 0:
            _progress(opts, f"  {case.name:<24} skipped: {case.skipped}")
        return rec, None
    case_inp = inp
    if case.mode == "tile-shape-cost":
        from ..vae.families import latent_shape

        a, b = case.latent_window
        full = latent_shape(opts.family, shape[0], shape[1], shape[2], batch=opts.tile_shape_batch, size=opts.size)
        g = torch.Generator().manual_seed(1)
        case_inp = torch.randn(tuple(full[:-2]) + (a, b), generator=g).to(device=inp.device, dtype=inp.dtype)
    runner = _make_runner(case, vae, case_inp, ctx, opts)
    if ctx.rank == 0:
        _progress(opts, f"  {format_shape(shape)} {case.name}: running ({opts.warmup} warm-up, 1 logged, {opts.iters} timed)")
    slept_before = throttle["slept_ms"] if throttle is not None else 0.0
    mine, output = _measure(ctx, opts, runner, stem)
    if throttle is not None:
        mine["slept_ms"] = throttle["slept_ms"] - slept_before
    # rank 0 judges its output (the distributed modes deliver there); the verdict travels with its measurements
    if ctx.rank == 0 and mine["error"] is None:
        mine["check"] = _check_output(opts, spec, shape, case, output, ref)
    per_rank = _gather_objects(ctx, mine)
    keep = output if (case.mode == "unsharded" and ctx.rank == 0) else None
    del output

    errors = [m["error"] for m in per_rank if m["error"]]
    rec["error"] = errors[0] if errors else None
    rec["errors_by_rank"] = [m["error"]["kind"] if m["error"] else None for m in per_rank]
    check = per_rank[0].get("check") or {}
    if rec["error"] is None and check.get("structural"):
        rec["error"] = _error("structural", check["structural"], 0)
    rec["status"] = "ok" if rec["error"] is None else "error"

    times = [m["times_ms"] for m in per_rank]
    if rec["error"] is None and all(times):
        slowest = [max(t[i] for t in times) for i in range(len(times[0]))]
        rec["latency_ms"] = round(statistics.median(slowest), 3)
        rec["latency_ms_iterations"] = [round(t, 3) for t in slowest]
        rec["latency_ms_by_rank"] = [round(statistics.median(t), 3) for t in times]
    # CPU seconds each rank process spent on the whole case (warm-up, logged, timed, profiled): on CPU ranks this
    # is the case's wall time on an otherwise idle machine, whatever else shared the cores during the run
    rec["cpu_s_by_rank"] = [round(m.get("cpu_s", 0.0), 3) for m in per_rank]
    peaks = [m["peak"] for m in per_rank]
    rec["peak_memory"] = _peak_block(peaks, ctx.device)
    comms = [m["comm"] for m in per_rank]
    if all(c is not None for c in comms):
        rec["comm"] = comm_block(comms)
    if rec["latency_ms"] is not None and rec["comm"] is not None:
        comm_ms = [m["comm_ms"] or 0.0 for m in per_rank]
        compute = [max(0.0, lat - c) for lat, c in zip(rec["latency_ms_by_rank"], comm_ms)]
        from .linkmodel import wire_bytes

        rec["compute_ms_by_rank"] = [round(c, 3) for c in compute]
        rec["comm_ms_by_rank"] = [round(c, 3) for c in comm_ms]
        rec["wire_bytes_by_rank"] = [wire_bytes(c["bytes"], world) for c in comms]
        rec["link_model"] = model_record(compute, [c["bytes"] for c in comms], [c["total_calls"] for c in comms], world)
    if throttle is not None:
        slept = [m.get("slept_ms") for m in per_rank]
        rec["link"] = {"profile": throttle["profile"], "throttled": True,
                       "slept_ms_by_rank": [round(x, 3) if x is not None else None for x in slept]}
    if check:
        rec["agreement"] = check.get("agreement")
        rec["agreement_note"] = check.get("note")
        rec["finite"] = check.get("finite")
        if "seam" in check:
            rec["seam_error"] = check["seam"]
    if rec["agreement_enforced"]:
        tol = rec["agreement_tolerance"]
        agr = rec["agreement"]
        if agr is None:
            rec["agreement_ok"] = None
        else:
            rec["agreement_ok"] = bool(agr["max_abs"] <= tol["max_abs"] and agr["mean_abs"] <= tol["mean_abs"])
    profiles = [m["profile"] for m in per_rank if m.get("profile")]
    if profiles:
        rec["profile"] = {"files": [f for p in profiles for f in p["files"]]}
    if ctx.rank == 0:
        from .report import case_line

        _progress(opts, case_line(rec))
    return rec, keep


def comm_block(comms: Sequence[dict]) -> dict:
    """The record's ``comm`` from each rank's :meth:`CommLog.to_dict` (seed 000: rank 0's count, the busiest
    rank's count and every rank's; bytes by operation and in total)."""
    return {
        "total_calls": comms[0]["total_calls"],
        "total_calls_max": max(c["total_calls"] for c in comms),
        "total_calls_by_rank": [c["total_calls"] for c in comms],
        "calls_by_op": comms[0]["calls"],
        "batched_calls_by_op": comms[0]["batched_calls"],
        "bytes": {
            "by_op": comms[0]["bytes"],
            "total": comms[0]["total_bytes"],
            "total_max": max(c["total_bytes"] for c in comms),
            "total_by_rank": [c["total_bytes"] for c in comms],
        },
    }


def _check_output(opts, spec, shape, case: _Case, output, ref: _Reference) -> dict:
    check: Dict[str, Any] = {"agreement": None, "note": None, "finite": None, "structural": None}
    if case.mode == "tile-shape-cost":
        check["note"] = "tile-shape costs decode a tile-sized latent: nothing to compare"
        return check
    if output is None:
        check["structural"] = f"{case.mode} delivered no output to rank 0"
        return check
    reference = ref.output
    want = _expected_shape(opts, shape, spec, case)
    # batch and spatial size are certain; the frame count of a video decode is the family's business, so frames
    # (and channels) are only compared against the unsharded reference
    if want is not None and (output.dim() != len(want) or output.shape[0] != want[0]
                             or tuple(output.shape[-2:]) != tuple(want[-2:])):
        check["structural"] = f"{case.mode} output has shape {tuple(output.shape)}, expected {tuple(want)}"
        return check
    if reference is not None and output.shape != reference.shape:
        check["structural"] = f"{case.mode} output has shape {tuple(output.shape)}, the reference {tuple(reference.shape)}"
        return check
    check["finite"] = _finite(output)
    if case.mode == "unsharded":
        check["note"] = "this case is the reference"
        return check
    if reference is None:
        check["note"] = ref.note or "no unsharded reference for this case"
        return check
    if not check["finite"] and _finite(reference):
        check["structural"] = f"{case.mode} output holds non-finite values where the unsharded reference is finite"
    check["agreement"] = _agreement(output, reference)
    if case.plan is not None:
        try:
            from ..vae.tiled import seam_error

            check["seam"] = seam_error(output, reference, case.plan)
        except Exception as exc:  # a report extra: never fails the case
            check["seam"] = {"error": f"{type(exc).__name__}: {exc}"}
    return check


def _peak_block(peaks: List[dict], device: torch.device) -> dict:
    by_rank = [p.get("bytes") for p in peaks]
    metric = peaks[0].get("metric") if peaks else None
    known = [b for b in by_rank if b is not None]
    block = {
        "metric": metric,
        "max_bytes": max(known) if known else None,
        "by_rank_bytes": by_rank,
        "max_gib": round(max(known) / 2**30, 4) if known else None,
    }
    if metric == "process_rss_peak":
        block["note"] = ("CPU ranks: no accelerator memory. This is the rank process's peak resident set (host RAM: "
                         "weights, activations, Python and the torch runtime), reset before the case (Linux clear_refs)")
    elif metric == "cuda_max_memory_allocated":
        block["note"] = "torch.cuda.max_memory_allocated per rank over warm-up, logged and timed invocations (weights included)"
    else:
        block["note"] = "not measured (the case failed before measuring, or the platform has no peak counter)"
    return block


def _base_record(opts: Options, spec, shape, case: _Case, world: int, prov) -> dict:
    from ..vae.families import latent_shape

    h, w, f = shape
    tile = None
    planner = None
    if case.plan is not None:
        d = case.plan.to_dict()
        tile = {k: d[k] for k in ("name", "window", "overlap", "latent_window", "latent_overlap", "grid", "runs")}
        tile["tiles"] = len(d["tiles_latent"])
        tile["coverage"] = d["objectives"]["coverage"]
        planner = {"objectives": d["objectives"]}
        if case.plan_report is not None:
            planner["candidate_limit"] = case.plan_report.candidate_limit
            planner["frontier_size"] = case.plan_report.frontier_size
            planner["candidates_considered"] = case.plan_report.candidates_considered
    if case.mode == "tile-shape-cost":
        a, b = case.latent_window
        r = spec.spatial_ratio
        tile = {"name": None, "window": [a * r, b * r], "overlap": [0, 0], "latent_window": [a, b],
                "batch": opts.tile_shape_batch}
    enforced = case.mode == "row"
    tol = dict(ROW_TOLERANCE[opts.dtype])
    if opts.row_tolerance is not None:
        tol["max_abs"] = opts.row_tolerance
    try:
        lat = list(latent_shape(opts.family, h, w, f, batch=opts.batch, size=opts.size))
    except ValueError:
        lat = None
    return {
        "schema": SCHEMA_VERSION,
        "benchmark": "patchray-vae",
        "family": opts.family,
        "half": opts.half,
        "size": opts.size,
        "architecture_digest": architecture_digest(spec.full_config if opts.size == "full" else spec.tiny_config),
        "catalog_version": CATALOG_VERSION,
        "shape": {"height": h, "width": w, "frames": f, "label": format_shape(shape)},
        "latent_shape": lat,
        "batch": opts.batch,
        "world_size": world,
        "dtype": opts.dtype,
        "device": opts.device,
        "mode": case.mode,
        "case": case.case,
        "name": case.name,
        "plan": case.plan.name if case.plan is not None else None,
        "window": tile["window"] if tile else None,
        "overlap": tile["overlap"] if tile else None,
        "tile": tile,
        "beats_row_sharding": bool(case.plan.beats_row_sharding) if case.plan is not None else None,
        "planner": planner,
        "gn_sync": bool(opts.gn_sync) if case.mode in TILED else None,
        "warmup": opts.warmup,
        "iters": opts.iters,
        "status": None,
        "error": None,
        "errors_by_rank": None,
        "latency_ms": None,
        "latency_ms_iterations": None,
        "latency_ms_by_rank": None,
        "peak_memory": None,
        "comm": None,
        "agreement": None,
        "agreement_note": None,
        "agreement_enforced": enforced,
        "agreement_tolerance": tol if enforced else None,
        "agreement_ok": None,
        "finite": None,
        "cpu_s_by_rank": None,
        "compute_ms_by_rank": None,
        "comm_ms_by_rank": None,
        "wire_bytes_by_rank": None,
        "link_model": None,
        "link": None,
        "memory_cap_mb": opts.max_memory_mb,
        "profile": None,
        "hw_family": opts.hw_family,
        "provenance": prov,
    }


# --------------------------------------------------------------------------------------------------
# launchers


class BenchResult(NamedTuple):
    records: List[dict]
    exit_code: int
    json_path: Optional[str]
    chart_path: Optional[str]


def exit_status(records: Sequence[dict]) -> int:
    """Seed 000's exit status for finished records (0 ok, 1 failed); setup errors never reach here."""
    for r in records:
        err = r.get("error") or {}
        if err.get("kind") in FAILING_ERRORS:
            return EXIT_FAILED
        if r.get("agreement_enforced") and r.get("agreement_ok") is False:
            return EXIT_FAILED
    return EXIT_OK


def _run_torchrun(payload: dict) -> Tuple[List[dict], int]:
    import datetime

    import torch.distributed as dist

    from ..context import ParallelContext

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if payload["device"] == "cuda":
        # torchrun starts one process per local GPU and names it in LOCAL_RANK: that is its device (modulo the
        # visible devices, so --backend gloo can put several ranks on one GPU)
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        backend = "nccl" if payload["backend"] == "auto" else payload["backend"]
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=payload["timeout_s"]))
    try:
        ctx = ParallelContext.from_group(None, device)
        return bench_rank(ctx, payload), ctx.rank
    finally:
        dist.destroy_process_group()


def _run_ray(opts: Options, payload: dict) -> List[dict]:
    from ..cluster import ClusterConfig, ClusterSetupError, get_cluster, shutdown_cluster

    try:
        cluster = get_cluster(ClusterConfig(num_ranks=opts.ranks, device=opts.device, address=opts.address))
    except (ClusterSetupError, ValueError) as exc:
        raise SetupError(f"the Ray cluster could not start: {exc}") from exc
    try:
        results = cluster.run(bench_rank, payload, timeout_s=opts.timeout_s)
    finally:
        shutdown_cluster(stop_ray=opts.address is None)
    return results[0]


def run_bench(argv: Optional[Sequence[str]] = None, *, cluster=None, cancel_check=None, progress=None) -> BenchResult:
    """Parse ``argv``, run the benchmark, write JSON + PNG and print the summary (rank 0 / the driver).

    Args:
        argv: command-line options (see ``python -m patchray bench --help``).
        cluster: an existing :class:`~patchray.distributed.cluster.RankCluster` to run on (ComfyUI's bench
            node); its size overrides ``--ranks``.
        cancel_check: with ``cluster``: polled while the ranks work; raising from it stops every rank
            (ComfyUI's cancel).
        progress: with ``cluster``: ``progress(done, total)`` after each finished case (ComfyUI's progress bar).

    Raises:
        SetupError: bad options or a refused request.
    """
    import dataclasses

    args = build_parser().parse_args(list(argv or []))
    if cluster is not None:
        # the cluster decides ranks and device: resolve the defaults for ITS device, not this process's
        kind = getattr(cluster, "device_kind", None)
        if args.device == "auto" and kind in ("cpu", "cuda"):
            args.device = kind
        opts = resolve_options(args, cuda_available=kind == "cuda" if kind else None)
        opts.ranks = cluster.config.num_ranks
    else:
        opts = resolve_options(args)
    local = not opts.torchrun and (opts.launcher == "spawn" or (cluster is None and opts.address is None))
    if local:
        os.makedirs(os.path.dirname(opts.out), exist_ok=True)
        opts.progress_path = opts.out + ".progress"
        with contextlib.suppress(OSError):
            os.remove(opts.progress_path)
    payload = dataclasses.asdict(opts)
    _announce(opts)
    with _tail_progress(opts.progress_path) if local else contextlib.nullcontext():
        records, writer = _launch(opts, payload, cluster, cancel_check, progress)
    if not writer:  # a torchrun rank other than 0: same records, same exit status, no files
        return BenchResult(records, exit_status(records), None, None)
    return _finish(opts, records)


def _launch(opts: Options, payload: dict, cluster, cancel_check=None, progress=None) -> Tuple[List[dict], bool]:
    """Start the ranks; return the records and whether this process writes the outputs."""
    if opts.torchrun:
        records, rank = _run_torchrun(payload)
        return records, rank == 0
    if cluster is not None:
        return cluster.run(bench_rank, payload, timeout_s=opts.timeout_s, cancel_check=cancel_check, progress=progress)[0], True
    if opts.launcher == "spawn":
        from ..spawn import run_ranks

        backend = opts.backend if opts.backend != "auto" else ("nccl" if opts.device == "cuda" else "gloo")
        return run_ranks(bench_rank, opts.ranks, payload, backend=backend, device=opts.device, timeout_s=opts.timeout_s)[0], True
    return _run_ray(opts, payload), True


def _announce(opts: Options) -> None:
    if opts.torchrun and int(os.environ.get("RANK", 0)) != 0:
        return
    why = {"cpu": " (no GPU: the CPU default suite; see --help)", "gpu": " (the GPU default suite)"}.get(opts.defaults_used, "")
    print(f"patchray bench: {opts.family} {opts.half} ({opts.size}) {', '.join(format_shape(s) for s in opts.shapes)} "
          f"on {opts.ranks} {opts.device} rank(s), {opts.dtype}{why}", flush=True)
    for shape in opts.shapes:
        try:
            names = [c.name + (" (skipped)" if c.skipped else "") for c in _plan_cases(opts, tuple(shape), opts.ranks)]
        except ValueError:
            continue
        print(f"  {format_shape(shape)}: {', '.join(names)}; each: {opts.warmup} warm-up, 1 logged, {opts.iters} timed",
              flush=True)


def _finish(opts: Options, records: List[dict]) -> BenchResult:
    from .report import format_table

    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    data: Any = records[0] if opts.single_object and len(records) == 1 else records
    with open(opts.out, "w") as fh:
        json.dump(_json_safe(data), fh, indent=1, allow_nan=False)
    chart_path = None
    if opts.chart:
        try:
            from .charts import write_chart

            chart_path = write_chart(records, os.path.splitext(opts.out)[0] + ".png")
        except Exception as exc:  # the JSON is the result; a chart failure is reported, not fatal
            print(f"chart not written: {type(exc).__name__}: {exc}", file=sys.stderr)
    code = exit_status(records)
    print(format_table(records))
    print(f"\nJSON:  {opts.out}")
    if chart_path:
        print(f"chart: {chart_path}")
    if code != EXIT_OK:
        print("exit status 1: an execution or structural failure, or row agreement outside its tolerance (see above)")
    return BenchResult(records, code, opts.out, chart_path)


def _json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def bench_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m patchray bench ...`` and ``torchrun -m patchray bench ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        result = run_bench(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_SETUP
    except SetupError as exc:
        print(f"patchray bench: {exc}", file=sys.stderr)
        return EXIT_SETUP
    except Exception as exc:  # a rank died or the cluster failed mid-run: an execution error
        print(f"patchray bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return result.exit_code
