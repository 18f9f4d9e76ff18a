"""Link profiles and link estimates: what the runtime's advice and the benchmark's link model share.

Design decisions:

* **A profile is four numbers with a source.** The numbers are *achievable* one-direction rates, i.e. the
  signalling rate times the efficiency PatchRay measured on its own machine where it could (pinned
  host-to-device copies on an H200 host: 55.3 GB/s of PCIe 5.0 x16's 63.0 GB/s, 0.88). Latencies are per
  message, order-of-magnitude values: a VAE decode sends tens to hundreds of messages, so bandwidth dominates.
* **The model is compute plus messages plus bytes.** ``model_latency_ms = compute + messages * latency +
  bytes / bandwidth``, the transfer term counted twice when the data is staged through host memory (two
  copies). The benchmark (``distributed/bench/linkmodel.py``) turns its counted bytes into the bytes a rank puts
  on its link and applies this model; the topology advice describes a measured or estimated link by the
  nearest named profile, so the decode mode and OTIL preset it picks match what the benchmark models.
* **This module lives in the runtime** (``topology/``): the advice needs the profiles while ComfyUI runs, and
  the runtime never imports the benchmark package.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Sequence

from .parse import LinkClass, nvlink_count
from .report import NodeTopology, PairInfo, TopologyReport, pcie_gbps

__all__ = [
    "LinkProfile",
    "LINK_PROFILES",
    "get_profile",
    "transfer_ms",
    "model_latency_ms",
    "effective_gbps",
    "link_profiles",
    "nearest_profile",
    "LinkEstimate",
    "pair_estimate",
    "bottleneck_link",
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


#: pinned host-to-device copies measured on an H200 host (PCIe 5.0 x16): 55.3 GB/s of the 63.0 GB/s signalling rate
_PCIE_EFFICIENCY = 55.3 / 63.0

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


# --------------------------------------------------------------------------------------------------
# estimating one link from a topology report

# Copies reach ~88% of a PCIe link's signalling rate with P2P (the pinned-copy efficiency the link model measured on
# the H200 host) and half that when staged through host memory (two copies: the link model's via_host rule);
# NVLink ~20 GB/s per link and direction (NV18 -> 360 GB/s, the link model's nvlink profile).
_P2P_EFFICIENCY = _PCIE_EFFICIENCY
_HOST_STAGED_EFFICIENCY = _P2P_EFFICIENCY / 2
_NVLINK_GBPS_PER_LINK = 20.0
_ASSUMED_PCIE_GBPS = pcie_gbps(4, 16)  # when a saved report has no --query-gpu output


def effective_gbps(profile) -> float:
    """What one copy achieves on a profile: its bandwidth, halved when staged through host (two copies)."""
    return profile.bandwidth_gbps / (2.0 if profile.via_host else 1.0)


def link_profiles() -> dict:
    """The named link profiles (a copy of :data:`LINK_PROFILES`)."""
    return dict(LINK_PROFILES)


def nearest_profile(bandwidth_gbps: float, via_host: Optional[bool] = None, profiles: Optional[dict] = None):
    """The named profile whose effective bandwidth (:func:`effective_gbps`) is nearest on a log scale.

    ``via_host`` (known P2P status) restricts the candidates to profiles with the same ``via_host`` when any exist.
    """
    profiles = link_profiles() if profiles is None else profiles
    cands = list(profiles.values())
    if via_host is not None and any(bool(p.via_host) == via_host for p in cands):
        cands = [p for p in cands if bool(p.via_host) == via_host]
    if not cands or not bandwidth_gbps or bandwidth_gbps <= 0:
        return None
    return min(cands, key=lambda p: abs(math.log(max(effective_gbps(p), 1e-6) / bandwidth_gbps)))


class LinkEstimate(NamedTuple):
    """The slowest link among the GPUs a job would use."""

    bandwidth_gbps: Optional[float]
    latency_us: Optional[float]
    via_host: Optional[bool]
    source: str  # "nccl", "copy", "estimate", "inter-node", "none"
    where: str  # "GPU0-GPU1", "hostA<->hostB", ""


def pair_estimate(node: NodeTopology, p: PairInfo) -> LinkEstimate:
    """One GPU pair's link: its measured copy if any, else an estimate from the path kind, P2P status and PCIe link."""
    where = f"GPU{p.a}-GPU{p.b}"
    if p.measured_gbps is not None:
        return LinkEstimate(p.measured_gbps, p.copy_latency_us, None if p.p2p_ok is None else not p.p2p_ok, "copy", where)
    if p.link_class is LinkClass.NVLINK:
        return LinkEstimate(_NVLINK_GBPS_PER_LINK * max(1, nvlink_count(p.link)), 3.0, False, "estimate", where)
    links = [g.pcie_link_gbps for g in (node.gpu(p.a), node.gpu(p.b)) if g is not None and g.pcie_link_gbps]
    pcie = min(links) if links else _ASSUMED_PCIE_GBPS
    if p.p2p_ok:
        eff = _P2P_EFFICIENCY * (0.5 if p.link_class is LinkClass.CROSS_SOCKET else 1.0)
        return LinkEstimate(pcie * eff, 10.0, False, "estimate", where)
    return LinkEstimate(pcie * _HOST_STAGED_EFFICIENCY, 25.0, True, "estimate", where)


def bottleneck_link(report: TopologyReport, devices: Optional[Sequence[int]] = None) -> LinkEstimate:
    """The slowest link a job over ``devices`` (nvidia-smi indices of the first node; default all) would cross.

    Several nodes: the slowest measured link between nodes. One node: NCCL's measured bus bandwidth (the better of
    P2P allowed/disabled, since the advice sets the better one) if measured over these devices, else the slowest
    measured pair copy, else an estimate from the path kind, P2P status and PCIe generation/width.
    """
    if len([n for n in report.nodes if n.gpus]) > 1 and report.inter_node:
        worst = min(report.inter_node, key=lambda x: x.bandwidth_gbps if x.bandwidth_gbps is not None else math.inf)
        if worst.bandwidth_gbps is not None:
            return LinkEstimate(worst.bandwidth_gbps, worst.latency_us, None, "inter-node", f"{worst.a}<->{worst.b}")
    node = report.local
    if node is None or len(node.gpus) < 2:
        return LinkEstimate(None, None, None, "none", "")
    chosen = set(devices) if devices is not None else {g.index for g in node.gpus}
    pairs = [p for p in node.pairs if p.a in chosen and p.b in chosen]
    if not pairs:
        return LinkEstimate(None, None, None, "none", "")
    n = node.nccl
    if n is not None and not n.error and set(n.devices) >= chosen:
        vals = [v for v in (n.p2p_allowed_gbps, n.p2p_disabled_gbps) if v]
        if vals:
            best_off = (n.p2p_disabled_gbps or 0) > (n.p2p_allowed_gbps or 0)
            all_p2p = all(p.p2p_ok for p in pairs)
            return LinkEstimate(max(vals), None, best_off or not all_p2p, "nccl", ",".join(f"GPU{i}" for i in n.devices))
    ests = [pair_estimate(node, p) for p in pairs]
    return min(ests, key=lambda e: e.bandwidth_gbps)


