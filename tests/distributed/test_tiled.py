"""Tiled decode: tile-runs equals local for the same plan (real gloo ranks), GroupNorm-synced tiles get closer
to the untiled decode than plain tiles, seam errors on a hand-computed geometry, refusals.

Tiny synthetic VAEs (families.build_vae(..., "tiny")) and small latents keep this CPU-only. Exact plans may use
tiles under the planner's sixteen-latent floor (``min_tile_latent=8``) to stay cheap: the blend, exchange and
statistics code paths do not depend on the tile size.
"""

import functools

import pytest
import torch
from torch import nn

from patchray.distributed.comm import log_comm
from patchray.distributed.context import ParallelContext
from patchray.distributed.parallel.plan import is_adapted
from patchray.distributed.spawn import run_ranks
from patchray.distributed.vae.families import FAMILIES, build_vae, latent_shape
from patchray.distributed.vae.planner import exact_plan
from patchray.distributed.vae.tiled import (
    decode_local,
    decode_row_tiled,
    decode_tile_runs,
    seam_error,
)

GROUPNORM_FAMILIES = ("kl", "flux2", "hunyuan_video")
GROUPNORM_FAMILIES += ("hunyuan_image", "hunyuan_video_full_attention", "mochi", "hunyuan_refiner_conv3d", "cosmos")


def _latent(family, lat_h, lat_w, frames=1, batch=1, seed=1):
    """A fresh random latent whose tone varies smoothly across the image.

    Real latents change tone from region to region; with stationary noise every tile would see the image's
    statistics and there would be no per-tile drift to measure.
    """
    r = FAMILIES[family].spatial_ratio
    shape = latent_shape(family, lat_h * r, lat_w * r, frames, batch, size="tiny")
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    yy = torch.linspace(-1.5, 1.5, lat_h)[:, None]
    xx = torch.linspace(-1.0, 1.0, lat_w)[None, :]
    return z * (1 + 0.5 * (yy + xx).abs()) + 2 * (yy - xx)


def _plan(family, lat_h, lat_w, frames, ranks, window, overlap):
    """An exact plan from latent-unit window/overlap."""
    r = FAMILIES[family].spatial_ratio
    return exact_plan(
        family, lat_h * r, lat_w * r, frames, ranks, (window[0] * r, window[1] * r), (overlap[0] * r, overlap[1] * r),
        min_tile_latent=8,
    )


def _gn_patched(vae):
    """Whether any GroupNorm still carries an instance-level forward or an adapter marker."""
    return any("forward" in m.__dict__ or is_adapted(m) for m in vae.modules() if isinstance(m, nn.GroupNorm))


def _untiled(vae, z):
    from patchray.distributed.vae.row import _decode_band

    with torch.no_grad():  # the plain decode with the family's options (LTX-Video's decode timestep)
        return _decode_band(vae, z)


# ------------------------------------------------------------------------------ tile-runs on real ranks

# (family, latent h, w, frames, batch, window, overlap, gn_sync): a 2-D grid of 6 tiles (at 3 ranks a tile's
# neighbour above belongs to a non-adjacent rank) and a 5-D video latent with a triple overlap (overlap > stride)
# and an untiled axis; each through plain and GroupNorm-synced tiles over the two world sizes (batch 2 checks
# per-sample statistics). One spawn per world size keeps start-up cost down.
_KL = ("kl", 32, 48, 1, 2, (20, 20), (6, 6))
_VIDEO = ("hunyuan_video", 16, 32, 1, 1, (16, 20), (0, 12))
_CASES = {2: (_KL + (True,), _VIDEO + (False,)), 3: (_KL + (False,), _VIDEO + (True,))}


def _tile_runs_task(ctx, cases, row_tiled):
    torch.manual_seed(0)
    results = []
    vaes = {}
    for family, lat_h, lat_w, frames, batch, window, overlap, gn in cases:
        vae = vaes.setdefault(family, build_vae(family))
        z = _latent(family, lat_h, lat_w, frames, batch)
        plan = _plan(family, lat_h, lat_w, frames, ctx.world_size, window, overlap)
        with log_comm() as log:
            out = decode_tile_runs(vae, z, plan, ctx, gn_sync=gn)
        hooks_left = _gn_patched(vae)
        entry = {"calls": dict(log.calls), "none": out is None, "hooks_left": hooks_left, "tiles": plan.tile_count}
        if ctx.rank == 0:
            local = decode_local(vae, z, plan, gn_sync=gn)
            entry.update(max_abs=float((out - local).abs().max()), shape=tuple(out.shape), local_shape=tuple(local.shape))
        results.append(entry)
    if row_tiled:
        vae = vaes.setdefault("kl", build_vae("kl"))
        z = _latent("kl", 32, 48)
        plan = _plan("kl", 32, 48, 1, ctx.world_size, (20, 20), (6, 6))
        out = decode_row_tiled(vae, z, plan, ctx)
        entry = {"none": out is None}
        if ctx.rank == 0:
            entry["max_abs"] = float((out - decode_local(vae, z, plan)).abs().max())
        results.append(entry)
    return results


@functools.lru_cache(maxsize=None)
def _tile_runs(world_size):
    return run_ranks(_tile_runs_task, world_size, _CASES[world_size], world_size == 2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tile_runs_equals_local(world_size):
    per_rank = _tile_runs(world_size)
    for i, case in enumerate(_CASES[world_size]):
        family, gn = case[0], case[-1]
        lead = per_rank[0][i]
        assert lead["tiles"] >= world_size
        assert not lead["none"] and lead["shape"] == lead["local_shape"]
        # Same tiles decoded by the same code, blended with the same weights in the same order: equal up to float
        # rounding. Observed bitwise on CPU; 1e-5 leaves room for fp64 statistics merged in a different grouping.
        assert lead["max_abs"] <= 1e-5, (family, gn, lead["max_abs"])
        for rank, results in enumerate(per_rank):
            entry = results[i]
            assert entry["none"] == (rank != 0), "only the caller (group rank 0) receives the image"
            assert not entry["hooks_left"]
            # one edge exchange and one gather to the caller; GN sync adds one all-gather (every layer's statistics)
            # per statistics pass: one per resolution level, four for these 8x decoders (x1, x2, x4, x8)
            expected = {"batch_isend_irecv": 1, "gather": 1}
            if gn:
                expected["all_gather"] = 4
            assert entry["calls"] == expected, (rank, family, gn, entry["calls"])


def test_row_tiled_equals_local():
    per_rank = _tile_runs(2)
    lead = per_rank[0][-1]
    assert not lead["none"] and per_rank[1][-1]["none"]
    # row mode reproduces each tile's single-device decode up to reduction-order noise (fp32)
    assert lead["max_abs"] <= 1e-4, lead["max_abs"]


# ------------------------------------------------------------------------------ local tiling and GN sync


def test_one_tile_is_the_untiled_decode():
    vae = build_vae("kl")
    z = _latent("kl", 24, 32, batch=2)
    plan = _plan("kl", 24, 32, 1, 1, (24, 32), (0, 0))
    ref = _untiled(vae, z)
    assert torch.equal(decode_local(vae, z, plan), ref)  # weight 1 everywhere, divided by 1
    # image-wide statistics of a single tile are the image's: equal up to fp32 normalization rounding
    assert (decode_local(vae, z, plan, gn_sync=True) - ref).abs().max() <= 1e-4
    # bf16 weights (the GPU dtype): the fp32 latent is cast to the VAE's dtype and GN sync normalizes in fp32
    # chunks. Both bf16 decodes carry bf16 rounding through ~30 layers (~1.7% of the fp32 output here), so the
    # synced one must be as close to the fp32 decode as diffusers' own bf16 decode (25% slack for rounding luck)
    vae16 = build_vae("kl", dtype=torch.bfloat16)
    native16 = _untiled(vae16, z.to(torch.bfloat16))
    synced16 = decode_local(vae16, z, plan, gn_sync=True)
    assert synced16.dtype == torch.bfloat16
    err = lambda out: float((out.float() - ref).abs().mean())  # noqa: E731
    assert err(synced16) <= 1.25 * err(native16)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gn_sync_is_closer_to_the_untiled_decode(family):
    spec = FAMILIES[family]
    has_gn = any(isinstance(m, nn.GroupNorm) for m in build_vae(family).modules())
    assert has_gn == (family in GROUPNORM_FAMILIES), "the families table changed: update GROUPNORM_FAMILIES"
    vae = build_vae(family)
    if has_gn:
        lat_h, lat_w = (32, 48) if not spec.is_video else (24, 32)
        window, overlap = (lat_h // 2 + 4, lat_w // 2 + 4), (8, 8)
        if spec.spatial_ratio == 32:  # HunyuanImage: 32 px per latent row; a smaller latent keeps the test quick
            lat_h, lat_w = 12, 16
            window, overlap = (8, 10), (4, 4)
    else:
        lat_h, lat_w = 16, 24
        window, overlap = (16, 16), (0, 8)
    z = _latent(family, lat_h, lat_w)
    plan = _plan(family, lat_h, lat_w, 1, 1, window, overlap)
    ref = _untiled(vae, z)
    plain = decode_local(vae, z, plan)
    synced = decode_local(vae, z, plan, gn_sync=True)
    assert plain.shape == synced.shape == ref.shape
    plain_err = seam_error(plain, ref, plan)
    synced_err = seam_error(synced, ref, plan)
    print(f"\n{family}: tiles {plan.grid} plain {plain_err} | gn_sync {synced_err}")
    assert not _gn_patched(vae)
    if has_gn:
        assert synced_err["mean_abs"] < plain_err["mean_abs"]
    else:
        # per-position RMS norms hold no spatial statistics: nothing to sync, and no second pass is run
        assert torch.equal(synced, plain)


def test_seam_error_on_a_known_geometry():
    # kl (8 px per latent): a 32x48 latent is 256x384 px; 20x28-latent windows with 8-latent overlaps give a 2x2
    # grid with tiles starting at rows 0/96 and columns 0/160, i.e. overlaps at rows [96, 160) and cols [160, 224)
    plan = _plan("kl", 32, 48, 1, 1, (20, 28), (8, 8))
    assert plan.tiles_pixels == ((0, 160, 0, 224), (0, 160, 160, 384), (96, 256, 0, 224), (96, 256, 160, 384))
    reference = torch.zeros(2, 3, 256, 384)
    seams = torch.zeros(256, 384, dtype=torch.bool)
    seams[96:160, :] = True
    seams[:, 160:224] = True
    image = reference + torch.where(seams, 1.0, 0.25)  # error 1 inside the overlaps, 0.25 elsewhere
    err = seam_error(image, reference, plan)
    # the overlaps cover 64*384 + 256*64 - 64*64 = 36864 of 98304 pixels (3/8)
    assert err == {"mean_abs": 3 / 8 * 1.0 + 5 / 8 * 0.25, "max_abs": 1.0, "seam_mean_abs": 1.0, "interior_mean_abs": 0.25}
    # band=8: only 16 rows/columns around each seam's centre (row 128, column 192) count as the seam
    centre = torch.zeros(256, 384, dtype=torch.bool)
    centre[120:136, :] = True
    centre[:, 184:200] = True
    image = reference + torch.where(centre, 1.0, 0.0)
    err = seam_error(image, reference, plan, band=8)
    assert err["seam_mean_abs"] == 1.0 and err["interior_mean_abs"] == 0.0


# ------------------------------------------------------------------------------ refusals


def test_refusals():
    vae = build_vae("kl")
    z = _latent("kl", 32, 48)
    plan = _plan("kl", 32, 48, 1, 2, (20, 28), (8, 8))
    with pytest.raises(ValueError, match="plan was made for"):
        decode_local(vae, z[..., :24, :], plan)
    with pytest.raises(ValueError, match="4-D"):
        decode_local(vae, z[0], plan)
    with pytest.raises(ValueError, match="plan for world_size=1"):
        decode_tile_runs(vae, z, plan, ParallelContext.single())
    wrong_ratio = exact_plan("ltx2", 32 * 32, 48 * 32, 1, 1, (20 * 32, 28 * 32), (8 * 32, 8 * 32), min_tile_latent=8)
    with pytest.raises(ValueError, match="does not match the VAE"):
        decode_local(vae, z, wrong_ratio)


def test_gn_sync_forwards_are_removed_after_a_failure():
    vae = build_vae("kl")
    z = _latent("kl", 32, 48)
    plan = _plan("kl", 32, 48, 1, 1, (20, 28), (8, 8))
    calls = {"n": 0}
    real_decode = vae.decode

    def failing_decode(x):  # fails in the second (apply) pass, with every replacement installed
        calls["n"] += 1
        if calls["n"] > plan.tile_count:
            raise RuntimeError("boom")
        return real_decode(x)

    vae.decode = failing_decode
    with pytest.raises(RuntimeError, match="boom"):
        decode_local(vae, z, plan, gn_sync=True)
    assert calls["n"] == plan.tile_count + 1
    assert not _gn_patched(vae)
    del vae.decode
    ref = decode_local(vae, z, plan)
    assert torch.equal(ref, decode_local(build_vae("kl"), z, plan))  # the VAE decodes as before


def test_gn_sync_modes():
    vae = build_vae("kl")
    z = _latent("kl", 24, 32, seed=4)
    plan = _plan("kl", 24, 32, 1, 1, (16, 20), (8, 8))
    ref = _untiled(vae, z)
    errors = {mode: seam_error(decode_local(vae, z, plan, gn_sync=mode), ref, plan)["mean_abs"] for mode in (False, "two-pass", True, "exact")}
    print(f"\nkl gn_sync modes, tiles {plan.grid}: {errors}")
    # lockstep statistics are the best estimate of the image-wide ones, per-level passes the next best
    assert errors["exact"] < errors[True] < errors[False]
    # "two-pass" is reported, not asserted: its estimate is biased by per-tile normalization upstream and can
    # land above plain tiles (it does on this geometry), which is why it is not the default
    assert not _gn_patched(vae)
    with pytest.raises(ValueError, match="gn_sync must be"):
        decode_local(vae, z, plan, gn_sync="always")


def test_tile_runs_on_one_rank_is_local():
    vae = build_vae("kl")
    z = _latent("kl", 32, 48, seed=5)
    plan = _plan("kl", 32, 48, 1, 1, (20, 28), (8, 8))
    with log_comm() as log:
        out = decode_tile_runs(vae, z, plan, ParallelContext.single())
    assert log.total_calls == 0  # one rank: no exchange, no gather
    assert torch.equal(out, decode_local(vae, z, plan))
