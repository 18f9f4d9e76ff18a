"""The link model: what a measured case would take on another interconnect, and a throttle to check it.

Design decisions:

* **Measure compute, count bytes, model the link.** The benchmark measures each rank's time and the time it
  spends inside communication calls, so ``compute = latency - comm`` per rank; it counts the bytes each rank
  hands to ``torch.distributed`` (seed 000's rules). The modelled latency on a link is
  ``compute + messages * latency + bytes_sent / bandwidth`` (twice the transfer term when the data is staged
  through host memory), taken on the slowest rank. Overlap of compute and communication is ignored: PatchRay's
  exchanges are blocking at layer boundaries, so the sum is the honest model, and an upper bound otherwise.
* **Counted bytes are buffers, not traffic.** Seed 000 counts the positional tensor buffers an operation
  sees (an ``all_gather`` counts its N outputs and its input). :func:`wire_bytes` converts those per-op
  totals into the bytes a rank actually puts on its link under the usual algorithms (ring all-reduce:
  ``2(N-1)/N``; all-gather: ``(N-1)`` inputs; a gather's root receives ``(N-1)`` inputs).
* **A profile is four numbers with a source.** The numbers are *achievable* one-direction rates, i.e. the
  signalling rate times the efficiency PatchRay measured on its own machine where it could (pinned
  host-to-device on the H200 host: 55.3 GB/s of PCIe 5.0 x16's 63.0 GB/s, 0.88, in
  ``shared/reference/baselines-h200.md``). Latencies are per message, order-of-magnitude values: a VAE decode
  sends tens to hundreds of messages, so bandwidth dominates the model.
* **The throttle is real.** ``--link PROFILE`` installs :func:`throttle_link`, which wraps the same operations
  the accounting counts and, after each real call, sleeps until the call has taken as long as the profile's
  model of it. It is installed only when asked and removed afterwards, so the runtime path never pays for it.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from typing import Dict, Iterator, Mapping, NamedTuple, Optional, Sequence

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


class LinkProfile(NamedTuple):
    """One interconnect.

    Args:
        name: the key in :data:`LINK_PROFILES`.
        bandwidth_gbps: achievable bandwidth of one copy, one direction, in GB/s (10^9 bytes per second).
        latency_us: cost of one message (a collective or one batched point-to-point exchange), microseconds.
        via_host: the data is staged through host memory (device -> host, host -> device): two copies, so
            the transfer term counts twice.
        source: where the numbers come from.
    """

    name: str
    bandwidth_gbps: float
    latency_us: float
    via_host: bool
    source: str = ""


_PCIE_EFFICIENCY = 55.3 / 63.0  # measured pinned H2D on PCIe 5.0 x16 (baselines-h200.md) over its signalling rate

LINK_PROFILES: Dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile(
            "nvlink",
            360.0,
            5.0,
            False,
            "NVLink 4 (H100/H200 SXM): 900 GB/s both directions per GPU = 450 GB/s one way (NVIDIA H200 "
            "datasheet); NCCL reaches about 80% of it, 360 GB/s. A consumer NVLink bridge (RTX 3090) is 56 GB/s.",
        ),
        LinkProfile(
            "pcie4_x16_p2p",
            round(31.5 * _PCIE_EFFICIENCY, 1),
            10.0,
            False,
            "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s one way (PCI-SIG), times the 0.88 "
            "efficiency measured on PCIe 5.0 pinned copies; GPU peer-to-peer, one copy.",
        ),
        LinkProfile(
            "pcie4_x16_no_p2p",
            round(31.5 * _PCIE_EFFICIENCY, 1),
            20.0,
            True,
            "PCIe 4.0 x16 without GPU peer-to-peer (nvidia-smi topo -p2p shows NS/CNS): device -> host -> "
            "device, two copies at the PCIe 4.0 rate; twice the per-message cost for the extra copy and sync.",
        ),
        LinkProfile(
            "pcie3_x8",
            round(7.88 * _PCIE_EFFICIENCY, 1),
            10.0,
            False,
            "PCIe 3.0 x8 (a x16 slot split x8/x8 on consumer boards): 8 GT/s x 8 x 128/130 = 7.88 GB/s one way, "
            "times 0.88; peer-to-peer assumed (without it, the transfer counts twice as for pcie4_x16_no_p2p).",
        ),
        LinkProfile(
            "10gbe",
            round(1.25 * 1448 / 1538, 2),
            50.0,
            False,
            "10 Gigabit Ethernet between nodes (IEEE 802.3ae): 1.25 GB/s, times TCP payload per 1500-byte frame "
            "(1448 of 1538 bytes on the wire). NCCL's socket transport pipelines the GPU<->host copies "
            "(~25 GB/s) with the NIC, so the NIC alone is the bottleneck; ~50 us for a TCP message.",
        ),
    )
}


def get_profile(name) -> LinkProfile:
    """A profile by name (or the profile itself); ``ValueError`` naming the known ones otherwise."""
    if isinstance(name, LinkProfile):
        return name
    try:
        return LINK_PROFILES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown link profile {name!r}; known: {', '.join(LINK_PROFILES)}") from None


def transfer_ms(nbytes: float, profile) -> float:
    """Milliseconds to move ``nbytes`` over ``profile`` (bandwidth term only; doubled when via host)."""
    p = get_profile(profile)
    copies = 2 if p.via_host else 1
    return copies * float(nbytes) / (p.bandwidth_gbps * 1e9) * 1e3


def model_latency_ms(compute_ms: float, bytes_sent: float, messages: int, profile) -> float:
    """The modelled latency of one rank: compute plus its messages over ``profile``.

    Args:
        compute_ms: the rank's measured time outside communication calls.
        bytes_sent: bytes the rank puts on its link (see :func:`wire_bytes`).
        messages: communication calls the rank makes (each pays the profile's latency once).
        profile: a :class:`LinkProfile` or its name.

    Example:
        >>> round(model_latency_ms(10.0, 1e9, 0, "10gbe"), 1)  # 1 GB over ~1.18 GB/s
        859.6
    """
    p = get_profile(profile)
    if compute_ms < 0 or bytes_sent < 0 or messages < 0:
        raise ValueError(f"compute_ms, bytes_sent and messages must be >= 0 (got {compute_ms}, {bytes_sent}, {messages})")
    return float(compute_ms) + messages * p.latency_us / 1e3 + transfer_ms(bytes_sent, p)


def wire_bytes(bytes_by_op: Mapping[str, int], world_size: int) -> int:
    """Bytes one rank puts on (or, for a gather's root, takes off) its link, from seed-000 counted bytes.

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
# wrappers: a real throttle, and a timer of the time spent in communication

#: top-level operations the throttle and the timer wrap (the same set the accounting counts)
_WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "gather", "send", "recv",
            "batch_isend_irecv", "barrier")
_C10D = "torch.distributed.distributed_c10d"
_lock = threading.Lock()


def _op_wire_bytes(op: str, args, world_size: int) -> int:
    from ..comm import tensor_bytes as nbytes

    if op == "batch_isend_irecv":
        ops = args[0] if args else []
        return sum(nbytes(p.tensor) for p in ops if getattr(getattr(p, "op", None), "__name__", "") == "isend")
    if op in ("barrier", "recv"):
        return 0
    return wire_bytes({op: sum(nbytes(a) for a in args)}, world_size)


@contextlib.contextmanager
def _wrap_ops(make):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with _lock:
        saved = {op: (getattr(c10d, op), getattr(dist, op)) for op in _WRAPPED}
        for op, (original, _) in saved.items():
            wrapped = make(op, original)
            setattr(c10d, op, wrapped)
            setattr(dist, op, wrapped)
    try:
        yield
    finally:
        with _lock:
            for op, (c_orig, d_orig) in saved.items():
                setattr(c10d, op, c_orig)
                setattr(dist, op, d_orig)


@contextlib.contextmanager
def throttle_link(profile, world_size: int) -> Iterator[dict]:
    """Make every communication call take at least as long as ``profile`` models it (this process only).

    Install it before :func:`patchray.distributed.comm.log_comm` and remove it after, so the accounting
    wraps the throttle. Yields a dict with the total sleep added (``slept_ms``) and the calls throttled.
    """
    p = get_profile(profile)
    stats = {"profile": p.name, "slept_ms": 0.0, "calls": 0}

    def make(op, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "") == _C10D:
                return original(*args, **kwargs)  # inside a batch or an object collective: paid at the top
            start = time.perf_counter()
            result = original(*args, **kwargs)
            if op == "barrier":
                return result
            target = (p.latency_us / 1e3 + transfer_ms(_op_wire_bytes(op, args, world_size), p)) / 1e3
            left = target - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
                stats["slept_ms"] += left * 1e3
            stats["calls"] += 1
            return result

        return wrapper

    with _wrap_ops(make):
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

    def make(op, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "") == _C10D:
                return original(*args, **kwargs)
            if synchronize:
                synchronize()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            if op == "batch_isend_irecv" and result:
                # bill the transfer here, not to whoever waits later; a gloo work must not be waited twice
                for work in result:
                    work.wait()
                result = [_Done(w) for w in result]
            if synchronize:
                synchronize()
            stats["ms"] += (time.perf_counter() - start) * 1e3
            stats["calls"] += 1
            return result

        return wrapper

    with _wrap_ops(make):
        yield stats
