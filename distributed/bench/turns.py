"""Turn-taking: N ranks sharing one device compute one at a time between collectives, each stage timed alone.

Design decisions:

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
* **On CUDA the stage clock starts behind a prefilled queue** (clock ``gpu-prefilled``, the default). The baton
  is a host barrier, so every stage starts on an idle GPU; timed from there, a stage's CUDA-event time includes
  the CPU's time to launch its kernels from Python, which real GPUs driven by asynchronous NCCL collectives hide
  as long as the CPU issues faster than the GPU runs. So before the stage's start event the clock enqueues a GPU
  busy-wait (``torch.cuda._sleep``, its cycles calibrated once per process against CUDA events,
  :class:`GpuSpin`) longer than the CPU needs to issue the stage (1.5 x that stage's issue time in the previous
  run of the same series, or of the longest stage so far, + 1 ms, capped at 100 ms): the start event fires
  after the spin, when the whole stage is already queued, and ``end - start`` is the stage's GPU time with no
  launch gaps (``compute_ms``). The CPU's issue time is recorded beside it (``launch_ms``: host wall time from
  the stage's start to its last launch), and whether the queue really was ahead (``queued``: the start event
  had not fired when the CPU finished issuing). A stage that waits on the device inside (a host-synchronising
  copy: gloo's host staging of CUDA tensors, ``.item()``) cannot be prefilled: the GPU idles after the wait
  while the CPU issues the rest, and the stage's time then includes those gaps, as the old clock's did; such
  stages are counted (``host_syncs``, from PyTorch's CUDA sync debug mode) and get a 1 ms spin only. The link
  model uses the GPU time and applies the launch bound per call over the queued stages
  (:func:`.linkmodel.effective_compute`; a stage of more launches than CUDA's launch queue holds blocks the CPU
  until the GPU drains it, is then not queued, and counts with its GPU time).
  ``clock="idle"`` keeps the earlier clock (``idle-start``: GPU time including launch gaps). CPU ranks have no
  queue: their clock is wall time (``cpu-wall``), unchanged.
* **The unsharded reference runs on one rank** (:func:`measure_on_one_rank`): a speed-up's denominator is one
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from ..comm import CommCall, barrier, intercept, uncounted_barrier
from .linkmodel import call_wire_bytes

__all__ = ["ALONE_CLOCKS", "resolve_clock", "sync_fn", "settle", "GpuSpin", "Prefill", "TurnTaking", "take_turns", "measure_alone"]

#: ``--alone-clock`` choices: ``prefilled`` (CUDA: GPU time behind a prefilled queue, the default), ``idle`` (CUDA:
#: the stage's time from an idle GPU, launch gaps included: the earlier clock). CPU ranks always use wall time.
ALONE_CLOCKS = ("prefilled", "idle")


def resolve_clock(device: torch.device, clock: Optional[str] = "prefilled") -> str:
    """The clock name a record carries: ``gpu-prefilled`` / ``idle-start`` on CUDA, ``cpu-wall`` elsewhere."""
    clock = clock or "prefilled"
    if clock not in ALONE_CLOCKS:
        raise ValueError(f"alone clock must be one of {list(ALONE_CLOCKS)} (got {clock!r})")
    if device.type != "cuda":
        return "cpu-wall"
    return "gpu-prefilled" if clock == "prefilled" else "idle-start"


def sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def settle(ctx) -> None:
    """Start a timed run with every rank at once: this rank's device idle, then every rank past a barrier, then the
    device idle again (a barrier on NCCL is device work)."""
    from ..comm import barrier

    sync = sync_fn(ctx.device)
    sync()
    barrier(ctx)
    sync()


class GpuSpin:
    """A GPU busy-wait of a given wall time: ``torch.cuda._sleep`` cycles calibrated once per process and device.

    The spin runs ``clock64`` cycles on one thread block; the rate (cycles per ms) is measured with CUDA events
    around three spins of :attr:`CALIBRATION_CYCLES` after one warm-up spin (the median), so a spin of ``ms``
    takes about ``ms`` whatever the SM clock. The figure is kept per device index.
    """

    CALIBRATION_CYCLES = 10_000_000
    _rate: Dict[int, float] = {}

    @classmethod
    def cycles_per_ms(cls, device: torch.device) -> float:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in cls._rate:
            with torch.cuda.device(index):
                torch.cuda._sleep(1000)
                rates = []
                for _ in range(3):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    torch.cuda._sleep(cls.CALIBRATION_CYCLES)
                    end.record()
                    end.synchronize()
                    rates.append(cls.CALIBRATION_CYCLES / max(float(start.elapsed_time(end)), 1e-3))
            cls._rate[index] = sorted(rates)[1]
        return cls._rate[index]

    @classmethod
    def enqueue(cls, device: torch.device, ms: float) -> None:
        """Enqueue ``ms`` of GPU busy-wait on the current stream (returns at once)."""
        cycles = int(max(0.0, ms) * cls.cycles_per_ms(device))
        if cycles > 0:
            torch.cuda._sleep(cycles)


class Prefill:
    """How long each stage's spin is: long enough that the CPU has issued the stage before the spin ends.

    The spin of stage k = ``FACTOR x`` (stage k's issue time in the previous run of the series, else the longest
    issue time so far in this run, else :attr:`INITIAL_MS`) ``+ MARGIN_MS``, at most ``CAP_MS``. One object is
    shared by the runs of one series (the warm-up and timed calls of one case), so timed runs size their spins
    from the warm-up. A stage that waits on the device inside (``host_syncs``) cannot be prefilled; it keeps a
    ``MARGIN_MS`` spin instead of growing one that the wait would only lengthen.
    """

    FACTOR, MARGIN_MS, INITIAL_MS, CAP_MS = 1.5, 1.0, 5.0, 100.0

    def __init__(self):
        self.history: Dict[int, float] = {}

    def spin_ms(self, stage: int, longest_so_far: float = 0.0) -> float:
        base = self.history.get(stage)
        if base is None:
            base = max(longest_so_far, self.INITIAL_MS)
        return min(self.CAP_MS, self.FACTOR * base + self.MARGIN_MS)

    def update(self, stage: int, launch_ms: float, host_syncs: int) -> None:
        self.history[stage] = 0.0 if host_syncs else launch_ms


class _SyncCounter:
    """Counts synchronising CUDA calls made in this thread while :meth:`on` (PyTorch's sync debug mode warns on each;
    the warnings are counted, not shown).

    The mode is process-wide, so it is on only inside a stage (no collective runs there: a worker thread of the
    process group would print its own synchronisations to stderr instead).
    """

    def __init__(self):
        self.count = 0
        self._saved = None
        self._catch = None

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=".*synchroniz.*")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                self.count += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        try:
            self._saved = torch.cuda.get_sync_debug_mode()
        except (AttributeError, RuntimeError):  # a build without the debug mode: nothing counted
            self._saved = None
        return self

    def on(self) -> None:
        if self._saved is not None:
            torch.cuda.set_sync_debug_mode("warn")

    def off(self) -> None:
        if self._saved is not None:
            torch.cuda.set_sync_debug_mode(self._saved)

    def __exit__(self, *exc):
        self.off()
        self._catch.__exit__(*exc)
        return False


#: operations whose batched calls are the parts of a top-level ``batch_isend_irecv`` (or of an object send)
_POINT_TO_POINT = frozenset({"isend", "irecv", "send", "recv"})


class TurnTaking:
    """The per-rank record of one turn-taking run (see the module docstring), and the hook that takes the turns.

    Attributes:
        clock: ``gpu-prefilled``, ``idle-start`` (CUDA) or ``cpu-wall`` (:func:`resolve_clock`).
        compute_ms: this rank's compute per stage, in order (a stage ends at a top-level collective, at each
            collective inside an object collective, at a :meth:`mark` or at the end of the run): GPU time behind
            a prefilled queue (``gpu-prefilled``), GPU time from an idle start, launch gaps included
            (``idle-start``), or wall time (``cpu-wall``).
        cpu_ms: the process CPU time of the same stages (a diagnostic: on a loaded CPU machine wall time includes
            the time other processes held the core).
        launch_ms: CUDA: the host wall time the stage took to issue (from its start to its last launch; includes
            any wait on the device inside the stage).
        spin_ms, queued, host_syncs: ``gpu-prefilled`` only: each stage's spin (GPU time), whether the stage was
            fully issued before the GPU reached its start, and the synchronising CUDA calls inside it.
        comm_ms: each top-level collective's time (every rank enters it together).
        wire_bytes: each collective's bytes on this rank's link (:func:`.linkmodel.call_wire_bytes`).
        ops: each collective's operation name.
        marks: stage indices where :meth:`mark` split the run (a sampling step's end).
    """

    def __init__(self, ctx, sync: Callable[[], None], clock: Optional[str] = "prefilled",
                 prefill: Optional[Prefill] = None):
        self.ctx, self.sync = ctx, sync
        self.cuda = ctx.device.type == "cuda"
        self.clock = resolve_clock(ctx.device, clock)
        self.prefilled = self.clock == "gpu-prefilled"
        self.prefill = prefill or Prefill()
        self.compute_ms: List[float] = []
        self.cpu_ms: List[float] = []
        self.launch_ms: List[float] = []
        self.spin_ms: List[float] = []
        self.queued: List[bool] = []
        self.host_syncs: List[int] = []
        self.comm_ms: List[float] = []
        self.wire_bytes: List[int] = []
        self.ops: List[str] = []
        self.marks: List[int] = []
        self._start_event = self._spin_event = None
        self._syncs = _SyncCounter() if self.prefilled else None
        self._syncs0 = 0
        self._t0 = self._c0 = 0.0

    def __enter__(self):
        if self._syncs is not None:
            self._syncs.__enter__()
        return self

    def __exit__(self, *exc):
        if self._syncs is not None:
            self._syncs.__exit__(*exc)
        return False

    def _clock(self) -> None:
        if self.cuda:
            if self.prefilled:
                stage = len(self.compute_ms)
                spin = self.prefill.spin_ms(stage, max(self.launch_ms, default=0.0))
                # calibrated here, in this rank's turn: spins of ranks sharing the GPU at once would time-slice
                # and make the rate too low (a calibration outside its turn would measure its peers too)
                GpuSpin.cycles_per_ms(self.ctx.device)
                self._spin_event = torch.cuda.Event(enable_timing=True)
                self._spin_event.record()
                GpuSpin.enqueue(self.ctx.device, spin)
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        if self._syncs is not None:
            self._syncs0 = self._syncs.count
            self._syncs.on()
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def _lap(self) -> None:
        issued = time.perf_counter()
        if self._syncs is not None:
            self._syncs.off()
        if self.cuda:
            syncs = self._syncs.count - self._syncs0 if self._syncs is not None else 0
            queued = (not self._start_event.query()) if self.prefilled else None
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            ms = float(self._start_event.elapsed_time(end))
            launch = (issued - self._t0) * 1e3
            self.launch_ms.append(launch)
            if self.prefilled:
                self.spin_ms.append(float(self._spin_event.elapsed_time(self._start_event)))
                self.queued.append(bool(queued))
                self.host_syncs.append(int(syncs))
                self.prefill.update(len(self.compute_ms), launch, syncs)
        else:
            ms = (issued - self._t0) * 1e3
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
        self.close_stage()
        self.open_stage()

    def close_stage(self) -> None:
        """The first half of :meth:`mark`: stop the clock (waiting for the device) and record the step boundary.

        Call it *before* the body waits on the device itself (a ``torch.cuda.synchronize`` at a step's end would
        otherwise be billed to the stage's issue time), and :meth:`open_stage` after the bookkeeping.
        """
        self._lap()
        self.marks.append(len(self.compute_ms))

    def open_stage(self) -> None:
        """The second half of :meth:`mark`: start the next stage's clock (on CUDA, behind its spin)."""
        self._clock()

    def hook(self, call: CommCall, proceed):
        if call.batched and call.op in _POINT_TO_POINT:
            return proceed()  # a send or receive of a top-level batch_isend_irecv: timed with it
        if call.batched:
            # a collective inside an object collective (all_gather_object, broadcast_object_list), which is not a
            # counted operation itself: the baton passes around it as around a top-level collective, or this rank
            # would enter it while its peers still wait for their turn at a barrier (a deadlock); it closes a stage
            # but is not recorded as one of the run's collectives
            self.end_turn()
            self.sync()
            result = _completed(proceed())
            self.sync()
            self.begin_turn()
            return result
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
        out = {"clock": self.clock, "compute_ms": [round(x, 4) for x in self.compute_ms],
               "cpu_ms": [round(x, 4) for x in self.cpu_ms],
               "comm_ms": [round(x, 4) for x in self.comm_ms], "wire_bytes": list(self.wire_bytes),
               "ops": list(self.ops), "marks": list(self.marks)}
        if self.cuda:
            out["launch_ms"] = [round(x, 4) for x in self.launch_ms]
        if self.prefilled:
            out.update(spin_ms=[round(x, 4) for x in self.spin_ms], queued=list(self.queued),
                       host_syncs=list(self.host_syncs))
        return out


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
def take_turns(ctx, sync: Optional[Callable[[], None]] = None, clock: Optional[str] = "prefilled",
               prefill: Optional[Prefill] = None):
    """Run the block with the ranks computing one at a time between collectives; yields the :class:`TurnTaking`.

    Every rank must run the same collectives inside the block (as every SPMD body does). On one rank it only
    times the block as one stage. ``clock``: see :data:`ALONE_CLOCKS`; ``prefill``: the spin sizes of a series
    of runs (pass one :class:`Prefill` to every run of the same work so later runs size their spins from earlier
    ones).
    """
    sync = sync or sync_fn(ctx.device)
    turns = TurnTaking(ctx, sync, clock, prefill)
    sync()
    with turns:
        turns.begin_turn()
        with intercept(turns.hook):
            yield turns
        turns.end_turn()  # the lap waits for the device (its end event) after reading the issue time


def measure_alone(ctx, fn: Callable[[], Any], iters: int, clock: Optional[str] = "prefilled",
                  pilot: bool = True) -> List[dict]:
    """``iters`` turn-taking invocations of ``fn``; this rank's :meth:`TurnTaking.to_dict` for each.

    With the prefilled clock, one untimed turn-taking invocation first (``pilot``) gives every stage's issue
    time, so the timed invocations' spins are sized per stage (:class:`Prefill`).
    """
    sync = sync_fn(ctx.device)
    prefill = Prefill()
    runs = []
    extra = 1 if pilot and resolve_clock(ctx.device, clock) == "gpu-prefilled" else 0
    for i in range(iters + extra):
        barrier(ctx)
        sync()
        with take_turns(ctx, sync, clock, prefill) as turns:
            fn()
        if i >= extra:
            runs.append(turns.to_dict())
    return runs
