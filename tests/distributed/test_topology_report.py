"""Report schema, summary, heatmap PNG, the live probe on this machine, the NCCL worker plumbing and the CLI."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from patchray.distributed.topology.advice import advise, report_with_advice
from patchray.distributed.topology.cli import probe_main
from patchray.distributed.topology.measure import _worker_env, measure_allreduce
from patchray.distributed.topology.probe import _nvml_collect, build_node, probe_topology, report_from_saved
from patchray.distributed.topology.render import render_heatmap, summary_text
from patchray.distributed.topology.report import SCHEMA_VERSION, NcclBandwidth, TopologyReport

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
MACHINES = sorted(p.name for p in FIX.iterdir() if p.is_dir())
HAS_GPU_DRIVER = torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


def saved(machine):
    d = FIX / machine
    p2p = [p.read_text() for p in sorted(d.glob("p2p*"))]
    gpus = next(iter(sorted(d.glob("gpus*"))), None)
    return report_from_saved((d / "topo_m.txt").read_text(), p2p, gpus.read_text() if gpus else None, host=machine)


_TYPES = {  # key -> allowed types, for every GPU / pair / NCCL record
    "gpu": {"index": (int,), "name": (str, type(None)), "cuda_index": (int, type(None)), "pci_bus_id": (str, type(None)),
            "pcie_gen": (int, type(None)), "pcie_gen_max": (int, type(None)), "pcie_width": (int, type(None)),
            "pcie_width_max": (int, type(None)), "cpu_affinity": (str, type(None)), "numa_node": (str, type(None)),
            "memory_mib": (int, type(None)), "pcie_link_gbps": (float, type(None))},
    "pair": {"a": (int,), "b": (int,), "link": (str, type(None)), "p2p_read": (str, type(None)),
             "p2p_write": (str, type(None)), "can_access_peer": (bool, type(None)), "copy_gbps": (float, type(None)),
             "copy_gbps_reverse": (float, type(None)), "copy_latency_us": (float, type(None)), "link_class": (str,),
             "nvlinks": (int,), "p2p_ok": (bool, type(None))},
    "nccl": {"devices": (list,), "nbytes": (int,), "p2p_allowed_gbps": (float, type(None)),
             "p2p_disabled_gbps": (float, type(None)), "error": (str, type(None))},
    "advice": {"kind": (str,), "severity": (str,), "title": (str,), "detail": (str,), "env": (dict,), "settings": (dict,)},
}


def check_schema(d):
    assert d["schema"] == SCHEMA_VERSION == 1
    assert set(d) == {"schema", "created_utc", "gpu_count", "notes", "nodes", "inter_node", "cluster", "advice"}
    assert isinstance(d["gpu_count"], int) and isinstance(d["notes"], list) and isinstance(d["inter_node"], list)
    for node in d["nodes"]:
        assert set(node) == {"host", "source", "gpus", "pairs", "nics", "nccl", "driver_version", "cuda_version", "notes"}
        for kind, records in (("gpu", node["gpus"]), ("pair", node["pairs"]), ("nccl", [node["nccl"]])):
            for rec in records:
                assert set(rec) == set(_TYPES[kind]), (kind, sorted(rec))
                for k, v in rec.items():
                    assert isinstance(v, _TYPES[kind][k]), (kind, k, v)
        for nic in node["nics"]:
            assert set(nic) == {"label", "name", "links"} and all(isinstance(k, str) for k in nic["links"])
    for a in d["advice"]:
        assert set(a) == set(_TYPES["advice"]) and all(isinstance(a[k], _TYPES["advice"][k]) for k in a)
        assert a["severity"] in ("warning", "action", "info")
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in a["env"].items())
    json.dumps(d)  # JSON-ready as is


@pytest.mark.parametrize("machine", MACHINES)
def test_schema_stable_and_typed_for_every_machine(machine):
    rep = saved(machine)
    d = report_with_advice(rep)
    check_schema(d)
    # a round trip through JSON rebuilds the same report
    back = TopologyReport.from_dict(json.loads(json.dumps(d)))
    assert report_with_advice(back) == d
    text = summary_text(rep)
    n = len(rep.gpus)
    assert f"{n} GPU(s)" in text and all(f"GPU{g.index}" in text for g in rep.gpus)


def test_the_report_holds_facts_and_the_document_adds_the_advice():
    rep = saved("consumer_2x3090_no_p2p")
    assert rep.to_dict()["advice"] == []
    doc = report_with_advice(rep)
    assert doc["advice"] == [a.to_dict() for a in advise(rep)] and doc["advice"]
    assert {k: v for k, v in doc.items() if k != "advice"} == {k: v for k, v in rep.to_dict().items() if k != "advice"}


def test_schema_with_measurements_and_a_newer_schema_is_refused():
    rep = saved("consumer_2x3090_no_p2p")
    p = rep.pairs[0]
    p.can_access_peer, p.copy_gbps, p.copy_gbps_reverse, p.copy_latency_us = False, 11.5, 10.25, 18.0
    rep.local.nccl = NcclBandwidth([0, 1], 1 << 26, 9.5, 9.75)
    d = report_with_advice(rep)
    check_schema(d)
    pd = d["nodes"][0]["pairs"][0]
    assert (pd["p2p_ok"], pd["copy_gbps"], pd["link_class"]) == (False, 11.5, "host_bridge")
    assert "11.5 GB/s / 10.2 GB/s" in summary_text(rep) or "11.5 GB/s / 10.3 GB/s" in summary_text(rep)
    d["schema"] = 2
    with pytest.raises(ValueError, match="schema 2"):
        TopologyReport.from_dict(d)


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("machine", ["hgx_h100_8gpu_nvlink", "consumer_2x3090_no_p2p", "dual_socket_4x_l40s"])
def test_heatmap_png_written(machine, tmp_path):
    out = render_heatmap(saved(machine), str(tmp_path / "sub" / "topology.png"))
    w, h = png_size(out)
    assert w > 200 and h > 200 and Path(out).stat().st_size > 5000


def test_probe_on_this_machine(tmp_path):
    rep = probe_topology(measure=True)
    d = report_with_advice(rep)
    check_schema(d)
    assert d["nodes"][0]["source"] == "live"
    if HAS_GPU_DRIVER:
        pytest.skip("this machine has an NVIDIA driver; the zero-GPU path is checked on GPU-less machines (CI)")
    assert rep.gpu_count == 0 and d["gpu_count"] == 0
    assert rep.notes and rep.notes[0].startswith("No NVIDIA GPU found on this machine")
    assert "nvidia-smi" in rep.notes[0] and "PyTorch" in rep.notes[0]
    assert [a["title"] for a in d["advice"]] == ["No NVIDIA GPU found"]
    assert "No NVIDIA GPU found" in summary_text(rep)
    w, h = png_size(render_heatmap(rep, str(tmp_path / "none.png")))
    assert w > 100 and h > 50


class FakeNvml:
    """An NVML stand-in for a 3-GPU box: GPU0-GPU1 on two direct NVLinks, GPU2 on PCIe; P2P refused for GPU2."""

    NVML_NVLINK_MAX_LINKS = 4
    BUS = ["00000000:17:00.0", "00000000:65:00.0", "00000000:CA:00.0"]

    class _Pci:
        def __init__(self, bus):
            self.busId = bus.encode()

    class _Mem:
        total = 24 << 30

    def nvmlSystemGetDriverVersion(self):
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return self._Pci(self.BUS[h])

    def nvmlDeviceGetName(self, h):
        return "NVIDIA RTX A5000"

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._Mem()

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 1  # idle

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16 if h < 2 else 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h == 2 or link >= 2:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 0  # GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return self._Pci(self.BUS[1 - h])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 30  # NVML_TOPOLOGY_HOSTBRIDGE

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        if cap not in (0, 1):  # nvmlGpuP2PCapsIndex_t READ / WRITE, as NVML itself would check
            raise TypeError(f"bad P2P capability index {cap!r}")
        if 2 in (a, b):
            return 1 if cap == 0 else 5  # read: CHIPSET_NOT_SUPPORTED, write: NOT_SUPPORTED
        return 0


def test_nvml_facts_assemble_into_a_node():
    notes = []
    nv = _nvml_collect(FakeNvml(), notes)
    assert nv["driver_version"] == "550.54.15" and nv["cuda_version"] == "12.4"
    assert nv["links"][(0, 1)] == "NV2" and nv["links"][(1, 0)] == "NV2" and nv["links"][(0, 2)] == "PHB"
    node = build_node("box", "live", nvml=nv)
    assert [g.pcie_label() for g in node.gpus] == ["PCIe 4.0 x16", "PCIe 4.0 x16", "PCIe 4.0 x4"]
    assert node.pair(0, 1).p2p_ok is True and node.pair(0, 1).p2p_write == "OK"
    assert (node.pair(1, 2).p2p_read, node.pair(1, 2).p2p_write, node.pair(1, 2).p2p_ok) == ("CNS", "NS", False)
    assert node.gpus[0].memory_mib == 24 << 10


def test_allreduce_worker_sees_the_environment_it_was_given(monkeypatch):
    # gloo on CPU runs the same fresh-process plumbing as the NCCL measurement; what matters is that
    # NCCL_P2P_DISABLE reaches the worker ranks when asked, and that other NCCL settings pass through
    monkeypatch.setenv("NCCL_P2P_LEVEL", "PHB")
    off = measure_allreduce([0, 1], p2p_disabled=True, backend="gloo", nbytes=1 << 16, iters=2, warmup=1, timeout_s=120)
    assert off["env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "PHB", "NCCL_SHM_DISABLE": None}
    assert off["world_size"] == 2 and off["bytes"] == 1 << 16
    assert off["busbw_gbps"] > 0 and off["busbw_gbps"] == pytest.approx(off["algbw_gbps"])  # 2(n-1)/n = 1 at n = 2
    # "P2P allowed" removes a disable the user's shell may have set
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert "NCCL_P2P_DISABLE" not in _worker_env(False) and _worker_env(False)["NCCL_P2P_LEVEL"] == "PHB"
    assert _worker_env(True)["NCCL_P2P_DISABLE"] == "1"


def test_cli_analyses_saved_output(tmp_path, capsys):
    d = FIX / "consumer_2x3090_no_p2p"
    args = ["--topo-file", str(d / "topo_m.txt"), "--p2p-file", str(d / "p2p.txt"), "--gpus-file", str(d / "gpus.csv")]
    assert probe_main(args + ["--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "export NCCL_P2P_DISABLE=1" in out and "tile-runs" in out
    assert png_size(tmp_path / "a" / "topology.png")[0] > 200
    assert probe_main(args + ["--json", "--out", str(tmp_path / "b")]) == 0
    d = json.loads(capsys.readouterr().out)
    check_schema(d)
    assert d["gpu_count"] == 2 and d["nodes"][0]["source"] == "saved"
    assert json.loads((tmp_path / "b" / "topology.json").read_text()) == d


def test_cli_refuses_bad_input(tmp_path, capsys):
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    assert probe_main(["--topo-file", str(junk), "--out", str(tmp_path)]) == 2
    assert "no nvidia-smi output" in capsys.readouterr().err
    assert probe_main(["--topo-file", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    assert probe_main(["--topo-file", str(junk), "--ranks", "2"]) == 2
    assert probe_main(["--ranks", "0"]) == 2


def test_heatmap_image_for_nodes():
    from patchray.distributed.topology.render import heatmap_image

    img = heatmap_image(saved("dual_socket_4x_l40s"))
    assert img.ndim == 3 and img.shape[2] == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img.dtype.name == "float32" and 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    assert float(img.std()) > 0.05  # not a blank canvas


def test_node_probe_on_rank_runs_once_per_host():
    import socket
    from types import SimpleNamespace

    from patchray.distributed.topology.probe import node_probe_on_rank
    from patchray.distributed.topology.report import node_from_dict

    host = socket.gethostname()
    # ranks 0 and 1 share this host: only rank 0 probes it; the result is a plain dict for any driver
    assert node_probe_on_rank(SimpleNamespace(rank=1), {host: 0}) is None
    d = node_probe_on_rank(SimpleNamespace(rank=0), {host: 0})
    assert isinstance(d, dict) and d["host"] == host and d["source"] == "remote"
    node = node_from_dict(d)
    assert node.host == host and len(node.gpus) == len(d["gpus"])


def test_heatmap_and_summary_for_two_nodes(tmp_path):
    from patchray.distributed.topology.report import InterNodeLink

    a, b = saved("workstation_4x_a6000_pcie_switch").local, saved("consumer_2x3090_no_p2p").local
    b.source = "remote"
    rep = TopologyReport(nodes=[a, b], inter_node=[InterNodeLink(a.host, b.host, 1.18, 50.0, "cluster check")])
    w, h = png_size(render_heatmap(rep, str(tmp_path / "two.png")))
    one_w, _ = png_size(render_heatmap(TopologyReport(nodes=[a]), str(tmp_path / "one.png")))
    assert w > one_w  # one panel per node, side by side
    text = summary_text(rep)
    assert f"Link {a.host} <-> {b.host}: 1.2 GB/s" in text and "probed on a Ray node" in text
    check_schema(report_with_advice(rep))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_live_probe_measures_every_pair_on_gpus():
    rep = probe_topology(measure=True, copy_bytes=16 << 20, nccl_bytes=16 << 20)
    check_schema(report_with_advice(rep))
    node = rep.local
    seen = [g for g in node.gpus if g.cuda_index is not None]
    assert len(seen) == torch.cuda.device_count()
    for p in node.pairs:
        if node.gpu(p.a).cuda_index is None or node.gpu(p.b).cuda_index is None:
            continue
        assert p.can_access_peer is not None and p.copy_gbps > 0 and p.copy_gbps_reverse > 0 and p.copy_latency_us > 0
        assert p.link is not None  # from nvidia-smi topo -m or NVML
    assert node.nccl is not None and node.nccl.error is None, node.nccl
    assert node.nccl.p2p_allowed_gbps > 0 and node.nccl.p2p_disabled_gbps > 0
