"""The topology report: one data model, a stable JSON schema, a text summary and a heatmap.

Design decision: the live probe, a saved ``nvidia-smi`` output from someone else's machine and a Ray cluster of
several nodes all produce the *same* :class:`TopologyReport`, so advice, the summary, the heatmap, the ComfyUI
node and the CLI have one input. The JSON form (``schema: 1``) keeps every key present on every report (``null``
where a value was not measured or not available), so consumers never branch on missing keys; a change that
renames or retypes a key bumps ``schema``.

Bandwidths are GB/s (1e9 bytes per second) of payload in one direction; latencies are microseconds.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

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
    "summary_text",
    "render_heatmap",
    "heatmap_image",
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
        >>> d = report.to_dict()          # JSON-ready, d["schema"] == 1
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

    def to_dict(self, include_advice: bool = True) -> dict:
        """JSON-ready dict with the stable schema (``"schema": 1``); every key is always present."""
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
            "advice": [],
        }
        if include_advice:
            from .advice import advise

            out["advice"] = [a.to_dict() for a in advise(self)]
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


# --------------------------------------------------------------------------------------------------
# text summary

_LINK_WORDS = {
    LinkClass.NVLINK: "NVLink",
    LinkClass.PCIE_SWITCH: "PCIe switch, not through the CPU",
    LinkClass.HOST_BRIDGE: "through the CPU's PCIe host bridge",
    LinkClass.NUMA_NODE: "between host bridges of one CPU socket",
    LinkClass.CROSS_SOCKET: "across CPU sockets",
    LinkClass.UNKNOWN: "unknown path",
}


def _fmt_gbps(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.1f} GB/s" if x >= 1 else f"{x * 1000:.0f} MB/s")


def summary_text(report: TopologyReport, advice: Optional[list] = None) -> str:
    """A plain-text summary: GPUs, pairs, NCCL figures, nodes, cluster check and advice.

    Args:
        report (`TopologyReport`): the probe's result.
        advice (`list[Advice]`, *optional*): defaults to ``advise(report)``.
    """
    from .advice import advise

    advice = advise(report) if advice is None else advice
    lines = [f"PatchRay topology probe ({report.created_utc})"]
    for note in report.notes:
        lines.append(f"  {note}")
    for node in report.nodes:
        src = {"live": "probed here", "saved": "from saved nvidia-smi output", "remote": "probed on a Ray node"}
        lines.append("")
        head = f"Node {node.host} ({src.get(node.source, node.source)}): {len(node.gpus)} GPU(s)"
        if node.driver_version:
            head += f", driver {node.driver_version}"
        if node.cuda_version:
            head += f", CUDA {node.cuda_version}"
        lines.append(head)
        for note in node.notes:
            lines.append(f"  note: {note}")
        for g in node.gpus:
            numa = f"NUMA {g.numa_node}" if g.numa_node not in (None, "N/A") else "NUMA -"
            cpus = f"CPUs {g.cpu_affinity}" if g.cpu_affinity else ""
            cuda = f" (cuda:{g.cuda_index})" if g.cuda_index is not None and g.cuda_index != g.index else ""
            lines.append(f"  GPU{g.index}{cuda}  {g.name or '?':<28} {g.pcie_label():<13} {numa:<7} {cpus}".rstrip())
        if node.pairs:
            lines.append("  Pairs:")
        for p in node.pairs:
            words = _LINK_WORDS.get(p.link_class, "")
            p2p = f"P2P read {p.p2p_read or '-'} / write {p.p2p_write or '-'}"
            peer = {True: "peer access yes", False: "peer access no", None: "peer access -"}[p.can_access_peer]
            meas = ""
            if p.copy_gbps is not None:
                meas = f"  copy {_fmt_gbps(p.copy_gbps)} / {_fmt_gbps(p.copy_gbps_reverse)}"
                if p.copy_latency_us is not None:
                    meas += f", {p.copy_latency_us:.0f} us"
            lines.append(f"    GPU{p.a}-GPU{p.b}  {p.link or '?':<5} ({words})  {p2p}  {peer}{meas}")
        if node.nccl is not None:
            n = node.nccl
            if n.error:
                lines.append(f"  NCCL all_reduce: not measured ({n.error})")
            else:
                lines.append(
                    f"  NCCL all_reduce bus bandwidth over GPUs {n.devices}: {_fmt_gbps(n.p2p_allowed_gbps)} with P2P "
                    f"allowed, {_fmt_gbps(n.p2p_disabled_gbps)} with NCCL_P2P_DISABLE=1"
                )
        for nic in node.nics:
            near = sorted(i for i, k in nic.links.items() if k in ("PIX", "PXB"))
            lines.append(f"  NIC {nic.label} ({nic.name})" + (f": next to GPU {near}" if near else ""))
    for link in report.inter_node:
        lat = f", {link.latency_us:.0f} us" if link.latency_us is not None else ""
        lines.append(f"Link {link.a} <-> {link.b}: {_fmt_gbps(link.bandwidth_gbps)}{lat} ({link.method})")
    if report.cluster is not None:
        c = report.cluster
        lines.append("")
        if c.get("error"):
            lines.append(f"Cluster check: FAILED: {c['error']}")
        else:
            ok = "ok" if c.get("all_reduce_ok") and c.get("p2p_ok") else "FAILED"
            lines.append(
                f"Cluster check: {c.get('ready_ranks', c.get('ranks'))}/{c.get('ranks')} ranks ready "
                f"({c.get('backend')}, {c.get('seconds_to_ready')} s); all_reduce "
                f"{'ok' if c.get('all_reduce_ok') else 'WRONG'}, neighbour send/recv {'ok' if c.get('p2p_ok') else 'WRONG'}: {ok}"
            )
            lines.append(f"  devices: {c.get('devices')}")
            for k, v in (c.get("bandwidth_gbps") or {}).items():
                lines.append(f"  rank {k}: {_fmt_gbps(v)}")
    if advice:
        lines.append("")
        lines.append("Advice:")
        for a in advice:
            lines.append(f"  [{a.severity}] {a.title}")
            for env_k, env_v in a.env.items():
                lines.append(f"      export {env_k}={env_v}")
            if a.detail:
                lines.append(f"      {a.detail}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# heatmap

def render_heatmap(report: TopologyReport, path: str) -> str:
    """Draw one GPU x GPU heatmap per node and write it as a PNG.

    Cells are coloured by the measured copy bandwidth (log scale, slower direction) where measured, else by the
    estimate the advice uses (marked ``~``), and annotated with the link kind, the P2P read status and the GB/s.
    Pairs without P2P are hatched. A report with no GPU gives a small image that says so. Uses matplotlib's Agg
    canvas directly, so it never changes the process's pyplot backend (ComfyUI may have its own).

    Args:
        report (`TopologyReport`): the probe's result.
        path (`str`): output file (``.png``); parent folders are created.

    Returns:
        `str`: ``path``.
    """
    fig = _heatmap_figure(report)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def heatmap_image(report: TopologyReport):
    """The heatmap of :func:`render_heatmap` as a ``float32`` numpy array ``[H, W, 3]`` in 0..1.

    For callers that want pixels rather than a file (ComfyUI's IMAGE is ``[B, H, W, C]`` in 0..1: add a batch axis).
    """
    import numpy as np

    fig = _heatmap_figure(report)
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    return rgba[..., :3].astype(np.float32) / 255.0


def _heatmap_figure(report: TopologyReport):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    nodes = [n for n in report.nodes if n.gpus] or []
    if not nodes:
        fig = Figure(figsize=(6, 2.2), dpi=100)
        ax = fig.add_subplot(111)
        ax.axis("off")
        msg = "No NVIDIA GPU found" + (f"\n{report.notes[0]}" if report.notes else "")
        ax.text(0.5, 0.5, msg, ha="center", va="center", fontsize=11, wrap=True)
        FigureCanvasAgg(fig)
        return fig

    sizes = [len(n.gpus) for n in nodes]
    cell = 1.25 if max(sizes) <= 4 else 0.95
    width = sum(max(3.2, s * cell + 2.2) for s in sizes)
    height = max(3.6, max(sizes) * cell + 2.2)
    fig = Figure(figsize=(width, height), dpi=110)
    norm = LogNorm(vmin=1.0, vmax=500.0)
    cmap = "viridis"
    from .advice import _pair_estimate  # the same estimate the advice uses, so picture and advice agree

    im = None
    any_measured = False
    for k, node in enumerate(nodes):
        ax = fig.add_subplot(1, len(nodes), k + 1)
        n = len(node.gpus)
        idx = [g.index for g in node.gpus]
        grid = [[math.nan] * n for _ in range(n)]
        for r, i in enumerate(idx):
            for c, j in enumerate(idx):
                if i == j:
                    continue
                p = node.pair(i, j)
                if p is None:
                    continue
                val = p.measured_gbps
                grid[r][c] = val if val is not None else _pair_estimate(node, p).bandwidth_gbps
        im = ax.imshow(grid, cmap=cmap, norm=norm)
        measured = False
        for r, i in enumerate(idx):
            for c, j in enumerate(idx):
                if i == j:
                    ax.text(c, r, "X", ha="center", va="center", color="0.4", fontsize=9)
                    continue
                p = node.pair(i, j)
                if p is None:
                    continue
                label = p.link or "?"
                if p.p2p_read or p.can_access_peer is not None:
                    label += "\n" + (p.p2p_read or ("peer" if p.can_access_peer else "no peer"))
                val = grid[r][c]
                if p.measured_gbps is not None:
                    measured = True
                if val is not None and not math.isnan(val):
                    approx = "" if p.measured_gbps is not None else "~"
                    label += f"\n{approx}{val:.0f} GB/s" if val >= 10 else f"\n{approx}{val:.1f} GB/s"
                light = val is not None and not math.isnan(val) and norm(val) > 0.6
                ax.text(c, r, label, ha="center", va="center", fontsize=8 if n <= 4 else 6.5,
                        color="black" if light else "white")
                if p.p2p_ok is False:
                    ax.add_patch(_hatch(c, r))
        names = [f"GPU{g.index}\n{_short(g.name)}\n{g.pcie_label()}" for g in node.gpus]
        ax.set_xticks(range(n), labels=[f"GPU{i}" for i in idx], fontsize=8)
        ax.set_yticks(range(n), labels=names, fontsize=7)
        basis = "measured copy bandwidth" if measured else "~ estimated from path, P2P and PCIe (not measured)"
        title = f"{node.host}: {n} GPU(s)\n{basis}; hatched = no P2P"
        if node.nccl is not None and not node.nccl.error and node.nccl.p2p_allowed_gbps is not None:
            title += (f"\nNCCL all_reduce bus bw: {node.nccl.p2p_allowed_gbps:.1f} GB/s P2P allowed, "
                      f"{node.nccl.p2p_disabled_gbps or 0:.1f} GB/s NCCL_P2P_DISABLE=1")
        ax.set_title(title, fontsize=9)
        any_measured = any_measured or measured
    if report.inter_node:
        links = "; ".join(f"{x.a} <-> {x.b}: {_fmt_gbps(x.bandwidth_gbps)}" for x in report.inter_node)
        fig.suptitle(f"between nodes: {links}", fontsize=9)
    if im is not None:
        cb = fig.colorbar(im, ax=fig.axes, shrink=0.8, pad=0.02)
        cb.set_label("GB/s between the pair, slower direction (log scale)", fontsize=8)
    FigureCanvasAgg(fig)
    return fig


def _hatch(c: int, r: int):
    from matplotlib.patches import Rectangle

    return Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="//", edgecolor="0.85", linewidth=0, alpha=0.5)


def _short(name: Optional[str]) -> str:
    if not name:
        return "?"
    for prefix in ("NVIDIA GeForce ", "NVIDIA ", "GeForce "):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name[:18]
