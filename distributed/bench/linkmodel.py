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


def _op_wire_bytes(call: CommCall, world_size: int) -> int:
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
        target = (p.latency_us / 1e3 + transfer_ms(_op_wire_bytes(call, world_size), p)) / 1e3
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
