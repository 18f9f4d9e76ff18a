"""Distributed VAE Decode / Encode nodes with ComfyUI-shaped inputs (LATENT dict, IMAGE [B,H,W,C], a VAE object
holding ComfyUI's ldm-layout weights) on real CPU Ray ranks, compared with a stand-in of ComfyUI's VAE: the stock
nodes' pre/post-processing around a one-process diffusers decode/encode of the same weights. The comparison with
ComfyUI's own VAE Decode is the opt-in test in tests/comfyui."""

import pytest
import torch

from .comfy_shapes import ComfyLikeVAE, kl_to_ldm

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def cluster():
    from patchray.nodes.cluster import PatchRayCluster

    return PatchRayCluster.execute(num_ranks=2, device="cpu", address="", gpu_ids="").args[0]


def _kl_vae(levels):
    from diffusers import AutoencoderKL

    torch.manual_seed(3)
    model = AutoencoderKL(
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        block_out_channels=[32] * levels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ComfyLikeVAE(model, kl_to_ldm(model.state_dict(), levels))


@pytest.fixture(scope="module")
def vae8():
    return _kl_vae(4)  # spatial ratio 8, like every KL VAE ComfyUI loads


def test_row_decode_matches_a_one_process_decode_with_comfyuis_processing(cluster, vae8):
    from patchray.nodes.vae import PatchRayVAEDecode

    z = torch.randn(2, 4, 12, 10)
    out = PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=cluster, mode="row", precision="fp32", gn_sync=False)
    image = out.args[0]
    stock = vae8.decode(z)
    assert image.shape == stock.shape == (2, 96, 80, 3) and image.dtype == torch.float32
    # the bound for fp32: within 1/255 of the one-process decode (row mode is exact up to fp32 reassociation)
    assert (image - stock).abs().max() <= 1 / 255
    assert out.ui is None  # no fallback warning


def test_tile_runs_decode_with_a_planner_plan(cluster, vae8):
    from patchray.nodes.planner import PatchRayTilePlanner
    from patchray.nodes.vae import PatchRayVAEDecode

    plan = PatchRayTilePlanner.execute(family="kl", width=128, height=256, frames=1, ranks=2, choice="coarse").args[0]
    z = torch.randn(1, 4, 32, 16)
    image = PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=cluster, mode="tile-runs", precision="fp32",
                                      gn_sync=True, plan=plan).args[0]
    stock = vae8.decode(z)
    assert image.shape == stock.shape == (1, 256, 128, 3)
    assert 0.0 <= image.min() and image.max() <= 1.0
    # tiles see less context than the full decode: close on average, not exact (random weights amplify seams)
    assert (image - stock).abs().mean() < 0.1


def test_a_plan_for_another_rank_count_is_refused(cluster, vae8):
    from patchray.nodes.planner import PatchRayTilePlanner
    from patchray.nodes.vae import PatchRayVAEDecode

    plan = PatchRayTilePlanner.execute(family="kl", width=128, height=512, frames=1, ranks=3, choice="coarse").args[0]
    with pytest.raises(ValueError, match="ranks"):
        PatchRayVAEDecode.execute(samples={"samples": torch.randn(1, 4, 64, 16)}, vae=vae8, cluster=cluster, mode="tile-runs",
                                  precision="fp32", gn_sync=False, plan=plan)


def test_encode_matches_a_one_process_encode_with_comfyuis_cropping(cluster, vae8):
    from patchray.nodes.vae import PatchRayVAEEncode

    pixels = torch.rand(1, 100, 84, 3)  # not multiples of 8: cropped to 96x80 about the centre, as ComfyUI does
    latent = PatchRayVAEEncode.execute(pixels=pixels, vae=vae8, cluster=cluster, precision="fp32").args[0]
    stock = vae8.encode(pixels[:, 2:98, 2:82, :])
    assert set(latent) == {"samples"} and latent["samples"].shape == stock.shape == (1, 4, 12, 10)
    # row-sharded encode is exact up to fp32 reassociation in the exchanged statistics
    torch.testing.assert_close(latent["samples"], stock, rtol=1e-4, atol=1e-4)


def test_unsupported_family_falls_back_to_the_vaes_own_decode_with_a_warning(cluster):
    from patchray.nodes.vae import PatchRayVAEDecode

    vae = _kl_vae(2)
    vae.first_stage_model._sd = {"taesd_decoder.1.weight": torch.zeros(64, 4, 3, 3)}  # a VAE PatchRay cannot shard
    z = torch.randn(1, 4, 8, 8)
    out = PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae, cluster=cluster, mode="auto", precision="auto", gn_sync=False)
    assert vae.decode_calls == 1 and torch.equal(out.args[0], vae.decode(z))
    assert "cannot shard" in out.ui.value and "TAESD" in out.ui.value


@pytest.mark.parametrize(
    "samples, error",
    [(torch.zeros(1, 4, 8, 8), TypeError), ({"samples": torch.zeros(4, 8, 8)}, ValueError), ({"noise": 1}, TypeError)],
)
def test_bad_latents_are_refused_before_the_ranks_run(cluster, vae8, samples, error):
    from patchray.nodes.vae import PatchRayVAEDecode

    with pytest.raises(error):
        PatchRayVAEDecode.execute(samples=samples, vae=vae8, cluster=cluster, mode="row", precision="fp32", gn_sync=False)


def test_a_non_vae_is_refused(cluster):
    from patchray.nodes.vae import PatchRayVAEDecode

    with pytest.raises(TypeError, match="VAE"):
        PatchRayVAEDecode.execute(samples={"samples": torch.zeros(1, 4, 8, 8)}, vae="not a vae", cluster=cluster, mode="row",
                                  precision="fp32", gn_sync=False)


def test_a_dead_rank_fails_the_prompt_clearly_and_the_next_prompt_works(cluster, vae8):
    import ray

    from patchray.distributed.cluster import RankFailure, get_cluster
    from patchray.nodes.vae import PatchRayVAEDecode

    z = torch.randn(1, 4, 8, 8)
    run = lambda: PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=cluster, mode="row", precision="fp32", gn_sync=False)
    ray.kill(get_cluster(cluster)._actors[1], no_restart=True)  # a rank process dies between prompts
    with pytest.raises(RankFailure, match="rank 1"):
        run()
    image = run().args[0]  # the next prompt rebuilds the ranks and resends the weights
    assert (image - vae8.decode(z)).abs().max() <= 1 / 255


def test_speed_balanced_row_decode_and_encode_match_the_one_process_ones(cluster, vae8):
    from patchray.distributed.cluster import get_cluster
    from patchray.distributed.topology import throughput
    from patchray.nodes.vae import PatchRayVAEDecode, PatchRayVAEEncode

    throughput.clear_speed_cache()
    z = torch.randn(1, 4, 12, 10)
    image = PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=cluster, mode="row", precision="fp32",
                                      gn_sync=False, balance="speed").args[0]
    # the speeds were measured on the ranks once, and cached for this cluster
    speeds = throughput.cached_rank_speeds(("rank-speed", repr(get_cluster(cluster).config)), lambda: pytest.fail("re-measured"))
    assert len(speeds) == 2 and min(speeds) > 0
    # the bound for fp32 as above: any band table is exact up to fp32 reassociation
    assert (image - vae8.decode(z)).abs().max() <= 1 / 255
    pixels = torch.rand(1, 64, 48, 3, generator=torch.Generator().manual_seed(4))
    latent = PatchRayVAEEncode.execute(pixels=pixels, vae=vae8, cluster=cluster, precision="fp32", balance="speed").args[0]
    assert (latent["samples"] - vae8.encode(pixels)).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="'balance' must be one of equal, speed"):
        PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=cluster, mode="row", balance="fastest")


def test_balance_widgets_have_tooltips():
    from patchray.nodes.ksampler import PatchRayKSampler
    from patchray.nodes.vae import PatchRayVAEDecode, PatchRayVAEEncode

    for node in (PatchRayVAEDecode, PatchRayVAEEncode, PatchRayKSampler):
        inputs = {i.id: i for i in node.define_schema().inputs}
        assert list(inputs["balance"].options) == ["equal", "speed"] and inputs["balance"].default == "equal"
        assert "speed" in inputs["balance"].tooltip and inputs["balance"].optional


def test_a_row_decode_that_differs_from_comfyuis_own_is_refused_by_the_exactness_check(cluster, tmp_path):
    """The runtime exactness check on a VAE whose weights as PatchRay reads them differ from the ones ComfyUI decodes
    with (what a changed key layout in a newer ComfyUI would do: two up-block convolutions exchanged, every shape the
    same): the first decode compares a small crop, refuses row mode and decodes as stock, with the reason on the node;
    the verdict is kept, so the next decode is refused without decoding on the ranks; a faithful VAE passes."""
    import json

    from diffusers import AutoencoderKL

    from patchray.nodes.vae import PatchRayVAEDecode

    torch.manual_seed(5)
    model = AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                          block_out_channels=[32, 32], latent_channels=4, norm_num_groups=32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    drifted = kl_to_ldm(model.state_dict(), 2)
    a, b = "decoder.up.0.block.0.conv1.weight", "decoder.up.0.block.1.conv1.weight"
    assert a in drifted and b in drifted and drifted[a].shape == drifted[b].shape
    drifted[a], drifted[b] = drifted[b].clone(), drifted[a].clone()
    vae = ComfyLikeVAE(model, drifted)
    z = torch.randn(1, 4, 12, 10)
    for attempt in range(2):
        out = PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae, cluster=cluster, mode="row", precision="fp32",
                                        gn_sync=False)
        assert torch.equal(out.args[0], vae.decode(z))  # ComfyUI's own decode, not the drifted row decode
        note = " ".join(out.ui.as_dict()["text"])
        assert "row mode is refused" in note and "exactness check" in note, note
    kept = json.loads((tmp_path / "patchray-cache" / "exactness.json").read_text())
    assert [v["ok"] for v in kept.values()] == [False] and list(kept.values())[0]["error"] > 1e-2
    # the same VAE read faithfully passes (a fresh cache folder: a verdict is per layout and versions)
    (tmp_path / "patchray-cache" / "exactness.json").unlink()
    faithful = ComfyLikeVAE(model, kl_to_ldm(model.state_dict(), 2))
    out = PatchRayVAEDecode.execute(samples={"samples": z}, vae=faithful, cluster=cluster, mode="row", precision="fp32",
                                    gn_sync=False)
    assert out.ui is None and (out.args[0] - faithful.decode(z)).abs().max() <= 1 / 255
    kept = json.loads((tmp_path / "patchray-cache" / "exactness.json").read_text())
    assert [v["ok"] for v in kept.values()] == [True] and list(kept.values())[0]["error"] < 1e-3
