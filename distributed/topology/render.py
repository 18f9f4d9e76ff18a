"""What a topology report looks like to a person: a plain-text summary and a GPU x GPU heatmap.

Design decision: rendering is separate from the report's data (:mod:`.report`), so the data model imports
nothing of the advice, and the advice imports nothing of the rendering; the summary shows the advice and the
heatmap colours unmeasured pairs with the advice's own link estimate (:func:`.links.pair_estimate`), so the
picture and the advice agree.
"""

from __future__ import annotations

import math
import os
from typing import Optional

from .advice import advise
from .links import pair_estimate
from .parse import LinkClass
from .report import TopologyReport

__all__ = ["summary_text", "render_heatmap", "heatmap_image"]


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
                # unmeasured: the advice's own estimate, so picture and advice agree
                grid[r][c] = val if val is not None else pair_estimate(node, p).bandwidth_gbps
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
