"""Measuring one case on one rank: warm-up, one logged invocation, timed iterations, peak memory, a profile.

Design decisions:

* The counting and timing rules of ``docs/benchmark.md``. Warm-up, then one invocation with
:func:`~patchray.distributed.comm.log_comm` on (and the time spent in communication calls measured with
:func:`.linkmodel.time_comm`, for the link model), then timed iterations with logging off, each preceded by a
barrier. An error is caught and recorded per rank (an out-of-memory error as ``"oom"``), so the ranks move on
  together to the next case.
* **One rank's compute, measured alone (turn-taking)**: :mod:`.turns` (re-exported here: :func:`take_turns`,
  :func:`measure_alone`, :class:`TurnTaking`, the clocks). ``--timing alone|both`` adds ``measure_alone``'s
  invocations to a case.
* **The unsharded reference runs on one rank** (:func:`measure_on_one_rank`): a speed-up's denominator is one
  device's decode, so rank 0 measures it as a one-rank run while the other ranks wait at one bounded barrier.
  Run on every rank at once, N full decodes would compete for the same CPU cores or GPU and inflate the
  reference (at 4 CPU ranks, kl 200x136, one thread per rank: 3.4 s against 2.3 s on one rank).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..comm import barrier, bounded_barrier, log_comm, tensor_bytes
from ..context import ParallelContext
from .linkmodel import time_comm
from .options import Options
from .turns import (ALONE_CLOCKS, GpuSpin, Prefill, TurnTaking, _completed, _group_size, measure_alone, resolve_clock,
                    sync_fn, take_turns)

__all__ = ["sync_fn", "classify_error", "error_record", "memory_cap", "unique_path", "measure", "TurnTaking",
           "take_turns", "measure_alone", "measure_on_one_rank", "GpuSpin", "Prefill", "ALONE_CLOCKS", "resolve_clock"]


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


def classify_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text or "can't allocate memory" in text:
        return "oom"
    if "32-bit index" in text or "32bit index" in text or "canuse32bitindexmath" in text:
        return "index_limit"
    return "execution"


def error_record(kind: str, message: str, rank: Optional[int] = None, tb: str = "") -> dict:
    return {"kind": kind, "message": message[:2000], "rank": rank, "traceback": tb[-3000:] if tb else None}


@contextlib.contextmanager
def memory_cap(device: torch.device, cap_mb: Optional[float]):
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

    def hook(module, inputs, output):
        if next(module.children(), None) is not None:
            return
        est = tensor_bytes(inputs) + tensor_bytes(output) + param_bytes.get("weights", 0)
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


def unique_path(path: str) -> str:
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
    sync = sync_fn(ctx.device)
    with profile(activities=activities, record_shapes=True, profile_memory=opts.profile_memory) as prof:
        fn()
        sync()
    files = []
    base = os.path.join(opts.profile_dir, f"{stem}-rank{ctx.rank}")
    averages = prof.key_averages()
    if opts.profile:
        path = unique_path(base + ".txt")
        with open(path, "w") as fh:
            fh.write(averages.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=50))
        files.append(path)
    if opts.profile_trace:
        path = unique_path(base + ".trace.json")
        prof.export_chrome_trace(path)
        files.append(path)
    if opts.profile_memory:
        path = unique_path(base + ".memory.txt")
        with open(path, "w") as fh:
            fh.write(averages.table(sort_by="self_cuda_memory_usage" if cuda else "self_cpu_memory_usage", row_limit=50))
            if cuda:
                fh.write("\n\n" + torch.cuda.memory_summary(ctx.device))
        files.append(path)
    return {"files": files}


def measure(ctx, opts: Options, fn: Callable[[], Any], stem: str) -> Tuple[dict, Any]:
    """Warm up, log one invocation, time ``opts.iters``; return this rank's measurements and the logged output."""
    sync = sync_fn(ctx.device)
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
        barrier(ctx)
        with time_comm(sync) as comm_time:
            with log_comm() as comm_log:
                output = fn()
                sync()
        m["comm"] = comm_log.to_dict()
        m["comm_ms"] = comm_time["ms"]
        # keep the logged output on the host: held on the device it would add to every later invocation's peak
        if isinstance(output, torch.Tensor) and output.device.type != "cpu":
            output = output.cpu()
        timing = getattr(opts, "timing", "concurrent")
        for _ in range(opts.iters if timing != "alone" else 0):
            barrier(ctx)
            sync()
            ms, _ = timer.time_ms(fn)
            m["times_ms"].append(ms)
        if timing in ("alone", "both"):
            m["alone"] = measure_alone(ctx, fn, opts.iters, getattr(opts, "alone_clock", "prefilled"))
        m["peak"] = _read_peak(ctx.device)
        if opts.profile or opts.profile_trace or opts.profile_memory:
            barrier(ctx)
            m["profile"] = _profile_once(fn, opts, ctx, stem)
    except Exception as exc:  # recorded per case; the ranks continue with the next case
        m["error"] = error_record(classify_error(exc), f"{type(exc).__name__}: {exc}", ctx.rank, traceback.format_exc())
        output = None
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    m["cpu_s"] = time.process_time() - cpu_start
    return m, output


def measure_on_one_rank(ctx, opts: Options, fn: Callable[[], Any], stem: str, rank: int = 0) -> Tuple[dict, Any]:
    """:func:`measure` of ``fn`` on ``rank`` alone, as a one-rank run; the other ranks wait and never call ``fn``.

    For work with no collective (the unsharded reference). Every rank then meets at one barrier bounded by
    ``opts.timeout_s`` (:func:`~patchray.distributed.comm.bounded_barrier`), so the ranks leave together and a
    rank that never arrives raises instead of hanging. The waiting ranks return a record with ``waited: True``
    and no times.
    """
    if ctx.rank == rank:
        m, output = measure(ParallelContext.single(ctx.device), opts, fn, stem)
        m["rank"] = ctx.rank
    else:
        m = {"rank": ctx.rank, "error": None, "times_ms": [], "comm": None, "comm_ms": None,
             "peak": {"metric": None, "bytes": None}, "profile": None, "device": str(ctx.device), "cpu_s": 0.0,
             "waited": True}
        output = None
    bounded_barrier(ctx, getattr(opts, "timeout_s", 3600.0))
    return m, output
