"""Measuring one case on one rank: warm-up, one logged invocation, timed iterations, peak memory, a profile.

Design decisions:

* The counting and timing rules of ``docs/benchmark.md``. Warm-up, then one invocation with
:func:`~patchray.distributed.comm.log_comm` on (and the time spent in communication calls measured with
:func:`.linkmodel.time_comm`, for the link model), then timed iterations with logging off, each preceded by a
barrier. An error is caught and recorded per rank (an out-of-memory error as ``"oom"``), so the ranks move on
  together to the next case.
* **One rank's compute, measured alone (turn-taking).** When N ranks share one device (N ranks on one GPU, or
  more rank threads than CPU cores), a rank's time measured while its peers run concurrently is the time of a
  *shared* device, not of its own. :func:`take_turns` makes the ranks compute one at a time: the work between two
  collectives (a *stage*) runs on rank 0 while the others wait, then on rank 1, ..., and then every rank enters the
  collective together, so each stage's compute is timed with the device to itself (CUDA events on GPU,
  ``time.perf_counter`` on CPU) and each collective is timed separately, with no peer's compute inside it. The
  baton is N barriers per stage (rank r waits at r of them before computing and at N - r after), made through
  :func:`~patchray.distributed.comm.uncounted_barrier`, so the hooks of the interception layer never count or
  time it. The modelled N-device latency then sums, stage by stage, the slowest rank's compute and the
  communication modelled from the bytes each call moved (:func:`.linkmodel.model_alone`): the ranks meet at
  every collective, so a stage ends when its slowest rank does.
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
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..comm import CommCall, barrier, bounded_barrier, intercept, log_comm, tensor_bytes, uncounted_barrier
from ..context import ParallelContext
from .linkmodel import call_wire_bytes, time_comm
from .options import Options

__all__ = ["sync_fn", "classify_error", "error_record", "memory_cap", "unique_path", "measure", "TurnTaking",
           "take_turns", "measure_alone", "measure_on_one_rank"]


def sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


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


class TurnTaking:
    """The per-rank record of one turn-taking run (see the module docstring), and the hook that takes the turns.

    Attributes:
        compute_ms: this rank's compute per stage, in order (a stage ends at a top-level collective, at a
            :meth:`mark` or at the end of the run).
        cpu_ms: the process CPU time of the same stages (a diagnostic: on a loaded CPU machine wall time includes
            the time other processes held the core).
        comm_ms: each top-level collective's time (every rank enters it together).
        wire_bytes: each collective's bytes on this rank's link (:func:`.linkmodel.call_wire_bytes`).
        ops: each collective's operation name.
        marks: stage indices where :meth:`mark` split the run (a sampling step's end).
    """

    def __init__(self, ctx, sync: Callable[[], None]):
        self.ctx, self.sync = ctx, sync
        self.cuda = ctx.device.type == "cuda"
        self.compute_ms: List[float] = []
        self.cpu_ms: List[float] = []
        self.comm_ms: List[float] = []
        self.wire_bytes: List[int] = []
        self.ops: List[str] = []
        self.marks: List[int] = []
        self._start_event = None
        self._t0 = self._c0 = 0.0

    def _clock(self) -> None:
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def _lap(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            ms = float(self._start_event.elapsed_time(end))
        else:
            ms = (time.perf_counter() - self._t0) * 1e3
        self.compute_ms.append(ms)
        self.cpu_ms.append((time.process_time() - self._c0) * 1e3)

    def begin_turn(self) -> None:
        """Wait for this rank's turn (rank r waits at r barriers), then start the stage's clock."""
        for _ in range(self.ctx.rank):
            uncounted_barrier(self.ctx)
        self._clock()

    def end_turn(self) -> None:
        """Stop the clock (after the device finished), then pass the baton and wait for every rank's turn."""
        self._lap()
        for _ in range(self.ctx.world_size - self.ctx.rank):
            uncounted_barrier(self.ctx)

    def mark(self) -> None:
        """Close the running stage here without passing the baton (a step boundary, the same on every rank)."""
        self._lap()
        self.marks.append(len(self.compute_ms))
        self._clock()

    def hook(self, call: CommCall, proceed):
        if call.batched:
            return proceed()  # part of a top-level call: timed with it
        self.end_turn()
        self.sync()
        start = time.perf_counter()
        result = proceed()
        result = _completed(result)
        self.sync()
        self.comm_ms.append((time.perf_counter() - start) * 1e3)
        self.wire_bytes.append(call_wire_bytes(call, _group_size(call, self.ctx.world_size)))
        self.ops.append(call.op)
        self.begin_turn()
        return result

    def to_dict(self) -> dict:
        return {"compute_ms": [round(x, 4) for x in self.compute_ms], "cpu_ms": [round(x, 4) for x in self.cpu_ms],
                "comm_ms": [round(x, 4) for x in self.comm_ms], "wire_bytes": list(self.wire_bytes),
                "ops": list(self.ops), "marks": list(self.marks)}


def _group_size(call: CommCall, default: int) -> int:
    """The size of the group a call ran on (a subgroup inside the turn-taking group: CFG x sequence), else ``default``."""
    size = getattr(call.kwargs.get("group"), "size", None)
    try:
        return int(size()) if callable(size) else default
    except Exception:  # a group object without a size: the turn-taking group's
        return default


def _completed(result):
    """Wait for an asynchronous call's work (one, or a list from ``batch_isend_irecv``) so its time is billed here."""
    from .linkmodel import _Done

    if isinstance(result, list) and result and all(hasattr(w, "wait") for w in result):
        for work in result:
            work.wait()
        return [_Done(w) for w in result]
    if result is not None and hasattr(result, "wait") and hasattr(result, "is_completed"):
        result.wait()
        return _Done(result)
    return result


@contextlib.contextmanager
def take_turns(ctx, sync: Optional[Callable[[], None]] = None):
    """Run the block with the ranks computing one at a time between collectives; yields the :class:`TurnTaking`.

    Every rank must run the same collectives inside the block (as every SPMD body does). On one rank it only
    times the block as one stage.
    """
    sync = sync or sync_fn(ctx.device)
    turns = TurnTaking(ctx, sync)
    sync()
    turns.begin_turn()
    with intercept(turns.hook):
        yield turns
    sync()
    turns.end_turn()


def measure_alone(ctx, fn: Callable[[], Any], iters: int) -> List[dict]:
    """``iters`` turn-taking invocations of ``fn``; this rank's :meth:`TurnTaking.to_dict` for each."""
    sync = sync_fn(ctx.device)
    runs = []
    for _ in range(iters):
        barrier(ctx)
        sync()
        with take_turns(ctx, sync) as turns:
            fn()
        runs.append(turns.to_dict())
    return runs


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
            m["alone"] = measure_alone(ctx, fn, opts.iters)
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
