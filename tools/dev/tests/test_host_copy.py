"""The host-copy bench's GPU-rank path, run on real gloo CPU ranks with a tiny FLUX transformer: the generic
skeleton (meta build in one dtype, constructor tensors such as Wan's RoPE tables from a one-block build) receives the weights through
the node's transport (``sampling.ship``) whole or block-sharded, and both give the driver's own forward (FLUX.1;
Wan 2.1 sharded, whose RoPE tables are not shipped but rebuilt on the ranks)."""

from __future__ import annotations

import pytest

from tools.dev import host_copy


def test_cases_are_checked_before_ray_starts():
    with pytest.raises(ValueError, match="TRANSPORT:SHARDING"):
        host_copy.measure([("parts", "blocks+offload")], model="flux1-tiny")
    with pytest.raises(ValueError, match="wan-small"):
        host_copy.measure([("numpy", "blocks")], model="flux1-tiny")


def test_tiny_flux_and_wan_parts_on_two_cpu_ranks():
    recs = host_copy.measure([("parts", "blocks"), ("parts", "none"), ("parts", "blocks", "wan21-tiny")], ranks=2,
                             part_bytes=16 * 1024, model="flux1-tiny", later=0, log=lambda *_: None)
    by = {r["sharding"]: r for r in recs if r["model"] == "flux1-tiny"}
    size = by["none"]["model_bytes"]
    for r in recs:
        ref = r["reference_output_norm"]
        assert ref is not None and ref > 0
        # bf16 weights and activations on both sides; the ranks run the same kernels with another thread count (the
        # GEMMs' blocking, hence the bf16 rounding, may differ): 2e-2 relative is about three bf16 steps
        assert all(abs(n - ref) <= 2e-2 * ref for n in r["output_norms"]), (r["sharding"], r["output_norms"], ref)
        assert r["outputs_agree"]
        # the host peak was read (PSS of the driver and its rank processes); its excess over the baseline is the
        # figure at full size, but a tiny model's few hundred kB sit within the drift of PSS itself (pages shared with
        # processes that start or exit elsewhere on the machine change every sharer's share): it may read below 0 here
        assert r["baseline_pss_bytes"] > 0 and r["baseline_pss_bytes"] + r["first_prompt_peak_above_baseline_bytes"] > 0
    # none: every rank holds the whole model (on the host: CPU ranks); blocks: each rank holds its share of the
    # blocks and the rest whole, so less than the model but more than half of it together with the other rank
    assert by["none"]["rank_local_weight_bytes"] == [size, size]
    assert by["none"]["rank_host_weight_bytes"] == [size, size]
    local = by["blocks"]["rank_local_weight_bytes"]
    assert all(x < size for x in local) and sum(local) >= size
