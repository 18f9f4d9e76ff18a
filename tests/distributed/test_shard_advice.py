"""The sharding advice (``auto``), its cost model, and the weights' transport (numpy views, dtypes viewed back)."""

import pytest
import torch

from patchray.distributed.topology.links import get_profile
from patchray.distributed.topology.shard_advice import (
    GIB,
    activation_reserve,
    choose_sharding,
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
    # too big even sharded: blocks, and the reason says what else is needed
    assert "still does not fit" in choose_sharding(80 * GIB, 23.5 * GIB, 2, total_bytes_min=24 * GIB).reason
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
