"""The topology report: one data model and a stable JSON schema (the summary and heatmap are in :mod:`.render`).

Design decision: the live probe, a saved ``nvidia-smi`` output from someone else's machine and a Ray cluster of
several nodes all produce the *same* :class:`TopologyReport`, so advice, the summary, the heatmap, the ComfyUI
node and the CLI have one input. The JSON form (``schema: 1``) keeps every key present on every report (``null``
where a value was not measured or not available), so consumers never branch on missing keys; a change that
renames or retypes a key bumps ``schema``.

Bandwidths are GB/s (1e9 bytes per second) of payload in one direction; latencies are microseconds.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from .parse import LinkClass, link_class, nvlink_count

__all__ = [
    "SCHEMA_VERSION",
    "GpuInfo",
    "PairInfo",
    "NcclBandwidth",
    "NicInfo",
    "NodeTopology",
    "InterNodeLink",
    "TopologyReport",
    "PCIE_LANE_GBPS",
    "pcie_gbps",
    "node_from_dict",
]

SCHEMA_VERSION = 1

#: Usable bandwidth of one PCIe lane per direction, GB/s, after line encoding (8b/10b for gen 1-2,
#: 128b/130b for gen 3-5, FLIT for gen 6). PCIe 4.0 x16 = 31.5 GB/s; real copies reach about 80% of it.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def pcie_gbps(gen: Optional[int], width: Optional[int]) -> Optional[float]:
    """Theoretical one-direction bandwidth of a PCIe link (``None`` when generation or width is unknown)."""
    if not gen or not width or gen not in PCIE_LANE_GBPS:
        return None
    return PCIE_LANE_GBPS[gen] * width


@dataclass
class GpuInfo:
    """One GPU of a node.

    ``index`` is the nvidia-smi / NVML index (PCI bus order, what users see in ``nvidia-smi``);
    ``cuda_index`` is the index PyTorch uses in this process (differs under ``CUDA_VISIBLE_DEVICES`` or the
    default FASTEST_FIRST device order), ``None`` when not visible to PyTorch or analysed from saved text.
    ``pcie_gen`` is the *current* generation, which idle GPUs lower to save power; ``pcie_gen_max`` is the
    best the GPU and its slot can do, so advice uses ``pcie_gen_max`` and the current width.
    """

    index: int
    name: Optional[str] = None
    cuda_index: Optional[int] = None
    pci_bus_id: Optional[str] = None
    pcie_gen: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_width_max: Optional[int] = None
    cpu_affinity: Optional[str] = None
    numa_node: Optional[str] = None
    memory_mib: Optional[int] = None

    @property
    def pcie_link_gbps(self) -> Optional[float]:
        """One-direction bandwidth of this GPU's PCIe link at its best generation and current width."""
        return pcie_gbps(self.pcie_gen_max or self.pcie_gen, self.pcie_width or self.pcie_width_max)

    def pcie_label(self) -> str:
        gen = self.pcie_gen_max or self.pcie_gen
        width = self.pcie_width or self.pcie_width_max
        if not gen and not width:
            return "PCIe ?"
        return f"PCIe {gen or '?'}.0 x{width or '?'}"


@dataclass
class PairInfo:
    """Two GPUs of one node (``a < b``), with everything known about the path between them."""

    a: int
    b: int
    link: Optional[str] = None  # topo -m cell: NV12, PIX, PXB, PHB, NODE, SYS
    p2p_read: Optional[str] = None  # topo -p2p r / NVML: OK, CNS, GNS, TNS, NS, DR, U
    p2p_write: Optional[str] = None
    can_access_peer: Optional[bool] = None  # torch.cuda.can_device_access_peer (both directions)
    copy_gbps: Optional[float] = None  # measured a -> b
    copy_gbps_reverse: Optional[float] = None  # measured b -> a
    copy_latency_us: Optional[float] = None  # small-copy latency a -> b

    @property
    def link_class(self) -> LinkClass:
        return link_class(self.link) if self.link else LinkClass.UNKNOWN

    @property
    def p2p_ok(self) -> Optional[bool]:
        """True when every known P2P indicator says yes, False when any says no, None when none is known."""
        known = [s == "OK" for s in (self.p2p_read, self.p2p_write) if s is not None]
        if self.can_access_peer is not None:
            known.append(self.can_access_peer)
        if not known:
            return None
        return all(known)

    @property
    def measured_gbps(self) -> Optional[float]:
        """The slower measured direction (an exchange waits for its slowest transfer)."""
        vals = [v for v in (self.copy_gbps, self.copy_gbps_reverse) if v is not None]
        return min(vals) if vals else None


@dataclass
class NcclBandwidth:
    """NCCL all_reduce bus bandwidth over ``devices`` (CUDA indices), with P2P allowed and disabled."""

    devices: list = field(default_factory=list)
    nbytes: int = 0
    p2p_allowed_gbps: Optional[float] = None
    p2p_disabled_gbps: Optional[float] = None
    error: Optional[str] = None


@dataclass
class NicInfo:
    """A network adapter of the node (from ``topo -m``): its label, device name and path to each GPU."""

    label: str
    name: str
    links: dict = field(default_factory=dict)  # GPU index -> link kind


@dataclass
class NodeTopology:
    """Everything known about one machine."""

    host: str
    source: str = "live"  # "live" (probed here), "saved" (parsed nvidia-smi text), "remote" (probed on a Ray node)
    gpus: list = field(default_factory=list)  # list[GpuInfo]
    pairs: list = field(default_factory=list)  # list[PairInfo]
    nics: list = field(default_factory=list)  # list[NicInfo]
    nccl: Optional[NcclBandwidth] = None
    driver_version: Optional[str] = None
    cuda_version: Optional[str] = None
    notes: list = field(default_factory=list)

    def pair(self, a: int, b: int) -> Optional[PairInfo]:
        lo, hi = min(a, b), max(a, b)
        for p in self.pairs:
            if p.a == lo and p.b == hi:
                return p
        return None

    def gpu(self, index: int) -> Optional[GpuInfo]:
        for g in self.gpus:
            if g.index == index:
                return g
        return None


@dataclass
class InterNodeLink:
    """The measured link between two nodes (by host name)."""

    a: str
    b: str
    bandwidth_gbps: Optional[float] = None
    latency_us: Optional[float] = None
    method: str = ""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class TopologyReport:
    """The probe's result: one :class:`NodeTopology` per machine, the links between machines, the cluster check.

    Example::

        >>> report = probe_topology()
        >>> d = report.to_dict()          # JSON-ready, d["schema"] == 1 (advice.report_with_advice adds advice)
        >>> print(summary_text(report))
    """

    nodes: list = field(default_factory=list)  # list[NodeTopology]
    inter_node: list = field(default_factory=list)  # list[InterNodeLink]
    cluster: Optional[dict] = None  # the cluster check's dict (python -m patchray probe --ranks N)
    created_utc: str = field(default_factory=_now)
    notes: list = field(default_factory=list)

    # The first node is the machine the probe ran on (or the one the saved text describes).
    @property
    def local(self) -> Optional[NodeTopology]:
        return self.nodes[0] if self.nodes else None

    @property
    def gpus(self) -> list:
        return self.local.gpus if self.local else []

    @property
    def pairs(self) -> list:
        return self.local.pairs if self.local else []

    @property
    def gpu_count(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    def to_dict(self, advice: Sequence = ()) -> dict:
        """JSON-ready dict with the stable schema (``"schema": 1``); every key is always present.

        Args:
            advice: the ``Advice`` items to write under ``"advice"`` (default none). The report holds facts only;
                ``advice.report_with_advice`` derives them and calls this, so this module needs no advice.
        """
        nodes = []
        for node in self.nodes:
            d = asdict(node)
            for g, gd in zip(node.gpus, d["gpus"]):
                gd["pcie_link_gbps"] = _round(g.pcie_link_gbps)
            for p, pd in zip(node.pairs, d["pairs"]):
                pd["link_class"] = p.link_class.value
                pd["nvlinks"] = nvlink_count(p.link or "")
                pd["p2p_ok"] = p.p2p_ok
                for k in ("copy_gbps", "copy_gbps_reverse", "copy_latency_us"):
                    pd[k] = _round(pd[k])
            for nd in d["nics"]:
                nd["links"] = {str(k): v for k, v in nd["links"].items()}  # JSON keys are strings; say so
            if d["nccl"] is None:
                d["nccl"] = asdict(NcclBandwidth())
            nodes.append(d)
        out = {
            "schema": SCHEMA_VERSION,
            "created_utc": self.created_utc,
            "gpu_count": self.gpu_count,
            "notes": list(self.notes),
            "nodes": nodes,
            "inter_node": [asdict(link) for link in self.inter_node],
            "cluster": self.cluster,
            "advice": [a.to_dict() for a in advice],
        }
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "TopologyReport":
        """Rebuild a report from :meth:`to_dict` output (derived keys are recomputed, not read)."""
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"unsupported topology report schema {d.get('schema')!r} (this PatchRay reads {SCHEMA_VERSION})")
        return cls(
            nodes=[node_from_dict(nd) for nd in d["nodes"]],
            inter_node=[_pick(InterNodeLink, x) for x in d["inter_node"]],
            cluster=d.get("cluster"),
            created_utc=d["created_utc"],
            notes=list(d.get("notes", [])),
        )


def _pick(klass, src: dict):
    names = klass.__dataclass_fields__
    return klass(**{k: v for k, v in src.items() if k in names})


def node_from_dict(nd: dict) -> NodeTopology:
    """Rebuild a :class:`NodeTopology` from its dict form (``to_dict()["nodes"][i]`` or ``dataclasses.asdict``)."""
    node = _pick(NodeTopology, nd)
    node.gpus = [_pick(GpuInfo, g) for g in nd.get("gpus", [])]
    node.pairs = [_pick(PairInfo, p) for p in nd.get("pairs", [])]
    node.nics = [_pick(NicInfo, n) for n in nd.get("nics", [])]
    for nic in node.nics:
        nic.links = {int(k): v for k, v in nic.links.items()}
    nccl = nd.get("nccl")
    node.nccl = _pick(NcclBandwidth, nccl) if nccl and nccl.get("devices") else None
    node.notes = list(nd.get("notes", []))
    return node


def _round(x, nd: int = 3):
    return None if x is None else round(float(x), nd)
