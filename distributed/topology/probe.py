"""Live topology probe: what this machine's GPUs are, how they are connected, and how fast that really is.

Design decisions:

* **Every source is optional and says why it is missing.** ``nvidia-smi`` (link kinds, NICs, CPU/NUMA affinity,
  exactly what users paste in issues), NVML through nvidia-ml-py (imported lazily; P2P status, PCIe
  generation/width, NVLink), PyTorch (peer access, copies) and NCCL (bus bandwidth) each add what they can; a
  machine with none of them gets a report that says so in plain words instead of an exception.
* **One assembly path.** :func:`build_node` turns parsed ``nvidia-smi`` text and NVML data into a
  :class:`NodeTopology`; the live probe and :func:`report_from_saved` (someone else's saved output) both use it,
  so the CLI's ``--topo-file`` mode and the live probe cannot drift apart.
* **GPU identity is the PCI bus id.** ``nvidia-smi``/NVML number GPUs in PCI order, CUDA by default "fastest
  first" and after ``CUDA_VISIBLE_DEVICES``; pairs are reported with nvidia-smi indices and each GPU carries its
  ``cuda_index``, matched by bus id, never by position.
* **Auto modes probe once per cluster.** :func:`cached_probe` keeps one report per cluster key, so ComfyUI's
  auto decode/sampling modes do not re-measure on every prompt.
* **NCCL runs in fresh processes** (``nccl_worker.py``, driven by :mod:`.measure`), once with P2P allowed and
  once with ``NCCL_P2P_DISABLE=1``, because NCCL reads its environment once per process.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import threading
from typing import Callable, Hashable, Optional, Sequence

from .measure import measure_allreduce, measure_copy, measure_nccl, measure_pairs
from .parse import GpuListing, TopoMatrix, parse_gpu_listing, parse_p2p_matrix, parse_saved_outputs, parse_topo_matrix
from .report import GpuInfo, NicInfo, NodeTopology, PairInfo, TopologyReport

__all__ = [
    "probe_topology",
    "cached_probe",
    "clear_probe_cache",
    "build_node",
    "report_from_saved",
    "measure_allreduce",
    "measure_copy",
    "node_probe_on_rank",
]

log = logging.getLogger(__name__)

_QUERY_FIELDS = "index,name,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,memory.total"
_NVML_P2P_NAMES = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DR", 5: "NS", 6: "U"}
_NVML_TOPO_NAMES = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


# --------------------------------------------------------------------------------------------------
# assembly (shared by the live probe and saved text)


def _bus_key(bus_id: Optional[str]):
    """``"00000000:18:00.0"`` -> ``(0, 0x18, 0)``: comparable across nvidia-smi, NVML and PyTorch spellings."""
    if not bus_id:
        return None
    try:
        dom_bus, _, dev_fn = bus_id.strip().lower().rpartition(":")
        dom, _, bus = dom_bus.rpartition(":")
        dev = dev_fn.split(".")[0]
        return (int(dom or "0", 16), int(bus, 16), int(dev, 16))
    except ValueError:
        return None


def build_node(
    host: str,
    source: str,
    *,
    topo: Optional[TopoMatrix] = None,
    p2p: Optional[dict] = None,
    listing: Sequence[GpuListing] = (),
    nvml: Optional[dict] = None,
) -> NodeTopology:
    """Assemble a :class:`NodeTopology` from whatever is known (any argument may be missing).

    Args:
        host (`str`): the node's name.
        source (`str`): ``"live"``, ``"saved"`` or ``"remote"``.
        topo (`TopoMatrix`, *optional*): parsed ``nvidia-smi topo -m``.
        p2p (`dict`, *optional*): ``{"r": {(i, j): status}, "w": {...}}`` from ``nvidia-smi topo -p2p``.
        listing (`list[GpuListing]`): parsed ``nvidia-smi -L`` / ``--query-gpu`` output.
        nvml (`dict`, *optional*): from the NVML probe: ``gpus`` (list of GpuInfo), ``links``, ``p2p``, versions.
    """
    p2p = dict(p2p or {})
    nvml = nvml or {}
    gpus: dict = {}
    for g in nvml.get("gpus", []):
        gpus[g.index] = g
    for g in listing:
        cur = gpus.setdefault(g.index, GpuInfo(index=g.index))
        for k in ("name", "pci_bus_id", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max"):
            v = getattr(g, k)
            if v is not None and getattr(cur, k) is None:
                setattr(cur, k, v)
    if topo is not None:
        for label in topo.gpus:
            i = int(label[3:])
            cur = gpus.setdefault(i, GpuInfo(index=i))
            cur.cpu_affinity = cur.cpu_affinity or topo.cpu_affinity.get(i)
            cur.numa_node = cur.numa_node or topo.numa_affinity.get(i)
    links = dict(nvml.get("links", {}))
    if topo is not None:
        links.update(topo.links)  # nvidia-smi's own words win over our NVML reconstruction
    for cap, matrix in (nvml.get("p2p") or {}).items():
        p2p.setdefault(cap, matrix)
    idx = sorted(gpus)
    pairs = [
        PairInfo(a=a, b=b, link=links.get((a, b)) or links.get((b, a)),
                 p2p_read=_sym(p2p.get("r"), a, b), p2p_write=_sym(p2p.get("w"), a, b))
        for n, a in enumerate(idx) for b in idx[n + 1 :]
    ]
    nics = []
    if topo is not None:
        for label in topo.nics:
            nics.append(NicInfo(label, topo.nic_names.get(label, label),
                                {i: k for (i, lab), k in topo.gpu_nic_links.items() if lab == label}))
    return NodeTopology(
        host=host, source=source, gpus=[gpus[i] for i in idx], pairs=pairs, nics=nics,
        driver_version=nvml.get("driver_version"), cuda_version=nvml.get("cuda_version"),
    )


def _sym(matrix: Optional[dict], a: int, b: int) -> Optional[str]:
    """Status of the pair; when the two directions differ, the worse one (anything but OK)."""
    if not matrix:
        return None
    ab, ba = matrix.get((a, b)), matrix.get((b, a))
    if ab is None or ba is None:
        return ab or ba
    return ab if ab != "OK" else ba


def report_from_saved(
    topo_text: Optional[str] = None,
    p2p_texts: Sequence[str] = (),
    gpu_text: Optional[str] = None,
    host: str = "saved",
) -> TopologyReport:
    """Build a report from ``nvidia-smi`` output saved on another machine (no GPU needed here).

    Args:
        topo_text (`str`): ``nvidia-smi topo -m`` output (may also contain the other outputs pasted together).
        p2p_texts (`list[str]`): ``nvidia-smi topo -p2p r`` then ``... w`` outputs (unlabelled ones in that order).
        gpu_text (`str`, *optional*): ``nvidia-smi -L`` or
            ``nvidia-smi --query-gpu=index,name,pcie.link.gen.max,pcie.link.width.current --format=csv``.
        host (`str`): a name for the machine in the report.

    Raises:
        ValueError: when no ``topo -m`` matrix, P2P matrix or GPU listing is found in any text.
    """
    texts = [t for t in (topo_text, *p2p_texts, gpu_text) if t]
    saved = parse_saved_outputs(*texts)
    if saved.topo is None and not saved.p2p and not saved.gpus:
        raise ValueError(
            "found no nvidia-smi output in the given text: expected 'nvidia-smi topo -m', "
            "'nvidia-smi topo -p2p r' or 'nvidia-smi -L' output"
        )
    node = build_node(host, "saved", topo=saved.topo, p2p=saved.p2p, listing=saved.gpus)
    if saved.topo is None:
        node.notes.append("no 'nvidia-smi topo -m' matrix given: link kinds unknown")
    return TopologyReport(nodes=[node])


# --------------------------------------------------------------------------------------------------
# sources on this machine


def _run(cmd: list, timeout: float = 30.0) -> tuple:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{' '.join(cmd)}: {exc}"
    if r.returncode != 0:
        return None, f"{' '.join(cmd)} exited with {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"
    return r.stdout, None


def _smi_sources(notes: list) -> dict:
    """Parsed nvidia-smi outputs (``{}`` when nvidia-smi is not installed or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        notes.append("nvidia-smi is not installed (no NVIDIA driver on this machine?)")
        return {}
    out: dict = {}
    text, err = _run([exe, "topo", "-m"])
    if err:
        notes.append(err)
    else:
        try:
            out["topo"] = parse_topo_matrix(text)
        except ValueError as exc:
            notes.append(f"could not read 'nvidia-smi topo -m': {exc}")
    p2p = {}
    for cap in ("r", "w"):
        text, err = _run([exe, "topo", "-p2p", cap])
        if err:
            notes.append(err)
            continue
        try:
            p2p[cap] = parse_p2p_matrix(text)
        except ValueError as exc:
            notes.append(f"could not read 'nvidia-smi topo -p2p {cap}': {exc}")
    out["p2p"] = p2p
    text, err = _run([exe, f"--query-gpu={_QUERY_FIELDS}", "--format=csv"])
    if err:
        notes.append(err)
    else:
        out["listing"] = parse_gpu_listing(text)
    return out


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _sysfs(bus_id: str, name: str) -> Optional[str]:
    """``/sys/bus/pci/devices/<bus>/<name>`` (Linux), e.g. ``numa_node`` or ``local_cpulist``."""
    key = _bus_key(bus_id)
    if key is None:
        return None
    path = f"/sys/bus/pci/devices/{key[0]:04x}:{key[1]:02x}:{key[2]:02x}.0/{name}"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _nvml_sources(notes: list) -> dict:
    """GPU, PCIe, NVLink and P2P facts from NVML (``{}`` with a note when NVML is unavailable)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        notes.append("nvidia-ml-py is not installed (pip install nvidia-ml-py): NVML details skipped")
        return {}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        notes.append(f"NVML is not available ({exc}): no NVIDIA driver loaded on this machine")
        return {}
    try:
        return _nvml_collect(pynvml, notes)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_collect(nv, notes: list) -> dict:
    def opt(fn, *a):
        try:
            return fn(*a)
        except Exception:
            return None

    out: dict = {"driver_version": opt(lambda: _text(nv.nvmlSystemGetDriverVersion()))}
    cv = opt(nv.nvmlSystemGetCudaDriverVersion_v2) or opt(nv.nvmlSystemGetCudaDriverVersion)
    out["cuda_version"] = f"{cv // 1000}.{(cv % 1000) // 10}" if cv else None
    count = nv.nvmlDeviceGetCount()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus, bus_to_index = [], {}
    for i, h in enumerate(handles):
        pci = opt(nv.nvmlDeviceGetPciInfo, h)
        bus = _text(pci.busId) if pci is not None else None
        mem = opt(nv.nvmlDeviceGetMemoryInfo, h)
        g = GpuInfo(
            index=i,
            name=opt(lambda: _text(nv.nvmlDeviceGetName(h))),
            pci_bus_id=bus,
            pcie_gen=opt(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_gen_max=opt(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
            pcie_width=opt(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            pcie_width_max=opt(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            memory_mib=int(mem.total) >> 20 if mem is not None else None,
        )
        if bus:
            g.numa_node = _sysfs(bus, "numa_node")
            if g.numa_node == "-1":
                g.numa_node = "N/A"
            g.cpu_affinity = _sysfs(bus, "local_cpulist")
            bus_to_index[_bus_key(bus)] = i
        gpus.append(g)
    out["gpus"] = gpus
    # NVLink: count active links to each peer GPU, or to NVSwitches (then every GPU pair with switch links is NV#)
    max_links = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
    to_gpu = [dict() for _ in handles]
    to_switch = [0] * count
    for i, h in enumerate(handles):
        for link in range(max_links):
            if not opt(nv.nvmlDeviceGetNvLinkState, h, link):
                continue
            kind = opt(nv.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            if kind == 2:  # NVML_NVLINK_DEVICE_TYPE_SWITCH
                to_switch[i] += 1
                continue
            remote = opt(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            j = bus_to_index.get(_bus_key(_text(remote.busId))) if remote is not None else None
            if j is not None:
                to_gpu[i][j] = to_gpu[i].get(j, 0) + 1
    links, p2p_r, p2p_w = {}, {}, {}
    # nvmlGpuP2PCapsIndex_t: READ = 0, WRITE = 1. Not read from pynvml: some nvidia-ml-py releases define
    # NVML_P2P_CAPS_INDEX_READ as the tuple (0,) (a stray comma), which NVML then rejects.
    read_cap, write_cap = 0, 1
    for i in range(count):
        for j in range(count):
            if i == j:
                continue
            if to_gpu[i].get(j):
                links[(i, j)] = f"NV{to_gpu[i][j]}"
            elif to_switch[i] and to_switch[j]:
                links[(i, j)] = f"NV{min(to_switch[i], to_switch[j])}"
            else:
                lvl = opt(nv.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
                if lvl is not None:
                    links[(i, j)] = _NVML_TOPO_NAMES.get(int(lvl), "SYS")
            r = opt(nv.nvmlDeviceGetP2PStatus, handles[i], handles[j], read_cap)
            w = opt(nv.nvmlDeviceGetP2PStatus, handles[i], handles[j], write_cap)
            if r is not None:
                p2p_r[(i, j)] = _NVML_P2P_NAMES.get(int(r), "U")
            if w is not None:
                p2p_w[(i, j)] = _NVML_P2P_NAMES.get(int(w), "U")
    out["links"] = links
    out["p2p"] = {k: v for k, v in (("r", p2p_r), ("w", p2p_w)) if v}
    return out


def _torch_cuda(notes: list) -> list:
    """``[(cuda_index, name, bus_id_or_None)]`` for the GPUs PyTorch sees ([] with a note when none)."""
    try:
        import torch
    except ImportError:
        notes.append("PyTorch is not installed")
        return []
    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build, no usable GPU"
        notes.append(f"PyTorch {torch.__version__} sees no CUDA GPU ({build})")
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = None
        if getattr(p, "pci_bus_id", None) is not None:
            bus = f"{getattr(p, 'pci_domain_id', 0):08x}:{p.pci_bus_id:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
        out.append((i, p.name, bus))
    return out


# --------------------------------------------------------------------------------------------------
# the probe


def probe_topology(devices: Optional[Sequence[int]] = None, measure: bool = True, *, nccl: bool = True,
                   copy_bytes: int = 64 << 20, nccl_bytes: int = 64 << 20) -> TopologyReport:
    """Probe this machine's GPUs: link kinds, P2P status, PCIe, peer access and (``measure``) real bandwidths.

    Works everywhere: with no GPU (or no driver, or no nvidia-ml-py) the report says so in ``notes`` and has no
    GPUs; with one GPU there are no pairs to measure.

    Args:
        devices (`list[int]`, *optional*): CUDA indices to measure (default: all PyTorch sees). Topology and P2P
            status are reported for every GPU of the machine regardless.
        measure (`bool`): measure peer access, copy bandwidth/latency per pair and NCCL all_reduce bus bandwidth
            with P2P allowed and disabled (seconds to a minute); ``False`` reports static facts only.
        nccl (`bool`): include the NCCL measurement when ``measure``.

    Returns:
        `TopologyReport` with one node (this machine).

    Example::

        >>> report = probe_topology()
        >>> print(summary_text(report))
    """
    notes: list = []
    host = socket.gethostname()
    smi = _smi_sources(notes)
    nvml = _nvml_sources(notes)
    node = build_node(host, "live", topo=smi.get("topo"), p2p=smi.get("p2p"), listing=smi.get("listing", ()), nvml=nvml)
    cuda = _torch_cuda(notes)
    for note in notes:
        log.debug("topology probe: %s", note)
    # match CUDA indices to nvidia-smi indices by PCI bus id; positional only when ids are unknown and counts agree
    by_bus = {_bus_key(g.pci_bus_id): g for g in node.gpus if g.pci_bus_id}
    for ci, name, bus in cuda:
        g = by_bus.get(_bus_key(bus)) if bus else None
        if g is None and not by_bus and len(cuda) == len(node.gpus) and "CUDA_VISIBLE_DEVICES" not in os.environ:
            g = node.gpu(ci)
        if g is None and not node.gpus:
            g = GpuInfo(index=ci, name=name)
            node.gpus.append(g)
        if g is not None:
            g.cuda_index = ci
            g.name = g.name or name
    known = {(p.a, p.b) for p in node.pairs}
    node.pairs += [PairInfo(a=a.index, b=b.index) for n, a in enumerate(node.gpus) for b in node.gpus[n + 1 :]
                   if (a.index, b.index) not in known]  # GPUs only PyTorch saw (no nvidia-smi, no NVML)
    report = TopologyReport(nodes=[node])
    if not node.gpus:
        report.notes.append("No NVIDIA GPU found on this machine. " + " ".join(n.rstrip(".") + "." for n in notes))
        return report
    node.notes.extend(notes)
    if len(node.gpus) == 1:
        report.notes.append("One GPU: no GPU pairs to measure.")
    if not measure or len(cuda) < 2:
        if measure and len(node.gpus) >= 2:
            node.notes.append("not measured: PyTorch sees fewer than two CUDA GPUs in this process")
        return report
    measure_pairs(node, devices, copy_bytes)
    if nccl:
        measure_nccl(node, devices, nccl_bytes)
    return report


# --------------------------------------------------------------------------------------------------
# several nodes (a Ray cluster): run on one rank per host through the lead's RankCluster.run


def node_probe_on_rank(ctx, first_rank_by_host: dict) -> Optional[dict]:
    """Rank function for ``RankCluster.run``: the first rank of each host probes its node (static facts only).

    A rank's process sees only its own GPU through CUDA, but NVML and nvidia-smi see the whole node, so link
    kinds, P2P status and PCIe are complete; bandwidth between nodes comes from the cluster check. Returns the
    node as a plain dict (``None`` on the other ranks), so it unpickles in a driver that loaded the pack under
    another module name.
    """
    from dataclasses import asdict

    if first_rank_by_host.get(socket.gethostname()) != ctx.rank:
        return None
    node = probe_topology(measure=False).local
    node.source = "remote"
    return asdict(node)


node_probe_on_rank.patchray_task = "probing the GPUs"


# --------------------------------------------------------------------------------------------------
# cache for the auto modes

_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def cached_probe(key: Hashable, probe: Optional[Callable[[], TopologyReport]] = None, *, refresh: bool = False,
                 **probe_kwargs) -> TopologyReport:
    """The topology report for a cluster, probed once per ``key`` and process.

    Args:
        key: identifies the cluster, e.g. ``(address, tuple(devices))``; the lead's cluster passes its config.
        probe (`callable`, *optional*): builds the report; default ``probe_topology(**probe_kwargs)``.
        refresh (`bool`): probe again even if cached (after the hardware or driver changed).

    Example::

        >>> report = cached_probe(("embedded", (0, 1)), devices=[0, 1])
        >>> choose_decode_mode(report).mode
    """
    with _CACHE_LOCK:
        if not refresh and key in _CACHE:
            return _CACHE[key]
    report = probe_topology(**probe_kwargs) if probe is None else probe()
    with _CACHE_LOCK:
        _CACHE[key] = report
    return report


def clear_probe_cache() -> None:
    """Forget every cached report."""
    with _CACHE_LOCK:
        _CACHE.clear()
