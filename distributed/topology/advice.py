"""Advice from a topology report: NCCL environment, decode mode, OTIL preset and k, and plain warnings.

Design decisions:

* **Every choice names its evidence.** An :class:`Advice` carries the exact environment to set (``env``) or the
  PatchRay setting it picks (``settings``) and a sentence saying which measurement or ``nvidia-smi`` status led
  there, so a user can check it and a maintainer reading a shared report can disagree with it.
* **Measurements beat labels.** ``nvidia-smi`` says what the driver *allows*; consumer boards report P2P "OK"
  paths that are slower than host memory, and ACS/IOMMU can break P2P silently. Where the probe measured NCCL
  with and without P2P, that comparison decides ``NCCL_P2P_DISABLE``; status strings decide only when nothing
  was measured.
* **Bandwidth classes come from the named link profiles** (:mod:`.links`, ``LINK_PROFILES``, which the
  benchmark's link model uses too): a link is described as the nearest named profile, so the decode mode and the
  OTIL preset chosen here match what the benchmark's modelled latencies show for that profile.
* **The report holds facts; the advice is derived.** :class:`~.report.TopologyReport` knows nothing of this
  module; :func:`report_with_advice` is the probe's JSON document (the report's dict with the advice filled in).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Optional, Sequence

from .links import (
    LinkEstimate,
    bottleneck_link,
    effective_gbps,
    link_profiles,
    nearest_profile,
)
from .parse import P2P_STATUS_MEANING, LinkClass, pcie_path_rank
from .report import NodeTopology, TopologyReport, pcie_gbps

__all__ = [
    "Advice",
    "LinkEstimate",
    "DecodeChoice",
    "OtilChoice",
    "advise",
    "link_profiles",
    "nearest_profile",
    "effective_gbps",
    "bottleneck_link",
    "choose_decode_mode",
    "choose_otil_preset",
    "recommended_settings",
    "report_with_advice",
]

# Thresholds (GB/s) used when the caller gives no per-workload byte counts. Row decode exchanges halos and
# GroupNorm statistics at every layer, so it wants a link that is neither staged through host memory nor
# slower than PCIe 4.0 x16 with P2P (~24 GB/s measured, 31.5 theoretical); 20 leaves room for measurement noise.
ROW_MIN_GBPS = 20.0
# OTIL: at or above NVLink-class bandwidth the full latent gather is nearly free, so the balanced preset keeps the
# gather and spends the budget on quality instead; below, send the top-k blocks. k/K = 1/4 is the OTIL paper's
# setting on A100 over PCIe (~20-25 GB/s); slower links halve k per class down to 1/16.
OTIL_FULL_GATHER_GBPS = 100.0
_OTIL_K_CLASSES = ((20.0, 1 / 4), (5.0, 1 / 8), (0.0, 1 / 16))
# PCIe 3.0 x4: the narrowest link that still gets no warning.
NARROW_PCIE_GBPS = pcie_gbps(3, 4)
# NCCL with P2P disabled must beat P2P by more than this to call P2P "slow": a short all_reduce timing
# varies by a few percent between runs, so 10% is a difference, not noise.
_NCCL_MARGIN = 1.10


@dataclass(frozen=True)
class Advice:
    """One piece of advice.

    Attributes:
        kind: ``"nccl_env"``, ``"placement"``, ``"decode_mode"``, ``"otil"``, ``"warning"`` or ``"info"``.
        severity: ``"action"`` (set or do this), ``"warning"`` (know this: it costs speed) or ``"info"``.
        title: one line.
        detail: why, naming the evidence.
        env: environment variables to export (``{"NCCL_P2P_DISABLE": "1"}``).
        settings: PatchRay settings chosen (``{"decode_mode": "tile-runs"}``).
    """

    kind: str
    severity: str
    title: str
    detail: str = ""
    env: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class DecodeChoice(NamedTuple):
    mode: str  # "row" or "tile-runs"
    reason: str
    link: LinkEstimate
    profile: Optional[str]


def choose_decode_mode(
    report: TopologyReport,
    devices: Optional[Sequence[int]] = None,
    *,
    halo_bytes: Optional[float] = None,
    exchanges: Optional[int] = None,
    compute_ms: Optional[float] = None,
    overhead_budget: float = 0.25,
    min_row_gbps: float = ROW_MIN_GBPS,
) -> DecodeChoice:
    """Pick the distributed decode mode for the measured link: exact ``"row"`` or communication-free ``"tile-runs"``.

    With the workload's counted bytes (``halo_bytes`` per decode and the number of ``exchanges``, e.g. from a
    dry run's comm accounting) and its per-rank ``compute_ms``, row mode is chosen when the modelled
    communication time ``halo_bytes / bandwidth + exchanges * latency`` stays within ``overhead_budget`` of the
    compute. Without them, row mode needs a direct (not host-staged) link of at least ``min_row_gbps``.

    Args:
        report (`TopologyReport`): the probe's result.
        devices (`list[int]`, *optional*): the GPUs the decode runs on (default: all of the first node).

    Returns:
        `DecodeChoice`: ``mode``, a ``reason`` naming the evidence, the bottleneck ``link`` and the nearest
        link-model ``profile`` name.

    Example::

        >>> choose_decode_mode(report).mode
        'tile-runs'
    """
    if overhead_budget <= 0:
        raise ValueError(f"overhead_budget must be > 0 (got {overhead_budget})")
    link = bottleneck_link(report, devices)
    if link.bandwidth_gbps is None:
        return DecodeChoice("row", "no GPU link to measure (one device or CPU ranks): row mode is exact", link, None)
    prof = nearest_profile(link.bandwidth_gbps, link.via_host)
    pname = prof.name if prof else None
    bw = f"{link.bandwidth_gbps:.1f} GB/s ({link.source}, {link.where}; like link profile '{pname}')"
    if halo_bytes is not None and exchanges is not None and compute_ms:
        lat = link.latency_us if link.latency_us is not None else (prof.latency_us if prof else 20.0)
        comm_ms = halo_bytes / (link.bandwidth_gbps * 1e9) * 1e3 + exchanges * lat * 1e-3
        if comm_ms <= overhead_budget * compute_ms:
            return DecodeChoice("row", f"modelled halo traffic {comm_ms:.1f} ms <= {overhead_budget:.0%} of {compute_ms:.0f} ms compute at {bw}", link, pname)
        return DecodeChoice("tile-runs", f"modelled halo traffic {comm_ms:.1f} ms > {overhead_budget:.0%} of {compute_ms:.0f} ms compute at {bw}", link, pname)
    if link.via_host is not True and link.bandwidth_gbps >= min_row_gbps:
        return DecodeChoice("row", f"direct GPU link at {bw} carries row mode's per-layer halos (exact result)", link, pname)
    why = "staged through host memory" if link.via_host else f"below {min_row_gbps:.0f} GB/s"
    return DecodeChoice(
        "tile-runs",
        f"link is {why}: {bw}; tile-runs decodes whole tiles with no per-layer exchange (seams are blended)",
        link,
        pname,
    )


class OtilChoice(NamedTuple):
    preset: str  # "balanced" or "otil"
    k_fraction: float  # k / K
    k: Optional[int]  # when num_blocks (K) is given
    reason: str
    link: LinkEstimate


def choose_otil_preset(
    report: TopologyReport,
    devices: Optional[Sequence[int]] = None,
    *,
    num_blocks: Optional[int] = None,
    block_bytes: Optional[float] = None,
    step_compute_ms: Optional[float] = None,
    overhead_budget: float = 0.15,
) -> OtilChoice:
    """Pick the OTIL preset and k (blocks sent per step out of ``num_blocks`` = K) for the measured link.

    Over NVLink-class links the ``balanced`` preset keeps the full gather (k = K). Otherwise the ``otil`` preset
    sends the top-k blocks: with ``block_bytes`` and ``step_compute_ms`` given, k is the largest count whose
    modelled transfer to the ``N - 1`` peers fits in ``overhead_budget`` of a step; without them, k/K follows the
    bandwidth class (1/4 as in the OTIL paper at PCIe 4.0 rates, 1/8 below 20 GB/s, 1/16 below 5 GB/s).

    Returns:
        `OtilChoice`: ``preset``, ``k_fraction``, ``k`` (``None`` without ``num_blocks``), ``reason``, ``link``.
    """
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
    link = bottleneck_link(report, devices)
    node = report.local
    world = len(devices) if devices is not None else max(2, len(node.gpus) if node else 2)

    def out(preset, frac, why):
        k = None if num_blocks is None else max(1, min(num_blocks, math.ceil(num_blocks * frac)))
        return OtilChoice(preset, frac if k is None else k / num_blocks, k, why, link)

    if link.bandwidth_gbps is None:
        return out("otil", 1 / 4, "no GPU link measured: the OTIL paper's k/K = 1/4")
    bw = f"{link.bandwidth_gbps:.1f} GB/s ({link.source}, {link.where})"
    if link.bandwidth_gbps >= OTIL_FULL_GATHER_GBPS and link.via_host is not True:
        return out("balanced", 1.0, f"{bw}: the full gather costs little, spend it on quality")
    if num_blocks is not None and block_bytes and step_compute_ms:
        lat_ms = (link.latency_us if link.latency_us is not None else 20.0) * 1e-3
        budget_ms = overhead_budget * step_compute_ms - lat_ms
        per_block_ms = (world - 1) * block_bytes / (link.bandwidth_gbps * 1e9) * 1e3
        k = int(budget_ms // per_block_ms) if budget_ms > 0 else 1
        k = max(1, min(num_blocks, k))
        return OtilChoice("otil", k / num_blocks, k, f"{bw}: {k} of {num_blocks} blocks fit in {overhead_budget:.0%} of a {step_compute_ms:.0f} ms step", link)
    for floor, frac in _OTIL_K_CLASSES:
        if link.bandwidth_gbps >= floor:
            return out("otil", frac, f"{bw}: send the top k/K = 1/{round(1 / frac)} most-changed blocks per step")
    raise AssertionError("unreachable: the last class has floor 0")  # backstop, not the guard


# --------------------------------------------------------------------------------------------------
# advise


def _status_words(pairs) -> str:
    seen = []
    for p in pairs:
        for s in (p.p2p_read, p.p2p_write):
            if s and s != "OK" and s not in seen:
                seen.append(s)
    return ", ".join(f"{s} = {P2P_STATUS_MEANING.get(s, s).lower()}" for s in seen) or "CUDA refuses peer access"


def _p2p_cause(node: NodeTopology, pairs) -> str:
    """The likely reason, from the statuses and GPU names."""
    names = " ".join(g.name or "" for g in node.gpus)
    statuses = {s for p in pairs for s in (p.p2p_read, p.p2p_write) if s}
    if "GeForce" in names or "GNS" in statuses:
        return ("GeForce cards have P2P disabled by the driver (NVIDIA/nccl#1309); a patched open kernel module "
                "exists (aikitoria/open-gpu-kernel-modules) but is unsupported.")
    if statuses & {"CNS", "TNS"}:
        return ("The chipset or PCIe topology refuses P2P on this path; check the BIOS (ACS, IOMMU, "
                "Above 4G decoding / Resizable BAR) and whether the GPUs hang off different CPU sockets.")
    return "Check the driver, the BIOS (ACS/IOMMU) and whether this runs in a VM."


def _groups(indices, same) -> list:
    """Connected components of ``indices`` under the relation ``same(i, j)``."""
    groups: list = []
    for i in indices:
        merged = [g for g in groups if any(same(i, j) for j in g)]
        new = [i] + [j for g in merged for j in g]
        groups = [g for g in groups if g not in merged] + [sorted(new)]
    return sorted(groups)


def _advise_node(node: NodeTopology) -> list:
    out: list = []
    tag = f"{node.host}: " if node.source == "remote" else ""
    gpus = node.gpus
    pairs = node.pairs
    # plain warnings first
    for g in gpus:
        bw = g.pcie_link_gbps
        if bw is not None and bw <= NARROW_PCIE_GBPS + 1e-9:
            trained = ""
            if g.pcie_width and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
                trained = f" (the card supports x{g.pcie_width_max}; the slot or riser gives x{g.pcie_width})"
            out.append(Advice(
                "warning", "warning",
                f"{tag}GPU{g.index} ({g.name or '?'}) is on {g.pcie_label()}, {bw:.1f} GB/s{trained}",
                "Every exchange with this GPU is limited to that rate; it is usually a slot wired to the chipset. "
                "Move the card to a CPU-attached x8/x16 slot, or leave it out with CUDA_VISIBLE_DEVICES.",
            ))
    names = {}
    for g in gpus:
        if g.name:
            names.setdefault(g.name, []).append(g.index)
    if len(names) > 1:
        listing = "; ".join(f"{n} (GPU{', GPU'.join(map(str, ix))})" for n, ix in names.items())
        out.append(Advice(
            "warning", "warning", f"{tag}Mixed GPU models: {listing}",
            "Each step waits for the slowest GPU and the memory limit is the smallest card's; PatchRay splits work "
            "evenly, so expect the pace of the slowest model. Use identical cards together (CUDA_VISIBLE_DEVICES).",
        ))
    numa = {g.index: g.numa_node for g in gpus if g.numa_node not in (None, "N/A")}
    cross = [p for p in pairs if p.link_class is LinkClass.CROSS_SOCKET] or [
        p for p in pairs
        if p.a in numa and p.b in numa and numa[p.a] != numa[p.b] and p.link_class is not LinkClass.NVLINK
    ]  # NVLink pairs talk over NVLink whatever socket their host memory is on
    if cross:
        by_socket = _groups(
            [g.index for g in gpus],
            lambda i, j: (node.pair(i, j) is not None and node.pair(i, j).link_class is not LinkClass.CROSS_SOCKET)
            and (numa.get(i) == numa.get(j)),
        )
        choice = " or ".join(",".join(map(str, grp)) for grp in by_socket if len(grp) > 1)
        out.append(Advice(
            "warning", "warning",
            f"{tag}GPUs span CPU sockets: {', '.join(f'GPU{p.a}-GPU{p.b}' for p in cross[:4])}"
            + (" ..." if len(cross) > 4 else "") + " cross the inter-socket link",
            "Traffic between sockets crosses QPI/UPI/xGMI and is the slowest path in the box. For jobs that fit, keep "
            "the ranks on one socket" + (f": CUDA_VISIBLE_DEVICES={choice}" if choice else "") + ".",
            settings={"socket_groups": by_socket},
        ))
    if len(gpus) < 2 or not pairs:
        return out
    if all(p.p2p_ok is None for p in pairs):
        out.append(Advice(
            "info", "info", f"{tag}P2P status unknown",
            "Add the output of `nvidia-smi topo -p2p r` (--p2p-file) or run the probe on the machine itself; until "
            "then PatchRay assumes data between GPUs goes through host memory.",
        ))
    no_p2p = [p for p in pairs if p.p2p_ok is False]
    ok = [p for p in pairs if p.p2p_ok is True]
    nvlink_all = all(p.link_class is LinkClass.NVLINK for p in pairs)
    if no_p2p:
        where = ", ".join(f"GPU{p.a}-GPU{p.b}" for p in no_p2p[:4]) + (" ..." if len(no_p2p) > 4 else "")
        out.append(Advice(
            "warning", "warning", f"{tag}No GPU peer-to-peer between {where} ({_status_words(no_p2p)})",
            "Data between these GPUs is copied through host memory, so chatty multi-GPU modes can be slower than one "
            "GPU; PatchRay's auto modes pick tile-runs decode and the sparse OTIL exchange for such links. "
            + _p2p_cause(node, no_p2p),
        ))
    broken = [p for p in pairs if p.can_access_peer is False and "OK" in (p.p2p_read, p.p2p_write)]
    n = node.nccl
    measured = n is not None and not n.error and n.p2p_allowed_gbps and n.p2p_disabled_gbps
    if measured and n.p2p_disabled_gbps > _NCCL_MARGIN * n.p2p_allowed_gbps:
        out.append(Advice(
            "nccl_env", "action", f"{tag}Set NCCL_P2P_DISABLE=1: P2P is slower than host memory here",
            f"NCCL all_reduce measured {n.p2p_disabled_gbps:.1f} GB/s with NCCL_P2P_DISABLE=1 against "
            f"{n.p2p_allowed_gbps:.1f} GB/s with P2P allowed over GPUs {n.devices}.",
            env={"NCCL_P2P_DISABLE": "1"},
        ))
    elif broken:
        out.append(Advice(
            "nccl_env", "action", f"{tag}Set NCCL_P2P_DISABLE=1: P2P is reported but CUDA refuses it",
            "nvidia-smi reports P2P OK for " + ", ".join(f"GPU{p.a}-GPU{p.b}" for p in broken)
            + " but torch.cuda.can_device_access_peer says no (IOMMU/ACS, or a VM); NCCL may hang or crash on it.",
            env={"NCCL_P2P_DISABLE": "1"},
        ))
    elif no_p2p and not ok:
        out.append(Advice(
            "nccl_env", "action", f"{tag}Set NCCL_P2P_DISABLE=1: no GPU pair has peer-to-peer",
            "NCCL then moves data through host shared memory on purpose instead of probing P2P paths, which avoids "
            "the start-up hangs users report on consumer boards without P2P (raylight's README gives the same "
            "workaround). It costs nothing here: there is no P2P to lose.",
            env={"NCCL_P2P_DISABLE": "1"},
        ))
    elif no_p2p and ok:
        groups = _groups(sorted({g.index for g in gpus}), lambda i, j: bool(node.pair(i, j) and node.pair(i, j).p2p_ok))
        big = max(groups, key=len)
        out.append(Advice(
            "placement", "action",
            f"{tag}P2P works only within GPU groups {groups}: run multi-GPU jobs inside one group",
            "NCCL uses P2P where it can, but a job that spans groups is paced by the host-staged pairs.",
            env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, big))} if len(big) > 1 else {},
            settings={"p2p_groups": groups},
        ))
    elif measured:
        out.append(Advice(
            "info", "info", f"{tag}Keep P2P on",
            f"NCCL all_reduce measured {n.p2p_allowed_gbps:.1f} GB/s with P2P allowed and "
            f"{n.p2p_disabled_gbps:.1f} GB/s with NCCL_P2P_DISABLE=1.",
        ))
    slow_p2p = bool(measured and n.p2p_disabled_gbps > _NCCL_MARGIN * n.p2p_allowed_gbps)
    if ok and not broken and not slow_p2p and not nvlink_all:
        worst = max((p for p in ok if p.link), key=lambda p: pcie_path_rank(p.link), default=None)
        if worst is not None and worst.link.upper() in ("PHB", "NODE"):
            level = worst.link.upper()
            out.append(Advice(
                "nccl_env", "action", f"{tag}Set NCCL_P2P_LEVEL={level}: let NCCL use the P2P the driver allows",
                f"The driver reports P2P OK on {level} paths (GPU{worst.a}-GPU{worst.b}), but NCCL by default uses P2P "
                "only through PCIe switches (PXB; AMD hosts with two GPUs excepted) and otherwise goes through host "
                "memory. Compare the NCCL figures of `python -m patchray probe` with and without it.",
                env={"NCCL_P2P_LEVEL": level},
            ))
    if nvlink_all:
        out.append(Advice("info", "info", f"{tag}NVLink between all GPUs: NCCL's defaults are right", ""))
    return out


def advise(report: TopologyReport) -> list:
    """Advice for a topology report, most important first.

    Returns:
        `list[Advice]`: warnings (no GPU, one GPU, PCIe 3.0 x4 or narrower, mixed models, CPU sockets, no P2P,
        a slow link between nodes), the NCCL environment to set, and the decode mode and OTIL preset/k that
        PatchRay's auto modes pick for the measured link.

    Example::

        >>> for a in advise(report):
        ...     print(a.severity, a.title, a.env)
    """
    out: list = []
    if report.gpu_count == 0:
        out.append(Advice(
            "warning", "warning", "No NVIDIA GPU found",
            "PatchRay runs on CPU ranks here: correct results, no GPU speed-up. The report's notes say what was "
            "checked (nvidia-smi, NVML, PyTorch).",
        ))
    elif report.gpu_count == 1:
        out.append(Advice(
            "info", "info", "One GPU: nothing to split across GPUs",
            "Multi-GPU decode and sampling need two or more GPUs (on this machine or on other Ray nodes).",
        ))
    for node in report.nodes:
        out.extend(_advise_node(node))
    for link in report.inter_node:
        if link.bandwidth_gbps is not None and link.bandwidth_gbps < ROW_MIN_GBPS:
            out.append(Advice(
                "warning", "warning", f"Nodes {link.a} and {link.b} are linked at {link.bandwidth_gbps:.1f} GB/s",
                "That is far slower than GPUs inside one machine: keep row decode and patch-parallel sampling within a "
                "node and use several nodes for separate jobs or tile-runs decode.",
            ))
    if report.gpu_count >= 2:
        d = choose_decode_mode(report)
        out.append(Advice("decode_mode", "action", f"Decode mode: {d.mode}", d.reason,
                          settings={"decode_mode": d.mode, "link_profile": d.profile}))
        o = choose_otil_preset(report)
        frac = "K (full gather)" if o.k_fraction >= 1 else f"K/{round(1 / o.k_fraction)}"
        out.append(Advice("otil", "action", f"OTIL preset: {o.preset}, k = {frac}", o.reason,
                          settings={"otil_preset": o.preset, "otil_k_fraction": o.k_fraction}))
    order = {"warning": 0, "action": 1, "info": 2}
    return sorted(out, key=lambda a: order.get(a.severity, 3))


def recommended_settings(report: TopologyReport, devices: Optional[Sequence[int]] = None, **otil_kwargs) -> dict:
    """What PatchRay's auto modes use, in one dict: decode mode, OTIL preset and k, and the NCCL environment.

    Args:
        report (`TopologyReport`): e.g. from :func:`cached_probe`.
        devices (`list[int]`, *optional*): the GPUs of the job (nvidia-smi indices of the first node).
        **otil_kwargs: passed to :func:`choose_otil_preset` (``num_blocks``, ``block_bytes``, ``step_compute_ms``).

    Returns:
        `dict` with ``decode_mode``, ``otil_preset``, ``otil_k_fraction``, ``otil_k`` (``None`` without
        ``num_blocks``), ``env`` (NCCL variables advised for the first node) and ``link`` (the bottleneck, as a dict).

    Example::

        >>> recommended_settings(cached_probe(key), num_blocks=64)["otil_k"]
        16
    """
    d = choose_decode_mode(report, devices)
    o = choose_otil_preset(report, devices, **otil_kwargs)
    env: dict = {}
    if report.local is not None:
        for a in _advise_node(report.local):
            if a.kind == "nccl_env":
                env.update(a.env)
    return {
        "decode_mode": d.mode,
        "otil_preset": o.preset,
        "otil_k_fraction": o.k_fraction,
        "otil_k": o.k,
        "env": env,
        "link": d.link._asdict(),
    }


def report_with_advice(report: TopologyReport) -> dict:
    """The probe's JSON document: ``report.to_dict()`` with its ``"advice"`` list filled from :func:`advise`.

    Example::

        >>> doc = report_with_advice(probe_topology())
        >>> [a["title"] for a in doc["advice"]]
    """
    return report.to_dict(advice=advise(report))
