"""The sharding advice (``auto``), its cost model, and the weights' transport (numpy views, dtypes viewed back).

The thresholds and costs below are worked out by hand from the rules in docs/sharding.md (figures chosen to be exact in
binary floating point, so the boundary cases test ``<=`` itself)."""

import pytest
import torch

from patchray.distributed.topology.links import get_profile
from patchray.distributed.topology.shard_advice import (
    GIB,
    activation_reserve,
    choose_sharding,
    host_fits,
    host_headroom,
    offload_cost,
    offload_resident_bytes,
    offloaded_step_ms,
    sharded_step_ms,
)


def test_auto_shards_only_when_the_whole_model_does_not_fit():
    # Wan 2.1 14B in bf16 (26.6 GiB) on 24 GiB cards: does not fit whole, fits at 2 ranks
    c = choose_sharding(26.6 * GIB, 23.5 * GIB, 2, total_bytes_min=24 * GIB)
    assert c.sharding == "blocks" and "exceed" in c.reason and "still does not fit" not in c.reason
    # the same model on 80 GiB cards: whole
    assert choose_sharding(26.6 * GIB, 79 * GIB, 2, total_bytes_min=80 * GIB).sharding == "none"
    # one rank: nothing to shard over
    assert choose_sharding(26.6 * GIB, 10 * GIB, 1).sharding == "none"
    # too big even sharded: the shards go to host memory, and the reason says blocks alone did not fit
    big = choose_sharding(80 * GIB, 23.5 * GIB, 2, total_bytes_min=24 * GIB)
    assert big.sharding == "blocks+offload" and "still does not fit" in big.reason
    # the reserve: 20 % of the card, at least 3 GiB
    assert activation_reserve(8 * GIB) == 3 * GIB and activation_reserve(80 * GIB) == pytest.approx(16 * GIB)


def test_cost_model_is_the_link_model():
    p = get_profile("pcie4_x16_no_p2p")
    gather = 2 * (10e9 / 2) / (p.bandwidth_gbps * 1e9) * 1e3  # half of 10 GB received, staged through host: two copies
    assert sharded_step_ms(100.0, 10e9, 2, p) == pytest.approx(max(100.0, gather))
    assert sharded_step_ms(100.0, 10e9, 2, p, overlap=False) == pytest.approx(100.0 + gather)
    assert offloaded_step_ms(100.0, 27.6e9) == pytest.approx(1000.0)  # PCIe 4.0 x16: 27.6 GB/s, one copy
    assert offloaded_step_ms(2000.0, 27.6e9) == pytest.approx(2000.0)  # compute-bound: the copy hides behind it


def test_the_verdict_says_when_sharding_is_slower_than_one_offloaded_card():
    # FLUX.1-like: 23.8 GB of weights, 211 ms per evaluation on one card
    slow = choose_sharding(22.2 * GIB, 23 * GIB, 4, total_bytes_min=24 * GIB, link="pcie4_x16_no_p2p", compute_ms_one_card=211.0)
    assert slow.sharding == "blocks" and slow.slower_than_offload and "slower than one card" in slow.reason
    fast = choose_sharding(22.2 * GIB, 23 * GIB, 4, total_bytes_min=24 * GIB, link="nvlink", compute_ms_one_card=211.0)
    assert fast.slower_than_offload is False


def test_weights_travel_as_numpy_and_come_back_bit_for_bit():
    from patchray.distributed.sampling.weights import from_arrays, to_arrays

    g = torch.Generator().manual_seed(0)
    w = {
        "a": torch.randn(3, 4, generator=g),
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 6, generator=g).to(torch.float8_e4m3fn),
        "d": torch.arange(4, dtype=torch.int64),
    }
    arrays, views = to_arrays(w)
    assert views == {"b": "bfloat16", "c": "float8_e4m3fn"}
    assert arrays["a"].__array_interface__["data"][0] == w["a"].data_ptr()  # a view of the driver's tensor, no copy
    for copy in (False, True):
        back = from_arrays(arrays, views, copy=copy)
        for k, t in w.items():
            assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
        assert (back["a"].data_ptr() == w["a"].data_ptr()) is (not copy)


# W = 16 GiB, f = 0.75 in the blocks, N = 2, largest block 1 GiB, a 10 GiB card: reserve R = max(2, 3) = 3 GiB.
#   none:           W + R = 19 GiB
#   blocks:         W (f/N + 1 - f) + R = 16 x 0.625 + 3 = 13 GiB
#   blocks+offload: W (1 - f) + 2 x largest + R = 4 + 2 + 3 = 9 GiB
_ESCALATION = dict(world_size=2, total_bytes_min=10 * GIB, block_fraction=0.75, largest_block_bytes=1 * GIB)


@pytest.mark.parametrize("free_gib, want, still", [
    (19.0, "none", False), (18.99, "blocks", False), (13.0, "blocks", False), (12.99, "blocks+offload", False),
    (9.0, "blocks+offload", False), (8.99, "blocks+offload", True),
])
def test_auto_escalates_none_blocks_offload_at_the_hand_computed_thresholds(free_gib, want, still):
    c = choose_sharding(16 * GIB, free_gib * GIB, **_ESCALATION)
    assert c.sharding == want, (free_gib, c)
    if want == "blocks+offload":
        assert "still does not fit" in c.reason  # blocks alone did not
        assert ("and still does not fit: add ranks" in c.reason) is still  # offload neither
        assert "host -> device per model call" in c.reason
    # ranks computing on the host (CPU ranks): offloading to the host frees nothing, blocks is the last step
    capped = choose_sharding(16 * GIB, free_gib * GIB, offload=False, **_ESCALATION)
    assert capped.sharding == ("blocks" if want == "blocks+offload" else want), (free_gib, capped)
    assert offload_resident_bytes(16 * GIB, block_fraction=0.75, largest_block_bytes=1 * GIB) == 6 * GIB
    assert offload_resident_bytes(16 * GIB, block_fraction=0.75, largest_block_bytes=1 * GIB, prefetch=0) == 5 * GIB


def test_offload_cost_hand_computed_on_pcie4():
    # W = 27.6 GB: exactly one second over one PCIe 4.0 x16 host -> device copy (27.6 GB/s); all of it in blocks
    w = 27.6e9
    # no P2P, N = 2: each rank copies 13.8 GB (500 ms) and receives 13.8 GB staged through the host (2 x 500 ms)
    c = offload_cost(w, 2, "pcie4_x16_no_p2p", block_fraction=1.0)
    assert c.h2d_bytes == pytest.approx(13.8e9) and c.h2d_ms == pytest.approx(500.0)
    assert c.gather_ms == pytest.approx(1000.0) and c.step_ms == pytest.approx(1500.0) and c.one_card_ms == pytest.approx(1000.0)
    assert c.slower is True and "SLOWER than one card with ComfyUI's offload" in c.text
    # no P2P, N = 4: 250 ms copy + 2 x 0.75 x 1000 ms gather = 1750 ms, slower still (f W (2N-1) / (N B))
    c4 = offload_cost(w, 4, "pcie4_x16_no_p2p", block_fraction=1.0)
    assert c4.step_ms == pytest.approx(1750.0) and c4.slower
    # P2P with 97 % in the blocks: 0.97 x (500 + 500) = 970 ms < 1000 ms
    p2p = offload_cost(w, 2, "pcie4_x16_p2p", block_fraction=0.97)
    assert p2p.step_ms == pytest.approx(970.0) and p2p.slower is False and "faster than one card" in p2p.text
    # NVLink: 485 ms copy + 13.38 GB / 360 GB/s = 37.17 ms
    nv = offload_cost(w, 2, "nvlink", block_fraction=0.97)
    assert nv.gather_ms == pytest.approx(13.386e9 / 360e9 * 1e3) and nv.slower is False
    # compute-bound: 4 s on one card -> 2 s per rank hides the 1.5 s of transfers; one card: max(4 s, 1 s)
    cb = offload_cost(w, 2, "pcie4_x16_no_p2p", block_fraction=1.0, compute_ms_one_card=4000.0)
    assert (cb.step_ms, cb.one_card_ms, cb.slower) == (pytest.approx(2000.0), pytest.approx(4000.0), False)
    # link unknown: the copy is stated, no verdict
    un = offload_cost(w, 2, None, block_fraction=1.0)
    assert un.slower is None and un.gather_ms is None and "500 ms on PCIe 4.0 x16" in un.text


def test_host_memory_rule_keeps_a_headroom():
    # 10 % of the machine or 4 GiB, whichever is more
    assert host_headroom(24 * GIB) == 4 * GIB and host_headroom(128 * GIB) == pytest.approx(12.8 * GIB)
    assert host_fits(10 * GIB, 14 * GIB, 24 * GIB)  # 10 + 4 <= 14
    assert not host_fits(10 * GIB, 13.99 * GIB, 24 * GIB)
    assert host_fits(100 * GIB, 112.8 * GIB, 128 * GIB) and not host_fits(100 * GIB, 112.7 * GIB, 128 * GIB)
