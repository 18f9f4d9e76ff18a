"""The link model's arithmetic and profiles (pure functions: no ranks needed).

The throttle itself is exercised on real gloo ranks in test_bench.py (one spawn for all rank checks).
"""

import math

import pytest

from patchray.distributed.bench.linkmodel import model_record, wire_bytes
from patchray.distributed.topology.links import LINK_PROFILES, LinkProfile, get_profile, model_latency_ms, transfer_ms


def test_profiles_are_complete_and_sane():
    assert set(LINK_PROFILES) >= {"nvlink", "pcie4_x16_p2p", "pcie4_x16_no_p2p", "pcie3_x8", "10gbe"}
    for name, p in LINK_PROFILES.items():
        assert isinstance(p, LinkProfile) and p.name == name
        assert isinstance(p.bandwidth_gbps, float) and p.bandwidth_gbps > 0
        assert isinstance(p.latency_us, float) and p.latency_us > 0
        assert isinstance(p.via_host, bool) and p.source
    bw = {n: LINK_PROFILES[n].bandwidth_gbps / (2 if LINK_PROFILES[n].via_host else 1) for n in LINK_PROFILES}
    # effective rates must order the way the hardware does
    assert bw["nvlink"] > bw["pcie4_x16_p2p"] > bw["pcie4_x16_no_p2p"] > bw["pcie3_x8"] > bw["10gbe"]
    assert LINK_PROFILES["pcie4_x16_no_p2p"].via_host and not LINK_PROFILES["pcie4_x16_p2p"].via_host
    with pytest.raises(ValueError, match="unknown link profile 'infiniband'.*nvlink"):
        get_profile("infiniband")


def test_model_latency_arithmetic():
    p = LinkProfile("test", 2.0, 100.0, False)
    # 10 ms compute + 4 messages * 0.1 ms + 1e9 B / 2e9 B/s = 10 + 0.4 + 500
    assert math.isclose(model_latency_ms(10.0, 1e9, 4, p), 510.4, rel_tol=1e-12)
    host = p._replace(via_host=True)
    # staged through host memory: two copies, so the transfer term doubles; the message term does not
    assert math.isclose(model_latency_ms(10.0, 1e9, 4, host), 1010.4, rel_tol=1e-12)
    assert math.isclose(transfer_ms(2e9, p), 1000.0, rel_tol=1e-12)
    assert model_latency_ms(3.0, 0, 0, "nvlink") == 3.0
    with pytest.raises(ValueError):
        model_latency_ms(-1.0, 0, 0, p)


def test_wire_bytes_per_operation():
    n = 4
    # ring all-reduce sends 2 (n-1)/n of the buffer
    assert wire_bytes({"all_reduce": 1000}, n) == 1500
    # all_gather counts n outputs + 1 input (5 x 100): a rank sends its input to n-1 peers
    assert wire_bytes({"all_gather": 500}, n) == 300
    # a gather's root takes in n-1 inputs of the counted size
    assert wire_bytes({"gather": 100}, n) == 300
    # point-to-point payloads count exactly; receives and barriers add nothing
    assert wire_bytes({"isend": 64, "irecv": 999, "barrier": 0, "batch_isend_irecv": 0}, n) == 64
    assert wire_bytes({"all_reduce": 1000}, 1) == 0


def test_model_record_takes_the_slowest_rank():
    per_rank_bytes = [{"isend": 1_000_000}, {"isend": 3_000_000}]
    rec = model_record([10.0, 5.0], per_rank_bytes, [2, 2], 2, profiles=["10gbe"])
    # 10gbe: 1.18 GB/s, 50 us per message.
    # rank 0: 10 ms + 2 x 0.05 ms + 1e6 B / 1.18e9 B/s (0.8475 ms) = 10.9475 ms
    # rank 1:  5 ms + 2 x 0.05 ms + 3e6 B / 1.18e9 B/s (2.5424 ms) =  7.6424 ms; the slowest is rank 0
    assert rec["10gbe"] == 10.947
    # one rank: no link at all, whatever was counted
    assert model_record([7.0], [{"isend": 10**9}], [5], 1)["10gbe"] == 7.0
