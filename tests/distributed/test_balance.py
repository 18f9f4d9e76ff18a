"""Speed-weighted bands: the band table from weights, and exactness of weighted row decode and sampling on real
gloo ranks (ranks of unequal thread counts, so the measured speeds really differ).

Tolerances: row mode with weighted bands differs from the unsharded decode only in summation order, as with equal
bands (tests/distributed/test_row.py: 1e-4 absolute on outputs in about [-1, 1], fp32); sampling as in
tests/distributed/test_sampling.py (relative L2 2e-5 after 3 Euler steps).
"""

import functools

import numpy as np
import pytest
import torch

from patchray.distributed.cluster import ClusterConfig
from patchray.distributed.context import ParallelContext
from patchray.distributed.bands import band_heights, quantize_weights, row_bands, token_shards, weighted_split
from patchray.distributed.parallel.sequence import TokenShards
from patchray.distributed.spawn import run_ranks
from patchray.distributed.topology.throughput import check_balance, speed_weights

TOL = 1e-4
WEIGHTS = (3.0, 1.0)  # rank 0 three times as fast: bands of about 3/4 and 1/4


# ------------------------------------------------------------------------------------------ the table


def test_weighted_split_sums_and_follows_the_weights():
    for units in range(2, 40):
        for weights in ([1.0, 1.0], [3.0, 1.0], [1.0, 2.5, 0.7], [0.2, 0.2, 0.2, 5.0]):
            sizes = weighted_split(units, weights) if units >= len(weights) else None
            if sizes is None:
                continue
            assert sum(sizes) == units and min(sizes) >= 1
            # largest remainder: every share within one unit of its ideal when no rank needed lifting to the minimum
            total = sum(weights)
            ideal = [units * w / total for w in weights]
            if min(ideal) >= 1:
                assert all(abs(s - i) < 1.0 for s, i in zip(sizes, ideal)), (units, weights, sizes)
            # a faster rank never gets fewer units than a slower one
            for i in range(len(weights)):
                for j in range(len(weights)):
                    if weights[i] > weights[j]:
                        assert sizes[i] >= sizes[j], (units, weights, sizes)
    assert weighted_split(12, [3.0, 1.0]) == (9, 3)
    assert weighted_split(7, [1.0, 1.0, 1.0]) == (3, 2, 2)  # equal weights: the equal split (ties to the lower rank)


def test_equal_weights_give_the_equal_table():
    for h in range(4, 30):
        for n in (2, 3, 4):
            if h >= n:
                assert row_bands(h, n, weights=[0.5] * n) == row_bands(h, n)
                assert token_shards(h, n, weights=[2.0] * n) == token_shards(h, n)


def test_minimum_rows_and_refusal_when_a_band_would_be_empty():
    # a slow rank keeps the minimum, never an empty band
    assert weighted_split(10, [100.0, 1.0]) == (9, 1)
    assert weighted_split(10, [100.0, 1.0], min_units=3) == (7, 3)
    assert row_bands(10, 2, min_rows=3, weights=[100.0, 1.0]) == [(0, 7), (7, 10)]
    with pytest.raises(ValueError, match="a band would be empty"):
        weighted_split(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="use at most 1 ranks"):
        row_bands(3, 2, min_rows=2, weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="one figure per rank"):
        row_bands(8, 2, weights=[1.0, 1.0, 1.0])
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="positive finite"):
            quantize_weights([1.0, bad], 2)


def test_aligned_bands_are_whole_units():
    rows = band_heights(64, 2, 8, weights=WEIGHTS)
    assert rows == (48, 16) and all(r % 8 == 0 for r in rows)
    assert token_shards(24, 3, 4, weights=[1.0, 2.0, 3.0]) == (4, 8, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        band_heights(60, 2, 8, weights=WEIGHTS)
    with pytest.raises(ValueError, match="every rank needs one"):
        band_heights(8, 2, 8, weights=WEIGHTS)
    shards = TokenShards.split(2, 12, 5, 2, weights=WEIGHTS)
    assert shards.row_sizes == (9, 3) and shards.counts == (2 * 9 * 5, 2 * 3 * 5)


def test_the_table_does_not_depend_on_float_noise_below_the_quantum():
    # figures that differ below a part per million of the largest give the same table
    assert weighted_split(1000, [1.0, 0.3333333]) == weighted_split(1000, [1.0 + 1e-9, 0.33333331])
    assert speed_weights([80.0, 41.0]) == (1.0, 0.51) == speed_weights([80.3, 41.1])


def test_context_and_config_refuse_bad_weights_and_threads():
    ctx = ParallelContext.single()
    assert ctx.band_weights is None and ctx.with_band_weights([2]).band_weights == (2.0,)
    with pytest.raises(ValueError, match="one figure per rank"):
        ctx.with_band_weights([1.0, 2.0])
    with pytest.raises(ValueError, match="positive finite"):
        ctx.with_band_weights([0.0])
    assert ClusterConfig(num_ranks=2, device="cpu", rank_threads=(2, 1)).rank_threads == (2, 1)
    with pytest.raises(ValueError, match="one per rank"):
        ClusterConfig(num_ranks=2, device="cpu", rank_threads=(2,))
    with pytest.raises(ValueError, match="thread counts >= 1"):
        ClusterConfig(num_ranks=2, device="cpu", rank_threads=(2, 0))
    with pytest.raises(ValueError, match="device is 'cuda'"):
        ClusterConfig(num_ranks=2, device="cuda", rank_threads=(2, 1))
    assert check_balance("speed") == "speed"
    with pytest.raises(ValueError, match="equal, speed"):
        check_balance("fast")


# ------------------------------------------------------------------------------------------ on real ranks


def _latent(family, h, seed=1):
    from patchray.distributed.vae.families import FAMILIES

    spec = FAMILIES[family]
    c = spec.tiny_config.get("latent_channels", spec.tiny_config.get("z_dim", spec.latent_channels))
    shape = (1, c) + ((2,) if spec.is_video else ()) + (h, 5)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rank_task(ctx):
    from patchray.distributed.comm import all_gather_object
    from patchray.distributed.sampling import sdxl
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.denoiser import PatchParallelDenoiser
    from patchray.distributed.topology.throughput import rank_speeds_task
    from patchray.distributed.vae.families import build_vae
    from patchray.distributed.vae.row import row_decode, row_encode

    out = {"threads": torch.get_num_threads()}
    out["one_rank"] = _reference_on_one_rank(ctx)
    speeds = rank_speeds_task(ctx, repeats=3)
    weights = speed_weights(speeds)
    out["speeds"] = speeds
    out["tables"] = all_gather_object((row_bands(37, 2, weights=weights), band_heights(64, 2, 8, weights=weights)), ctx)
    with torch.no_grad():
        for family in ("kl", "wan"):
            out[family] = row_decode(build_vae(family), _latent(family, 9), ctx, weights=WEIGHTS)
        x = torch.rand(1, 3, 72, 40, generator=torch.Generator().manual_seed(2)) * 2 - 1
        out["encode"] = row_encode(build_vae("kl"), x, ctx.with_band_weights(WEIGHTS))  # weights from the context
    unet = sdxl.build_unet(True)
    cond = sdxl.synthetic_cond(unet, 1)
    lat = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(5))
    den = PatchParallelDenoiser(sdxl.unet_denoiser(unet), ctx.with_band_weights(WEIGHTS), preset("full_sync", split_batch=False), unet=unet)
    with torch.no_grad():
        out["unet"] = den.finalize(sdxl.sample_euler_cfg(den, lat, cond, 3))
    out["unet_rows"] = tuple(den.rows)
    den.remove()
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _reference_on_one_rank(ctx):
    """The benchmark's reference measurement: rank 0 runs the work, the other ranks only wait."""
    import types

    from patchray.distributed.bench.measure import measure_on_one_rank

    calls = []
    opts = types.SimpleNamespace(warmup=1, iters=2, timing="concurrent", profile=False, profile_trace=False,
                                 profile_memory=False, timeout_s=60.0)
    m, _ = measure_on_one_rank(ctx, opts, lambda: calls.append(ctx.rank), "ref")
    return len(calls), len(m["times_ms"]), bool(m.get("waited"))


@functools.lru_cache(maxsize=None)
def _spawned():
    return run_ranks(_rank_task, 2, threads=(2, 1), timeout_s=240)


def test_every_rank_agrees_on_the_figures_and_the_table():
    a, b = _spawned()
    assert (a["threads"], b["threads"]) == (2, 1)
    assert a["speeds"] == b["speeds"] and all(s > 0 for s in a["speeds"])
    assert a["tables"][0] == a["tables"][1] == b["tables"][0] == b["tables"][1]


def test_the_benchmark_reference_runs_on_rank_0_while_the_others_wait():
    a, b = _spawned()
    assert a["one_rank"] == (1 + 1 + 2, 2, False)  # warm-up, logged, 2 timed
    assert b["one_rank"] == (0, 0, True)


def test_weighted_row_decode_and_encode_equal_the_unsharded_ones():
    from patchray.distributed.vae.families import build_vae

    a, b = _spawned()
    with torch.no_grad():
        for family in ("kl", "wan"):
            ref = build_vae(family).decode(_latent(family, 9)).sample
            got = torch.from_numpy(a[family])
            assert ref.std() > 1e-3 and got.shape == ref.shape
            diff = (got - ref).abs().max().item()
            assert diff <= TOL, f"{family}: weighted bands differ from the unsharded decode by {diff:.3g}"
            assert b[family] is None
        x = torch.rand(1, 3, 72, 40, generator=torch.Generator().manual_seed(2)) * 2 - 1
        ref = build_vae("kl").encode(x).latent_dist.mean
        assert (torch.from_numpy(a["encode"]) - ref).abs().max().item() <= TOL


def test_weighted_unet_bands_sample_the_single_rank_latent():
    from patchray.distributed.sampling import sdxl

    a, b = _spawned()
    assert a["unet_rows"] == b["unet_rows"] == (24, 8)  # 32 rows, align 4: 8 units split 3:1
    unet = sdxl.build_unet(True)
    cond = sdxl.synthetic_cond(unet, 1)
    lat = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = sdxl.sample_euler_cfg(sdxl.unet_denoiser(unet), lat, cond, 3)
    for res in (a, b):
        x = torch.from_numpy(res["unet"])
        rel = ((x - ref).norm() / ref.norm()).item()
        assert rel < 2e-5, f"relative L2 {rel:.2e} vs the single-rank run"
    assert np.array_equal(a["unet"], b["unet"])
