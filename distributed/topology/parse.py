"""Parsers for the text that ``nvidia-smi`` prints about GPU topology.

Design decision: the probe's analysis works on *text a user can save and share*, not only on a live driver.
People asking for help with a multi-GPU rig paste ``nvidia-smi topo -m`` and ``nvidia-smi topo -p2p r`` into
issues; PatchRay must read exactly that, so every parser here is tolerant of the ways such text gets mangled
on the way: tabs turned into spaces by a terminal, the ANSI underline nvidia-smi puts on the header row,
trailing tabs, a shell prompt or a command line above the matrix, several outputs pasted into one file,
older drivers (``SOC`` instead of ``SYS``, NICs named ``mlx4_0`` in the header instead of ``NIC0``) and
the extra ``GPU NUMA ID`` column of recent drivers. Nothing here imports torch or NVML.

Formats (as printed by recent drivers; columns are tab-separated, the self cell is ``" X "``)::

    \tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
    GPU0\t X \tNV18\tPIX\t0-79\t0\t\tN/A
    ...
    Legend:
      X    = Self
      SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
      ...
    NIC Legend:
      NIC0: mlx5_0

and for ``nvidia-smi topo -p2p r`` (``r`` read, ``w`` write, ``n`` NVLink, ``a`` atomics, ``p`` PCIe)::

     \tGPU0\tGPU1\t
     GPU0\tX\tOK\t
     GPU1\tOK\tX\t
"""

from __future__ import annotations

import csv
import io
import re
from enum import Enum
from typing import NamedTuple

__all__ = [
    "LinkClass",
    "P2P_STATUS_MEANING",
    "TopoMatrix",
    "GpuListing",
    "SavedOutputs",
    "link_class",
    "nvlink_count",
    "parse_topo_matrix",
    "parse_p2p_matrix",
    "parse_p2p_matrices",
    "parse_gpu_listing",
    "parse_saved_outputs",
    "strip_ansi",
    "pcie_path_rank",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TRAILING_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_NIC_LABEL = re.compile(r"^NIC(\d+)$")
_NIC_LEGEND_LINE = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_P2P_CAP_LINE = re.compile(r"topo\s+(?:-p2p|--p2pstatus)\s+([rwnap])\b")
# Order used by every comparison in PatchRay ("how far apart are two GPUs"), best first.
_PCIE_PATH_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")

#: What each ``nvidia-smi topo -p2p`` status means, in the words of nvidia-smi's own legend.
P2P_STATUS_MEANING = {
    "X": "Self",
    "OK": "Status Ok",
    "CNS": "Chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "Topology not supported",
    "NS": "Not supported",
    "DR": "Disabled by regkey",
    "U": "Unknown",
}


class LinkClass(str, Enum):
    """What kind of path joins two devices, ordered from fastest to slowest (``rank``)."""

    SELF = "self"
    NVLINK = "nvlink"
    PCIE_SWITCH = "pcie_switch"  # PIX / PXB: through PCIe switches, never through the CPU
    HOST_BRIDGE = "host_bridge"  # PHB: through the CPU's PCIe host bridge (consumer boards)
    NUMA_NODE = "numa_node"  # NODE: between host bridges of one CPU socket
    CROSS_SOCKET = "cross_socket"  # SYS (SOC on old drivers): across the inter-socket link (QPI/UPI/xGMI)
    UNKNOWN = "unknown"

    @property
    def rank(self) -> int:
        return _LINK_CLASS_RANK[self]


_LINK_CLASS_RANK = {
    LinkClass.SELF: 0,
    LinkClass.NVLINK: 1,
    LinkClass.PCIE_SWITCH: 2,
    LinkClass.HOST_BRIDGE: 3,
    LinkClass.NUMA_NODE: 4,
    LinkClass.CROSS_SOCKET: 5,
    LinkClass.UNKNOWN: 6,
}


def link_class(kind: str) -> LinkClass:
    """Map an ``nvidia-smi topo -m`` cell (``NV12``, ``PIX``, ``SYS``, ``X``...) to a :class:`LinkClass`."""
    k = kind.strip().upper()
    if k == "X":
        return LinkClass.SELF
    if k.startswith("NV"):
        return LinkClass.NVLINK
    if k in ("PIX", "PXB", "PSB"):  # PSB: "single PCIe switch" on some old drivers
        return LinkClass.PCIE_SWITCH
    if k == "PHB":
        return LinkClass.HOST_BRIDGE
    if k == "NODE":
        return LinkClass.NUMA_NODE
    if k in ("SYS", "SOC"):
        return LinkClass.CROSS_SOCKET
    return LinkClass.UNKNOWN


def nvlink_count(kind: str) -> int:
    """Number of bonded NVLinks in a cell such as ``NV12`` (0 for anything that is not NVLink)."""
    m = re.fullmatch(r"NV(\d+)", kind.strip().upper())
    return int(m.group(1)) if m else 0


def strip_ansi(text: str) -> str:
    """Remove terminal escapes (nvidia-smi underlines the header row when writing to a terminal)."""
    return _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")


class TopoMatrix(NamedTuple):
    """The parsed ``nvidia-smi topo -m`` matrix.

    Attributes:
        gpus (`list[str]`): GPU labels in column order (``["GPU0", "GPU1", ...]``).
        links (`dict[tuple[int, int], str]`): link kind per ordered GPU pair ``(i, j)``, ``i != j``, by GPU
            index (``"NV12"``, ``"PIX"``, ``"PXB"``, ``"PHB"``, ``"NODE"``, ``"SYS"``...).
        cpu_affinity (`dict[int, str]`): CPU list per GPU index (``"0-47,96-143"``), where printed.
        numa_affinity (`dict[int, str]`): NUMA node per GPU index (``"0"``; ``"N/A"`` on single-node hosts).
        gpu_numa_id (`dict[int, str]`): the ``GPU NUMA ID`` column of recent drivers (``"N/A"`` on most).
        nics (`list[str]`): NIC labels in column order (``["NIC0", ...]`` or, on old drivers, ``["mlx4_0"]``).
        nic_names (`dict[str, str]`): NIC label -> device name from the ``NIC Legend`` (``{"NIC0": "mlx5_0"}``).
        gpu_nic_links (`dict[tuple[int, str], str]`): link kind between GPU index and NIC label.
    """

    gpus: list
    links: dict
    cpu_affinity: dict
    numa_affinity: dict
    gpu_numa_id: dict
    nics: list
    nic_names: dict
    gpu_nic_links: dict

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def link(self, i: int, j: int) -> str:
        """Link kind between GPU ``i`` and GPU ``j`` (``"X"`` for ``i == j``)."""
        return "X" if i == j else self.links[(i, j)]


def _gpu_index(label: str) -> int | None:
    m = _GPU_LABEL.match(label)
    return int(m.group(1)) if m else None


def _topo_header_candidates(lines: list[str]) -> list[int]:
    """Rows that look like a matrix header: first token GPU0 and not a data row (whose next token is X)."""
    out = []
    for n, line in enumerate(lines):
        tokens = line.split()
        if tokens and tokens[0] == "GPU0" and (len(tokens) == 1 or tokens[1] != "X"):
            out.append(n)
    return out


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the output of ``nvidia-smi topo -m`` (or ``-mp``).

    Args:
        text (`str`): the command's output, possibly with other text around it (a prompt, other commands'
            output, the Legend block), tabs or spaces as column separators, ANSI escapes.

    Returns:
        `TopoMatrix`: GPU labels, the link kind per GPU pair, CPU/NUMA affinity per GPU and the NICs.

    Raises:
        ValueError: when no matrix is found or a row is inconsistent with the header (the message names it).

    Example::

        >>> m = parse_topo_matrix(open("topo.txt").read())
        >>> m.link(0, 1)
        'NV18'
    """
    lines = strip_ansi(text).split("\n")
    problems = []
    for h in _topo_header_candidates(lines):
        try:
            return _parse_topo_at(lines, h)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(problems[0])
    raise ValueError(
        "no 'nvidia-smi topo -m' matrix found: expected a header row starting with GPU0 "
        "(save the output with: nvidia-smi topo -m > topo.txt)"
    )


def _parse_topo_at(lines: list[str], h: int) -> TopoMatrix:
    header = lines[h]
    # Split the header into device labels and the trailing multi-word columns ("CPU Affinity"...).
    cut = len(header)
    for name in _TRAILING_COLUMNS:
        pos = header.find(name)
        if pos >= 0:
            cut = min(cut, pos)
    devices = header[:cut].split()
    trailing = [name for name in _TRAILING_COLUMNS if name in header[cut:]]
    trailing.sort(key=header.find)
    if len(set(devices)) != len(devices):
        raise ValueError(f"topo matrix header repeats a device label: {devices}")
    gpu_cols = [(c, d) for c, d in enumerate(devices) if _gpu_index(d) is not None]
    nic_labels = [d for d in devices if _gpu_index(d) is None]
    gpus = [d for _, d in gpu_cols]

    rows: dict[str, list[str]] = {}
    for line in lines[h + 1 :]:
        tokens = line.split()
        if not tokens:
            if rows:
                break  # the blank line before "Legend:" ends the matrix
            continue
        label = tokens[0]
        if label not in devices:
            break
        cells = tokens[1 : 1 + len(devices)]
        if len(cells) != len(devices):
            raise ValueError(
                f"topo matrix row {label!r} has {len(cells)} link cells, the header names {len(devices)} devices"
            )
        rows[label] = tokens[1:]

    links: dict = {}
    cpu_aff: dict = {}
    numa_aff: dict = {}
    gpu_numa: dict = {}
    gpu_nic: dict = {}
    for label in gpus:
        if label not in rows:
            raise ValueError(f"topo matrix has no row for {label} (header: {' '.join(devices)})")
        i = _gpu_index(label)
        row = rows[label]
        for c, other in enumerate(devices):
            cell = row[c]
            j = _gpu_index(other)
            if j is None:
                gpu_nic[(i, other)] = cell
            elif j != i:
                if cell.upper() in P2P_STATUS_MEANING:
                    raise ValueError(
                        f"this is a 'nvidia-smi topo -p2p' matrix ({label}->{other} is {cell!r}), not 'topo -m'"
                    )
                links[(i, j)] = cell
            elif cell != "X":
                raise ValueError(f"topo matrix: the diagonal cell of {label} is {cell!r}, expected 'X'")
        extra = row[len(devices) :]
        for name, value in zip(trailing, extra):
            {"CPU Affinity": cpu_aff, "NUMA Affinity": numa_aff, "GPU NUMA ID": gpu_numa}[name][i] = value

    if not trailing and not nic_labels and not links:
        # One GPU and nothing but GPU columns: indistinguishable from a one-GPU 'topo -p2p' matrix.
        raise ValueError("a one-GPU matrix without the 'CPU Affinity' column is not a 'topo -m' matrix")
    nic_names: dict = {}
    for line in lines[h + 1 :]:
        m = _NIC_LEGEND_LINE.match(line)
        if m:
            nic_names[m.group(1)] = m.group(2)
    for label in nic_labels:
        nic_names.setdefault(label, label)  # old drivers name the NIC column by its device (mlx4_0)
    return TopoMatrix(gpus, links, cpu_aff, numa_aff, gpu_numa, nic_labels, nic_names, gpu_nic)


def parse_p2p_matrices(text: str) -> dict:
    """Parse every ``nvidia-smi topo -p2p`` matrix in ``text``.

    The capability of each matrix (``r``, ``w``, ``n``, ``a``, ``p``) is taken from the command line above it
    (``$ nvidia-smi topo -p2p w``) or a ``P2P Read``/``P2P Write`` caption; a matrix without either is
    reported under ``"?"`` (the caller decides what it stands for; the CLI treats it as read).

    Args:
        text (`str`): saved output of one or several ``nvidia-smi topo -p2p X`` commands.

    Returns:
        `dict[str, dict[tuple[int, int], str]]`: capability letter -> the matrix as in :func:`parse_p2p_matrix`.
    """
    lines = strip_ansi(text).split("\n")
    out: dict = {}
    cap = "?"
    n = 0
    while n < len(lines):
        line = lines[n]
        m = _P2P_CAP_LINE.search(line)
        if m:
            cap = m.group(1)
        elif re.search(r"p2p\s+read", line, re.I):
            cap = "r"
        elif re.search(r"p2p\s+write", line, re.I):
            cap = "w"
        tokens = line.split()
        if tokens and all(_gpu_index(t) is not None for t in tokens) and tokens[0] == "GPU0":
            labels = tokens
            matrix: dict = {}
            k = n + 1
            while k < len(lines):
                row = lines[k].split()
                if not row or row[0] not in labels:
                    break
                i = _gpu_index(row[0])
                cells = row[1:]
                if len(cells) != len(labels):
                    raise ValueError(
                        f"p2p matrix row {row[0]!r} has {len(cells)} cells, the header names {len(labels)} GPUs"
                    )
                for c, status in enumerate(cells):
                    j = _gpu_index(labels[c])
                    if j != i:
                        matrix[(i, j)] = status.upper()
                k += 1
            if matrix or len(labels) == 1:
                key = cap
                while key in out:  # two unlabelled matrices: keep both
                    key += "?"
                out[key] = matrix
                cap = "?"
            n = k
            continue
        n += 1
    return out


def parse_p2p_matrix(text: str) -> dict:
    """Parse the output of ``nvidia-smi topo -p2p r`` (or ``w``, ``n``, ``a``, ``p``).

    Args:
        text (`str`): the command's output (Legend block and surrounding text are ignored).

    Returns:
        `dict[tuple[int, int], str]`: status per ordered GPU pair ``(i, j)``, ``i != j``: ``"OK"``, ``"NS"``,
        ``"CNS"``, ``"GNS"``, ``"TNS"``, ``"DR"`` or ``"U"`` (see :data:`P2P_STATUS_MEANING`). One GPU gives ``{}``.

    Raises:
        ValueError: when the text holds no P2P matrix.

    Example::

        >>> parse_p2p_matrix(" \\tGPU0\\tGPU1\\t\\n GPU0\\tX\\tCNS\\t\\n GPU1\\tCNS\\tX\\t\\n")
        {(0, 1): 'CNS', (1, 0): 'CNS'}
    """
    found = parse_p2p_matrices(text)
    if not found:
        raise ValueError(
            "no 'nvidia-smi topo -p2p' matrix found: expected a header row 'GPU0 GPU1 ...' followed by rows "
            "(save it with: nvidia-smi topo -p2p r > p2p_read.txt)"
        )
    return next(iter(found.values()))


class GpuListing(NamedTuple):
    """One GPU as listed by ``nvidia-smi -L`` or ``nvidia-smi --query-gpu=... --format=csv``."""

    index: int
    name: str
    pci_bus_id: str | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None


_L_LINE = re.compile(r"^\s*GPU\s+(\d+)\s*:\s*(.+?)\s*(?:\(UUID:[^)]*\))?\s*$")
_CSV_FIELDS = {
    "index": "index",
    "name": "name",
    "pci.bus_id": "pci_bus_id",
    "pcie.link.gen.current": "pcie_gen",
    "pcie.link.gen.gpucurrent": "pcie_gen",
    "pcie.link.gen.max": "pcie_gen_max",
    "pcie.link.gen.hostmax": "pcie_gen_max",
    "pcie.link.width.current": "pcie_width",
    "pcie.link.width.max": "pcie_width_max",
}


def _int_or_none(value: str) -> int | None:
    try:
        return int(value.strip())
    except (ValueError, AttributeError):
        return None


def parse_gpu_listing(text: str) -> list:
    """Parse ``nvidia-smi -L`` lines and/or ``nvidia-smi --query-gpu=index,name,... --format=csv`` output.

    The CSV header names the fields, so any subset and order of ``index``, ``name``, ``pci.bus_id``,
    ``pcie.link.gen.current``, ``pcie.link.gen.max``, ``pcie.link.width.current`` and ``pcie.link.width.max``
    works. When both forms are present, the CSV wins for the fields it has.

    Returns:
        `list[GpuListing]`, sorted by index (empty when neither form is found).
    """
    text = strip_ansi(text)
    found: dict = {}
    for line in text.split("\n"):
        m = _L_LINE.match(line)
        if m and not line.strip().startswith("GPU0"):
            found[int(m.group(1))] = GpuListing(int(m.group(1)), m.group(2).strip())
    lines = text.split("\n")
    for n, line in enumerate(lines):
        names = [c.strip().split(" [")[0] for c in line.split(",")]
        if "index" not in names or not any(f in _CSV_FIELDS for f in names if f != "index"):
            continue
        block = [line]
        for nxt in lines[n + 1 :]:
            if not nxt.strip() or nxt.count(",") != line.count(","):
                break
            block.append(nxt)
        for rec in csv.reader(io.StringIO("\n".join(block[1:])), skipinitialspace=True):
            values = dict(zip(names, (v.strip() for v in rec)))
            idx = _int_or_none(values.get("index", ""))
            if idx is None:
                continue
            fields = {}
            for src, dst in _CSV_FIELDS.items():
                if src in values:
                    fields[dst] = values[src] if dst in ("name", "pci_bus_id") else _int_or_none(values[src])
            prev = found.get(idx, GpuListing(idx, fields.get("name") or f"GPU{idx}"))
            found[idx] = prev._replace(**{k: v for k, v in fields.items() if v is not None and k != "index"})
    return [found[i] for i in sorted(found)]


class SavedOutputs(NamedTuple):
    """Everything :func:`parse_saved_outputs` recognised in one or more saved text files."""

    topo: TopoMatrix | None
    p2p: dict  # capability letter ("r", "w", ...) -> {(i, j): status}
    gpus: list  # list[GpuListing]


def parse_saved_outputs(*texts: str) -> SavedOutputs:
    """Find a ``topo -m`` matrix, ``topo -p2p`` matrices and a GPU listing in saved text.

    Users often paste several commands' outputs into one file; each text is searched for each form.
    P2P matrices with no visible capability (``"?"``) fill the read matrix, then the write matrix, in order.
    """
    topo = None
    p2p: dict = {}
    unlabelled: list = []
    gpus: dict = {}
    for text in texts:
        if topo is None:
            try:
                topo = parse_topo_matrix(text)
            except ValueError:
                pass
        for cap, matrix in parse_p2p_matrices(text).items():
            if _looks_like_topo(matrix):
                continue  # a 'topo -m' matrix without affinity columns (link kinds, not P2P statuses)
            if cap.startswith("?"):
                unlabelled.append(matrix)
            else:
                p2p.setdefault(cap, matrix)
        for g in parse_gpu_listing(text):
            gpus[g.index] = g
    # Unlabelled matrices fill read, then write, in the order given (the order the CLI documents).
    for cap in ("r", "w"):
        if cap not in p2p and unlabelled:
            p2p[cap] = unlabelled.pop(0)
    return SavedOutputs(topo, p2p, [gpus[i] for i in sorted(gpus)])


def _looks_like_topo(matrix: dict) -> bool:
    return any(link_class(v) is not LinkClass.UNKNOWN and v not in P2P_STATUS_MEANING for v in matrix.values())


def pcie_path_rank(kind: str) -> int:
    """Position of a PCIe path kind in NCCL's order PIX < PXB < PHB < NODE < SYS (NVLink is -1)."""
    k = kind.strip().upper()
    if k.startswith("NV"):
        return -1
    k = "SYS" if k == "SOC" else k
    return _PCIE_PATH_ORDER.index(k) if k in _PCIE_PATH_ORDER else len(_PCIE_PATH_ORDER)
