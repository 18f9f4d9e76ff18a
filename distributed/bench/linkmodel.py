"""The benchmark's link model: what a measured case would take on another interconnect, and a throttle to check it.

Design decisions:

* **Measure compute, count bytes, model the link.** The benchmark measures each rank's time and the time it
  spends inside communication calls, so ``compute = latency - comm`` per rank; it counts the bytes each rank
  hands to ``torch.distributed`` (the counting rules of ``docs/benchmark.md``). The modelled latency on a link is
  :func:`~patchray.distributed.topology.links.model_latency_ms` (compute + messages x latency + bytes /
  bandwidth, the transfer doubled when staged through host memory), taken on the slowest rank. Overlap of
  compute and communication is ignored: PatchRay's exchanges are blocking at layer boundaries, so the sum is the
  honest model, and an upper bound otherwise.
* **Counted bytes are buffers, not traffic.** The counting rules count the positional tensor buffers an
  operation sees (an ``all_gather`` counts its N outputs and its input). :func:`wire_bytes` converts those per-op
  totals into the bytes a rank actually puts on its link under the usual algorithms (ring all-reduce:
  ``2(N-1)/N``; all-gather: ``(N-1)`` inputs; a gather's root receives ``(N-1)`` inputs).
* **The profiles live in the runtime** (:mod:`patchray.distributed.topology.links`), because the topology advice
  needs them while ComfyUI runs and the runtime never imports this package; they are re-exported here.
* **The throttle and the timer are hooks, not patchers.** ``--link PROFILE`` installs :func:`throttle_link` and
  every measured case :func:`time_comm`, both through :func:`patchray.distributed.comm.intercept`, the one
  layer that also counts (:func:`~patchray.distributed.comm.log_comm`). The throttle lets each top-level call run
  and then sleeps until it has taken as long as the profile's model of it; it is installed only when asked, so
  the runtime path never pays for it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, Mapping, Optional, Sequence

from ..comm import CommCall, intercept, tensor_bytes
from ..topology.links import LINK_PROFILES, LinkProfile, get_profile, model_latency_ms, transfer_ms

__all__ = [
    "LinkProfile",
    "LINK_PROFILES",
    "get_profile",
    "transfer_ms",
    "model_latency_ms",
    "wire_bytes",
    "model_record",
    "throttle_link",
    "time_comm",
    "call_wire_bytes",
    "stage_compute_ms",
    "effective_compute",
    "model_alone",
    "summarise_alone",
]


def wire_bytes(bytes_by_op: Mapping[str, int], world_size: int) -> int:
    """Bytes one rank puts on (or, for a gather's root, takes off) its link, from counted bytes (``docs/benchmark.md``).

    Args:
        bytes_by_op: one rank's counted bytes per operation (``CommLog.bytes``).
        world_size: the group size N.
    """
    n = int(world_size)
    if n <= 1:
        return 0
    b = {k: float(v) for k, v in bytes_by_op.items()}
    total = 0.0
    total += b.get("all_reduce", 0.0) * 2 * (n - 1) / n  # ring: reduce-scatter + all-gather
    # all_gather counts N output buffers + 1 input: a rank sends its input to N-1 peers (ring: N-1 hops)
    total += (b.get("all_gather", 0.0) + b.get("all_gather_into_tensor", 0.0)) * (n - 1) / (n + 1)
    total += b.get("broadcast", 0.0)  # the root sends it once (ring/tree pipelines)
    total += b.get("gather", 0.0) * (n - 1)  # the root's inbound link carries N-1 inputs
    total += b.get("all_to_all_single", 0.0) * (n - 1) / (2 * n)  # input + output counted; N-1 of N pieces leave
    total += b.get("isend", 0.0) + b.get("send", 0.0)  # exact: point-to-point payloads
    return int(round(total))


def model_record(compute_ms_by_rank: Sequence[float], bytes_by_op_by_rank: Sequence[Mapping[str, int]],
                 messages_by_rank: Sequence[int], world_size: int,
                 profiles: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """``{profile: modelled_ms}``: the slowest rank's modelled latency for each profile."""
    out = {}
    for name in profiles or LINK_PROFILES:
        per_rank = [
            model_latency_ms(max(0.0, c), wire_bytes(b, world_size) if world_size > 1 else 0, m if world_size > 1 else 0, name)
            for c, b, m in zip(compute_ms_by_rank, bytes_by_op_by_rank, messages_by_rank)
        ]
        out[name] = round(max(per_rank), 3) if per_rank else None
    return out


# --------------------------------------------------------------------------------------------------
# hooks on comm's interception layer: a real throttle, and a timer of the time spent in communication


def call_wire_bytes(call: CommCall, world_size: int) -> int:
    """Bytes one top-level call puts on this rank's link (a batch: its sends; see :func:`wire_bytes`)."""
    if call.op == "batch_isend_irecv":
        ops = call.args[0] if call.args else []
        return sum(tensor_bytes(p.tensor) for p in ops if getattr(getattr(p, "op", None), "__name__", "") == "isend")
    if call.op in ("barrier", "recv", "irecv"):
        return 0
    return wire_bytes({call.op: call.nbytes}, world_size)


@contextlib.contextmanager
def throttle_link(profile, world_size: int) -> Iterator[dict]:
    """Make every communication call take at least as long as ``profile`` models it (this process only).

    Install it before :func:`time_comm` and :func:`patchray.distributed.comm.log_comm`, so the timer bills the
    sleep to communication. Yields a dict with the total sleep added (``slept_ms``) and the calls throttled.
    """
    p = get_profile(profile)
    stats = {"profile": p.name, "slept_ms": 0.0, "calls": 0}

    def throttle(call: CommCall, proceed):
        if call.batched:
            return proceed()  # inside a batch or an object collective: paid at the top
        start = time.perf_counter()
        result = proceed()
        if call.op == "barrier":
            return result
        target = (p.latency_us / 1e3 + transfer_ms(call_wire_bytes(call, world_size), p)) / 1e3
        left = target - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
            stats["slept_ms"] += left * 1e3
        stats["calls"] += 1
        return result

    with intercept(throttle):
        yield stats


class _Done:
    """A finished request: ``wait()`` returns at once, everything else goes to the original work."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def time_comm(synchronize=None) -> Iterator[dict]:
    """Accumulate the wall time this process spends inside top-level communication calls.

    Args:
        synchronize: called before and after each call (``torch.cuda.synchronize`` on CUDA ranks, so
            queued kernels are not billed to communication and asynchronous collectives are billed in full).
    """
    stats = {"ms": 0.0, "calls": 0}

    def timer(call: CommCall, proceed):
        if call.batched:
            return proceed()
        if synchronize:
            synchronize()
        start = time.perf_counter()
        result = proceed()
        if call.op == "batch_isend_irecv" and result:
            # bill the transfer here, not to whoever waits later; a gloo work must not be waited twice
            for work in result:
                work.wait()
            result = [_Done(w) for w in result]
        if synchronize:
            synchronize()
        stats["ms"] += (time.perf_counter() - start) * 1e3
        stats["calls"] += 1
        return result

    with intercept(timer):
        yield stats


# --------------------------------------------------------------------------------------------------
# turn-taking runs (turns.take_turns): each rank's compute measured alone, stage by stage


def stage_compute_ms(compute_by_rank: Sequence[Sequence[float]]) -> float:
    """The compute of one run on N devices: per stage the slowest rank, summed over the stages.

    The ranks meet at every collective, so a stage ends when its slowest rank does. Ranks whose stage lists
    differ in length (not the same collectives) fall back to the slowest rank's total.
    """
    if not compute_by_rank:
        return 0.0
    if len({len(c) for c in compute_by_rank}) != 1:
        return max(sum(c) for c in compute_by_rank)
    return float(sum(max(col) for col in zip(*compute_by_rank)))


def effective_compute(runs_by_rank: Sequence[Mapping], start: int = 0, stop: Optional[int] = None) -> dict:
    """The compute of stages ``[start, stop)`` of one run on N devices, with the launch bound of a prefilled clock.

    ``gpu_ms``: per stage the slowest rank's ``compute_ms``, summed (:func:`stage_compute_ms`). With the
    ``gpu-prefilled`` clock (:mod:`.turns`) that is GPU time with no launch gaps, and a real run is bounded by
    the CPU as well: with asynchronous collectives the CPU runs ahead of the GPU across stages, so the run takes
    the longer of the GPU's work and the CPU's issuing. Per call (the stages given): ``launch_ms`` = per stage the
    slowest rank's issue time (``launch_ms``), summed over the *queued* stages (every rank issued the whole stage
    before its GPU reached it, so the issue time holds no wait); if it exceeds those stages' GPU time the run
    cannot keep the GPU fed and the modelled compute uses the CPU time for them (``launch_bound``). The other
    stages count with their GPU time: a stage that waits on the device inside (``host_syncs``), or whose issuing
    overlapped its GPU work (a spin too short, or a launch queue that filled up and blocked the CPU), has an issue
    time that holds waits, and a GPU time that already holds whatever gaps the CPU left. Other clocks
    (``idle-start``, ``cpu-wall``): ``compute_ms = gpu_ms``, no launch rule (an idle-start stage's time holds its
    launch time).

    Returns:
        ``{"compute_ms", "gpu_ms", "launch_ms", "launch_bound", "clock", "stages", "queued_stages",
        "host_sync_stages"}`` (``launch_ms`` and the counts ``None`` where the clock has none).
    """
    lists = [list(r["compute_ms"])[start:stop] for r in runs_by_rank]
    gpu = stage_compute_ms(lists)
    clocks = {r.get("clock", "cpu-wall") for r in runs_by_rank}
    clock = clocks.pop() if len(clocks) == 1 else "mixed"
    out = {"compute_ms": gpu, "gpu_ms": gpu, "launch_ms": None, "launch_bound": False, "clock": clock,
           "stages": len(lists[0]) if lists else 0, "queued_stages": None, "host_sync_stages": None}
    aligned = len({len(c) for c in lists}) == 1
    if clock != "gpu-prefilled" or not aligned or not all("launch_ms" in r for r in runs_by_rank):
        return out
    launch = [list(r["launch_ms"])[start:stop] for r in runs_by_rank]
    syncs = [list(r.get("host_syncs") or [0] * len(r["compute_ms"]))[start:stop] for r in runs_by_rank]
    queued = [list(r.get("queued") or [False] * len(r["compute_ms"]))[start:stop] for r in runs_by_rank]
    free_gpu = free_launch = other_gpu = 0.0
    n_sync = n_queued = 0
    for k in range(len(lists[0])):
        g = max(c[k] for c in lists)
        n_sync += any(s[k] for s in syncs)
        if any(s[k] for s in syncs) or not all(q[k] for q in queued):
            other_gpu += g
            continue
        n_queued += 1
        free_gpu += g
        free_launch += max(l[k] for l in launch)
    out.update(compute_ms=other_gpu + max(free_gpu, free_launch), launch_ms=free_launch,
               launch_bound=free_launch > free_gpu, queued_stages=n_queued, host_sync_stages=n_sync)
    return out


def _comm_model_ms(wire_by_rank: Sequence[Sequence[int]], profile) -> float:
    p = get_profile(profile)
    if len({len(w) for w in wire_by_rank}) != 1:  # not the same calls: each rank's own sum, the slowest
        return max(sum(p.latency_us / 1e3 + transfer_ms(b, p) for b in w) for w in wire_by_rank)
    return float(sum(max(p.latency_us / 1e3 + transfer_ms(b, p) for b in col) for col in zip(*wire_by_rank)))


def model_alone(runs_by_rank: Sequence[Mapping], world_size: int, profiles: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """``{profile: modelled_ms}`` of one turn-taking invocation (one :meth:`TurnTaking.to_dict` per rank).

    Modelled latency = the call's compute (:func:`effective_compute`: per stage the slowest rank's compute measured
    alone, summed; with the prefilled GPU clock, the CPU's issue time instead where it exceeds the GPU time), plus
    per collective the slowest rank's modelled transfer (``latency + wire_bytes / bandwidth``, doubled via host),
    summed.
    """
    compute = effective_compute(runs_by_rank)["compute_ms"]
    out = {}
    for name in profiles or LINK_PROFILES:
        comm = _comm_model_ms([r["wire_bytes"] for r in runs_by_rank], name) if world_size > 1 else 0.0
        out[get_profile(name).name] = round(compute + comm, 3)
    return out


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return float(xs[mid]) if len(xs) % 2 else float(xs[mid - 1] + xs[mid]) / 2


def summarise_alone(runs_by_rank: Sequence[Sequence[Mapping]], world_size: int) -> dict:
    """The record's ``alone`` block from every rank's turn-taking invocations (``docs/benchmark.md``).

    Args:
        runs_by_rank: ``runs_by_rank[r][i]``: rank r's :meth:`TurnTaking.to_dict` of invocation i.
        world_size: N.
    """
    iters = min(len(r) for r in runs_by_rank)
    per_iter = [[runs_by_rank[r][i] for r in range(len(runs_by_rank))] for i in range(iters)]
    eff = [effective_compute(it) for it in per_iter]
    compute = [e["compute_ms"] for e in eff]
    gpu = [e["gpu_ms"] for e in eff]
    cpu = [stage_compute_ms([x["cpu_ms"] for x in it]) for it in per_iter]

    def comm_measured(it):
        cols = [x["comm_ms"] for x in it]
        if len({len(c) for c in cols}) != 1:
            return max(sum(c) for c in cols)
        return float(sum(max(col) for col in zip(*cols)))

    comm = [comm_measured(it) for it in per_iter]
    models = [model_alone(it, world_size) for it in per_iter]
    first = per_iter[0] if per_iter else []
    clock = eff[0]["clock"] if eff else None
    launch = [e["launch_ms"] for e in eff if e["launch_ms"] is not None]
    notes = {
        "gpu-prefilled": ("ranks computed one at a time between collectives (each with the device to itself); each "
                          "stage's GPU time measured behind a prefilled launch queue (no launch gaps), its CPU issue "
                          "time beside it; compute_ms = per call the longer of the GPU time and the CPU's issue time "
                          "(launch bound), per stage the slowest rank; latency figures here are modelled"),
        "idle-start": ("ranks computed one at a time between collectives (each with the device to itself); each stage "
                       "timed from an idle GPU (CUDA events), so its time includes the CPU's launch time; compute_ms "
                       "is the sum over stages of the slowest rank's stage; latency figures here are modelled"),
    }
    return {
        "method": "turn-taking",
        "clock": clock,
        "modelled": True,
        "note": notes.get(clock, "ranks computed one at a time between collectives (each with the device to itself); "
                                 "compute_ms is the sum over stages of the slowest rank's stage; latency figures here "
                                 "are modelled"),
        "iterations": iters,
        "stages": len(first[0]["compute_ms"]) if first else None,
        "collectives": len(first[0]["comm_ms"]) if first else None,
        "compute_ms": _median(compute),
        "compute_ms_iterations": [round(c, 3) for c in compute],
        "compute_ms_by_rank": [_median([sum(x["compute_ms"]) for x in runs]) for runs in runs_by_rank],
        "gpu_ms": _median(gpu) if clock != "cpu-wall" else None,
        "launch_ms": _median(launch) if launch else None,
        "launch_ms_by_rank": ([_median([sum(x["launch_ms"]) for x in runs]) for runs in runs_by_rank]
                              if all("launch_ms" in x for runs in runs_by_rank for x in runs) else None),
        "launch_bound": any(e["launch_bound"] for e in eff) if eff else False,
        "launch_bound_iterations": sum(bool(e["launch_bound"]) for e in eff),
        "queued_stages": eff[0]["queued_stages"] if eff else None,
        "host_sync_stages": eff[0]["host_sync_stages"] if eff else None,
        "cpu_compute_ms": _median(cpu),
        "comm_ms_measured": _median(comm),
        "latency_ms_modelled_measured_comm": _median([a + b for a, b in zip(compute, comm)]),
        "link_model": {name: _median([m[name] for m in models]) for name in (models[0] if models else {})},
    }
