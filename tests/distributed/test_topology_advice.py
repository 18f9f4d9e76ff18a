"""Advice on each recorded machine type, the decode/OTIL choices and the per-cluster cache."""

import math
from pathlib import Path

import pytest

from patchray.distributed.topology.advice import (
    advise,
    bottleneck_link,
    choose_decode_mode,
    choose_otil_preset,
    link_profiles,
    nearest_profile,
)
from patchray.distributed.topology.cli import _inter_node_links
from patchray.distributed.topology.links import LinkProfile
from patchray.distributed.topology.probe import build_node, cached_probe, clear_probe_cache, report_from_saved
from patchray.distributed.topology.report import (
    GpuInfo,
    InterNodeLink,
    NcclBandwidth,
    NodeTopology,
    PairInfo,
    TopologyReport,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def saved(machine):
    d = FIX / machine
    p2p = [p.read_text() for p in sorted(d.glob("p2p*"))]
    gpus = next(iter(sorted(d.glob("gpus*"))), None)
    return report_from_saved((d / "topo_m.txt").read_text(), p2p, gpus.read_text() if gpus else None, host=machine)


def env_of(advice):
    out = {}
    for a in advice:
        out.update(a.env)
    return out


def titles(advice, kind=None):
    return [a.title for a in advice if kind is None or a.kind == kind]


def setting(advice, key):
    vals = [a.settings[key] for a in advice if key in a.settings]
    assert len(vals) == 1, vals
    return vals[0]


def test_consumer_no_p2p_gets_p2p_disabled_tile_runs_and_sparse_otil():
    adv = advise(saved("consumer_2x3090_no_p2p"))
    assert env_of(adv) == {"NCCL_P2P_DISABLE": "1"}
    assert any("GPU1" in t and "PCIe 3.0 x4" in t for t in titles(adv, "warning"))
    assert not any("GPU0" in t and "PCIe" in t for t in titles(adv, "warning"))  # GPU0 is on 4.0 x16
    assert any("No GPU peer-to-peer" in t and "CNS" in t for t in titles(adv, "warning"))
    assert setting(adv, "decode_mode") == "tile-runs"
    assert setting(adv, "otil_preset") == "otil"
    # host-staged through a PCIe 3.0 x4 link: 0.44 * 3.94 GB/s = 1.7 GB/s < 5 GB/s -> k/K = 1/16
    assert setting(adv, "otil_k_fraction") == pytest.approx(1 / 16)
    assert [a.severity for a in adv] == sorted((a.severity for a in adv), key=["warning", "action", "info"].index)


def test_two_socket_server_warns_and_keeps_jobs_inside_p2p_groups():
    adv = advise(saved("dual_socket_4x_l40s"))
    warn = titles(adv, "warning")
    assert any("span CPU sockets" in t for t in warn)
    assert setting(adv, "socket_groups") == [[0, 1], [2, 3]]
    assert setting(adv, "p2p_groups") == [[0, 1], [2, 3]]
    env = env_of(adv)
    assert "NCCL_P2P_DISABLE" not in env  # P2P works within each socket
    assert env["NCCL_P2P_LEVEL"] == "NODE"  # NCCL's default (PXB) would not use the NODE-path P2P
    assert env["CUDA_VISIBLE_DEVICES"] in ("0,1", "2,3")
    assert setting(adv, "decode_mode") == "tile-runs"  # the slowest pair crosses sockets through host memory


def test_pcie_switch_workstation_needs_no_env_and_decodes_by_rows():
    adv = advise(saved("workstation_4x_a6000_pcie_switch"))
    assert env_of(adv) == {}
    assert titles(adv, "warning") == []
    assert setting(adv, "decode_mode") == "row"
    assert setting(adv, "otil_preset") == "otil" and setting(adv, "otil_k_fraction") == pytest.approx(1 / 4)


def test_nvlink_box_keeps_defaults_and_full_gather():
    adv = advise(saved("hgx_h100_8gpu_nvlink"))
    assert env_of(adv) == {}
    assert titles(adv, "warning") == []  # GPUs on two sockets, but they talk over NVLink
    assert setting(adv, "decode_mode") == "row"
    assert setting(adv, "otil_preset") == "balanced" and setting(adv, "otil_k_fraction") == 1.0


def test_mixed_models_warned_by_name():
    adv = advise(saved("mixed_4090_3090_3060"))
    mixed = [t for t in titles(adv, "warning") if "Mixed GPU models" in t]
    assert len(mixed) == 1 and all(m in mixed[0] for m in ("RTX 4090", "RTX 3090", "RTX 3060"))
    assert env_of(adv) == {"NCCL_P2P_DISABLE": "1"}


def test_legacy_and_single_gpu():
    adv = advise(saved("legacy_8x_k80_soc"))
    assert any("span CPU sockets" in t for t in titles(adv, "warning"))
    assert any("P2P status unknown" in t for t in titles(adv, "info"))
    one = advise(saved("single_gpu"))
    assert [a.kind for a in one] == ["info"] and "One GPU" in one[0].title
    assert choose_decode_mode(saved("single_gpu")).mode == "row"


def _two_gpu_report(read="OK", peer=None, nccl=None, copy=None):
    gpus = [GpuInfo(0, "NVIDIA RTX A5000", pcie_gen_max=4, pcie_width=16), GpuInfo(1, "NVIDIA RTX A5000", pcie_gen_max=4, pcie_width=16)]
    pair = PairInfo(0, 1, link="PXB", p2p_read=read, p2p_write=read, can_access_peer=peer)
    if copy is not None:
        pair.copy_gbps, pair.copy_gbps_reverse, pair.copy_latency_us = copy
    return TopologyReport(nodes=[NodeTopology("box", gpus=gpus, pairs=[pair], nccl=nccl)])


def test_measured_nccl_decides_p2p_disable():
    # P2P is "OK" by status but NCCL measured host memory faster by more than the 10% noise margin
    slow = _two_gpu_report(nccl=NcclBandwidth([0, 1], 1 << 26, p2p_allowed_gbps=4.0, p2p_disabled_gbps=9.0))
    adv = advise(slow)
    assert env_of(adv) == {"NCCL_P2P_DISABLE": "1"}
    assert any("slower than host memory" in t for t in titles(adv, "nccl_env"))
    fast = _two_gpu_report(nccl=NcclBandwidth([0, 1], 1 << 26, p2p_allowed_gbps=20.0, p2p_disabled_gbps=9.0))
    adv = advise(fast)
    assert env_of(adv) == {} and any("Keep P2P on" in t for t in titles(adv, "info"))
    # within the margin: no change advised either way
    close = _two_gpu_report(nccl=NcclBandwidth([0, 1], 1 << 26, p2p_allowed_gbps=9.0, p2p_disabled_gbps=9.5))
    assert "NCCL_P2P_DISABLE" not in env_of(advise(close))
    # the decision uses the better NCCL figure as the link bandwidth
    assert bottleneck_link(slow).bandwidth_gbps == 9.0 and bottleneck_link(slow).source == "nccl"


def test_p2p_reported_but_refused_by_cuda():
    adv = advise(_two_gpu_report(read="OK", peer=False))
    assert env_of(adv) == {"NCCL_P2P_DISABLE": "1"}
    assert any("CUDA refuses" in t for t in titles(adv, "nccl_env"))


def test_decode_mode_from_counted_bytes():
    # measured 10 GB/s and 10 us: 1e9 halo bytes take 100 ms, 100 exchanges 1 ms -> 101 ms of communication
    rep = _two_gpu_report(copy=(10.0, 12.0, 10.0))
    link = bottleneck_link(rep)
    assert (link.bandwidth_gbps, link.latency_us, link.source) == (10.0, 10.0, "copy")
    row = choose_decode_mode(rep, halo_bytes=1e9, exchanges=100, compute_ms=404.0)  # budget 25% = 101 ms
    assert row.mode == "row"
    tiles = choose_decode_mode(rep, halo_bytes=1e9, exchanges=100, compute_ms=400.0)  # budget 100 ms < 101 ms
    assert tiles.mode == "tile-runs"
    with pytest.raises(ValueError, match="overhead_budget"):
        choose_decode_mode(rep, overhead_budget=0)


def test_otil_k_from_block_bytes():
    rep = _two_gpu_report(copy=(10.0, 10.0, 20.0))
    # one peer; 1 MB blocks at 10 GB/s = 0.1 ms each; budget 15% of 10 ms = 1.5 ms minus 0.02 ms latency -> 14 blocks
    o = choose_otil_preset(rep, num_blocks=64, block_bytes=1e6, step_compute_ms=10.0)
    assert (o.preset, o.k) == ("otil", 14) and o.k_fraction == pytest.approx(14 / 64)
    # the bandwidth-class rule when no byte counts are given: 10 GB/s is in [5, 20) -> K/8
    o = choose_otil_preset(rep, num_blocks=64)
    assert (o.k, o.k_fraction) == (8, 1 / 8)
    with pytest.raises(ValueError, match="num_blocks"):
        choose_otil_preset(rep, num_blocks=0)


def test_link_profiles_have_the_link_model_fields():
    profiles = link_profiles()
    assert profiles
    for p in profiles.values():
        assert isinstance(p.name, str) and p.bandwidth_gbps > 0 and p.latency_us >= 0 and isinstance(p.via_host, bool)
    # "b" is staged through host memory: one copy achieves 20 / 2 = 10 GB/s on it
    table = {"a": LinkProfile("a", 100.0, 1.0, False), "b": LinkProfile("b", 20.0, 5.0, True), "c": LinkProfile("c", 1.0, 50.0, False)}
    assert nearest_profile(40.0, profiles=table).name == "a"  # log distance: 40 is nearer 100 than 10
    assert nearest_profile(29.0, profiles=table).name == "b"
    assert nearest_profile(40.0, via_host=True, profiles=table).name == "b"
    assert nearest_profile(2.0, profiles=table).name == "c"
    assert nearest_profile(0.0, profiles=table) is None


def test_several_nodes_slow_network_is_the_bottleneck():
    a = build_node("node-a", "live", listing=[], nvml={"gpus": [GpuInfo(0, "H100"), GpuInfo(1, "H100")], "links": {(0, 1): "NV18"}, "p2p": {"r": {(0, 1): "OK", (1, 0): "OK"}}})
    b = build_node("node-b", "remote", nvml={"gpus": [GpuInfo(0, "H100"), GpuInfo(1, "H100")], "links": {(0, 1): "NV18"}})
    rep = TopologyReport(nodes=[a, b], inter_node=[InterNodeLink("node-a", "node-b", 1.2, None, "test")])
    assert bottleneck_link(rep).source == "inter-node"
    assert choose_decode_mode(rep).mode == "tile-runs"
    adv = advise(rep)
    assert any("node-a and node-b" in t for t in titles(adv, "warning"))
    assert any(t.startswith("node-b: ") for t in titles(adv))  # remote nodes' advice names the node
    # the cluster check's neighbour bandwidths become inter-node links where hosts differ
    cluster = {"bandwidth_gbps": {"1->0": 20.0, "2->1": 1.1, "3->2": 19.0}}
    links = _inter_node_links(cluster, ["node-a", "node-a", "node-b", "node-b"])
    assert [(x.a, x.b, x.bandwidth_gbps) for x in links] == [("node-a", "node-b", 1.1)]


def test_cached_probe_probes_once_per_key():
    clear_probe_cache()
    calls = []

    def probe():
        calls.append(1)
        return _two_gpu_report()

    r1 = cached_probe(("embedded", (0, 1)), probe)
    r2 = cached_probe(("embedded", (0, 1)), probe)
    assert r1 is r2 and len(calls) == 1
    cached_probe(("embedded", (0, 2)), probe)
    assert len(calls) == 2
    r3 = cached_probe(("embedded", (0, 1)), probe, refresh=True)
    assert r3 is not r1 and len(calls) == 3
    clear_probe_cache()
    assert math.isfinite(bottleneck_link(r1).bandwidth_gbps)


def test_recommended_settings_bundle_what_auto_modes_use():
    from patchray.distributed.topology.advice import recommended_settings

    s = recommended_settings(saved("consumer_2x3090_no_p2p"), num_blocks=64)
    assert (s["decode_mode"], s["otil_preset"], s["otil_k"]) == ("tile-runs", "otil", 4)  # 64 / 16
    assert s["env"] == {"NCCL_P2P_DISABLE": "1"} and s["link"]["source"] == "estimate"
    s = recommended_settings(saved("hgx_h100_8gpu_nvlink"), devices=[0, 1], num_blocks=64)
    assert (s["decode_mode"], s["otil_preset"], s["otil_k"], s["env"]) == ("row", "balanced", 64, {})
    empty = recommended_settings(TopologyReport(nodes=[NodeTopology("cpu-only")]))
    assert empty["decode_mode"] == "row" and empty["link"]["bandwidth_gbps"] is None
