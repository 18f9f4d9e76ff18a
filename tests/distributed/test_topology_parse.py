"""Parsing of recorded ``nvidia-smi topo -m`` / ``topo -p2p`` / GPU listings (tests/fixtures/topology/)."""

import random
from pathlib import Path

import pytest

from patchray.distributed.topology.parse import (
    LinkClass,
    link_class,
    nvlink_count,
    parse_gpu_listing,
    parse_p2p_matrices,
    parse_p2p_matrix,
    parse_saved_outputs,
    parse_topo_matrix,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def read(machine, name):
    return (FIX / machine / name).read_text()


def test_hgx_8gpu_nvlink_with_nics_and_ansi_header():
    text = read("hgx_h100_8gpu_nvlink", "topo_m.txt")
    assert "\x1b[4m" in text  # the recorded header carries nvidia-smi's underline
    m = parse_topo_matrix(text)
    assert m.gpus == [f"GPU{i}" for i in range(8)]
    assert len(m.links) == 8 * 7 and set(m.links.values()) == {"NV18"}
    assert nvlink_count(m.link(3, 6)) == 18 and link_class(m.link(3, 6)) is LinkClass.NVLINK
    assert m.cpu_affinity[0] == "0-55,112-167" and m.cpu_affinity[7] == "56-111,168-223"
    assert [m.numa_affinity[i] for i in range(8)] == ["0"] * 4 + ["1"] * 4
    assert m.gpu_numa_id[5] == "N/A"
    assert m.nics == [f"NIC{k}" for k in range(10)]
    assert m.nic_names == {f"NIC{k}": f"mlx5_{k}" for k in range(10)}
    assert m.gpu_nic_links[(0, "NIC0")] == "PIX" and m.gpu_nic_links[(4, "NIC6")] == "PIX"
    assert m.gpu_nic_links[(1, "NIC0")] == "NODE" and m.gpu_nic_links[(0, "NIC6")] == "SYS"
    r = parse_p2p_matrix(read("hgx_h100_8gpu_nvlink", "p2p_r.txt"))
    assert len(r) == 56 and set(r.values()) == {"OK"}


def test_consumer_two_gpus_without_p2p():
    m = parse_topo_matrix(read("consumer_2x3090_no_p2p", "topo_m.txt"))
    assert m.links == {(0, 1): "PHB", (1, 0): "PHB"}
    assert link_class("PHB") is LinkClass.HOST_BRIDGE
    assert m.nics == [] and m.numa_affinity == {0: "0", 1: "0"}
    # one file holding both commands' output, each under its command line
    both = parse_p2p_matrices(read("consumer_2x3090_no_p2p", "p2p.txt"))
    assert both == {"r": {(0, 1): "CNS", (1, 0): "CNS"}, "w": {(0, 1): "CNS", (1, 0): "CNS"}}
    gpus = parse_gpu_listing(read("consumer_2x3090_no_p2p", "gpus.csv"))
    assert [(g.index, g.name) for g in gpus] == [(0, "NVIDIA GeForce RTX 3090"), (1, "NVIDIA GeForce RTX 3090")]
    assert (gpus[1].pcie_gen, gpus[1].pcie_gen_max, gpus[1].pcie_width, gpus[1].pcie_width_max) == (1, 3, 4, 16)
    assert gpus[0].pci_bus_id == "00000000:0B:00.0"


def test_workstation_pcie_switch_with_p2p():
    m = parse_topo_matrix(read("workstation_4x_a6000_pcie_switch", "topo_m.txt"))
    assert m.link(0, 1) == "PIX" and m.link(2, 3) == "PIX"
    assert m.link(0, 2) == "PXB" and m.link(3, 1) == "PXB"
    assert link_class("PXB") is LinkClass.PCIE_SWITCH
    saved = parse_saved_outputs(*(read("workstation_4x_a6000_pcie_switch", f) for f in ("p2p_r.txt", "p2p_w.txt")))
    assert set(saved.p2p) == {"r", "w"} and set(saved.p2p["w"].values()) == {"OK"}


def test_two_socket_server_pasted_with_spaces_and_prompt():
    text = read("dual_socket_4x_l40s", "topo_m.txt")
    assert "\t" not in text and text.startswith("user@gpu-server")
    m = parse_topo_matrix(text)
    assert m.link(0, 1) == "NODE" and m.link(2, 3) == "NODE"
    assert {m.link(a, b) for a in (0, 1) for b in (2, 3)} == {"SYS"}
    assert link_class("SYS") is LinkClass.CROSS_SOCKET and link_class("NODE") is LinkClass.NUMA_NODE
    assert m.numa_affinity == {0: "0", 1: "0", 2: "1", 3: "1"}
    assert m.cpu_affinity[2] == "32-63,96-127"
    assert m.nics == ["NIC0"] and m.nic_names == {"NIC0": "mlx5_0"}
    assert m.gpu_nic_links[(0, "NIC0")] == "NODE" and m.gpu_nic_links[(3, "NIC0")] == "SYS"
    r = parse_p2p_matrices(read("dual_socket_4x_l40s", "p2p_r.txt"))
    assert list(r) == ["r"]  # capability read from the command line above the matrix
    assert r["r"][(0, 1)] == "OK" and r["r"][(0, 2)] == "CNS" and r["r"][(3, 1)] == "CNS"


def test_mixed_models_listing_and_not_supported():
    gpus = parse_gpu_listing(read("mixed_4090_3090_3060", "gpus_L.txt"))
    assert [g.name for g in gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3060"]
    assert all(g.pcie_gen is None for g in gpus)
    assert set(parse_p2p_matrix(read("mixed_4090_3090_3060", "p2p_r.txt")).values()) == {"NS"}


def test_legacy_driver_soc_and_nic_named_by_device():
    m = parse_topo_matrix(read("legacy_8x_k80_soc", "topo_m.txt"))
    assert m.link(0, 1) == "PIX" and m.link(0, 2) == "PHB" and m.link(0, 4) == "SOC"
    assert link_class("SOC") is LinkClass.CROSS_SOCKET
    assert m.nics == ["mlx4_0"] and m.nic_names == {"mlx4_0": "mlx4_0"}
    assert m.cpu_affinity[5] == "10-19,30-39" and m.numa_affinity == {}


def test_single_gpu_and_telling_matrices_apart():
    m = parse_topo_matrix(read("single_gpu", "topo_m.txt"))
    assert m.gpus == ["GPU0"] and m.links == {} and m.cpu_affinity == {0: "0-15"}
    assert parse_p2p_matrix(read("single_gpu", "p2p_r.txt")) == {}
    with pytest.raises(ValueError, match="p2p|CPU Affinity"):
        parse_topo_matrix(read("single_gpu", "p2p_r.txt"))
    with pytest.raises(ValueError, match="p2p"):
        parse_topo_matrix(read("workstation_4x_a6000_pcie_switch", "p2p_r.txt"))
    # the topo -m matrix is not mistaken for a P2P matrix when both are pasted together
    saved = parse_saved_outputs(read("dual_socket_4x_l40s", "topo_m.txt") + read("dual_socket_4x_l40s", "p2p_w.txt"))
    assert saved.topo.link(0, 2) == "SYS" and list(saved.p2p) == ["w"]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no 'nvidia-smi topo -m' matrix"):
        parse_topo_matrix("Failed to initialize NVML: Driver/library version mismatch\n")
    with pytest.raises(ValueError, match="no 'nvidia-smi topo -p2p' matrix"):
        parse_p2p_matrix("nothing here")
    with pytest.raises(ValueError, match="'GPU1' has 1 link cells"):
        parse_topo_matrix("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPHB\t0-7\nGPU1\tPHB\n")


def _random_topo(rng, n, nics):
    kinds = ["NV4", "NV12", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"]
    links = {}
    for i in range(n):
        for j in range(i + 1, n):
            links[(i, j)] = links[(j, i)] = rng.choice(kinds)
    nic = {(i, k): rng.choice(kinds[3:]) for i in range(n) for k in range(nics)}
    cpus = {i: f"{rng.randrange(64)}-{64 + rng.randrange(64)}" for i in range(n)}
    numa = {i: str(rng.randrange(2)) for i in range(n)}
    cols = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(nics)]
    lines = ["\t" + "\t".join(cols + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for i in range(n):
        cells = [" X " if i == j else links[(i, j)] for j in range(n)] + [nic[(i, k)] for k in range(nics)]
        lines.append(f"GPU{i}\t" + "\t".join(cells) + f"\t{cpus[i]}\t{numa[i]}\t\tN/A")
    for k in range(nics):
        cells = [nic[(j, k)] for j in range(n)] + [" X " if k == m else "SYS" for m in range(nics)]
        lines.append(f"NIC{k}\t" + "\t".join(cells))
    lines += ["", "Legend:", "", "  X    = Self", "", "NIC Legend:", ""] + [f"  NIC{k}: mlx5_{k}" for k in range(nics)]
    return "\n".join(lines) + "\n", links, nic, cpus, numa


@pytest.mark.parametrize("trial", range(4))
def test_random_topo_matrices_round_trip_with_tabs_or_spaces(trial):
    rng = random.Random()  # fresh inputs each run; a failure prints the matrix in the assert diff
    n, nics = rng.randrange(2, 9), rng.randrange(0, 4)
    text, links, nic, cpus, numa = _random_topo(rng, n, nics)
    for variant in (text, text.expandtabs(8)):
        m = parse_topo_matrix(variant)
        assert m.links == links
        assert {(i, f"NIC{k}"): v for (i, k), v in nic.items()} == m.gpu_nic_links
        assert m.cpu_affinity == cpus and m.numa_affinity == numa
        assert m.nic_names == {f"NIC{k}": f"mlx5_{k}" for k in range(nics)}


@pytest.mark.parametrize("trial", range(4))
def test_random_p2p_matrices_round_trip(trial):
    rng = random.Random()
    n = rng.randrange(1, 9)
    statuses = ["OK", "CNS", "GNS", "TNS", "NS", "DR", "U"]
    want = {(i, j): rng.choice(statuses) for i in range(n) for j in range(n) if i != j}
    tab = " \t" + "".join(f"GPU{j}\t" for j in range(n)) + "\n"
    for i in range(n):
        tab += f" GPU{i}\t" + "".join(("X" if i == j else want[(i, j)]) + "\t" for j in range(n)) + "\n"
    tab += "\nLegend:\n\n  X    = Self\n  OK   = Status Ok\n"
    assert parse_p2p_matrix(tab) == want
    assert parse_p2p_matrix("$ nvidia-smi topo -p2p w\n" + tab.expandtabs(8)) == want
    assert list(parse_p2p_matrices("$ nvidia-smi topo -p2p w\n" + tab)) == ["w"]
