"""Checks made before any rank works, in the nodes' terms: the Tile Planner's requests and preview size, the
Distributed KSampler's rows against the ranks, a plan against its latent. No ranks needed."""

import time

import pytest
import torch

GiB = 2**30


def test_tile_planner_refuses_what_cannot_be_useful_at_once_with_the_nearest_request():
    from patchray.nodes.planner import PatchRayTilePlanner

    t0 = time.monotonic()
    # inside the widgets' limits; it used to plan for 20 s, then draw a 12 GB preview
    with pytest.raises(ValueError, match=r"family kl decodes single images: set frames to 1"):
        PatchRayTilePlanner.execute(family="kl", width=16384, height=16384, frames=4096, ranks=64, choice="balanced")
    with pytest.raises(ValueError, match=r"GiB IMAGE \(float32\), more than this machine's .* set frames to \d+ or fewer at 16384x16384"):
        PatchRayTilePlanner.execute(family="wan", width=16384, height=16384, frames=4093, ranks=64, choice="balanced")
    assert time.monotonic() - t0 < 2


def test_tile_planner_request_rules():
    from patchray.nodes.bridge.validate import tile_planner_request

    tile_planner_request("wan", 832, 480, 81, 2, memory_bytes=32 * GiB)  # fine
    with pytest.raises(ValueError, match=r"wan decodes 4k \+ 1 frames .*set frames to 81 or 85"):
        tile_planner_request("wan", 832, 480, 82, 2, memory_bytes=32 * GiB)
    # 1024x1024 float32 RGB is 12 MiB a frame: 1 GiB holds 85 frames, the nearest 4k + 1 below is 85
    with pytest.raises(ValueError, match=r"set frames to 85 or fewer at 1024x1024"):
        tile_planner_request("wan", 1024, 1024, 401, 2, memory_bytes=1 * GiB)
    with pytest.raises(ValueError, match=r"lower width and height"):
        tile_planner_request("kl", 16384, 16384, 1, 2, memory_bytes=1 * GiB)


def test_the_preview_is_capped_and_the_plan_wire_is_not():
    from patchray.nodes.bridge.preview import PREVIEW_MAX_SIDE, _font_size, legend_height
    from patchray.nodes.planner import PatchRayTilePlanner

    plan, preview, text = PatchRayTilePlanner.execute(family="kl", width=8192, height=4096, frames=1, ranks=4, choice="coarse").args
    assert (plan["width"], plan["height"]) == (8192, 4096)  # the wire: full size
    assert preview.shape == (1, PREVIEW_MAX_SIDE // 2 + legend_height(PREVIEW_MAX_SIDE), PREVIEW_MAX_SIDE, 3)  # the picture: capped
    # the legend strip carries each rank's colour swatch (exact colours: swatches are drawn untinted)
    from patchray.nodes.bridge.preview import _PALETTE

    strip = preview[0, PREVIEW_MAX_SIDE // 2 :]
    for rank in range(4):
        assert ((strip - torch.tensor(_PALETTE[rank])).abs().amax(-1) < 2 / 255).any(), rank
    # a node shows the picture about 420 px wide: the legend's text must still be 10 px or more there
    assert _font_size(PREVIEW_MAX_SIDE) * 420 / PREVIEW_MAX_SIDE >= 10
    # sizes read width x height, as ComfyUI's widgets order them
    assert "window 8192x" in text or "x4096 px" in text


def test_sampling_rows_are_checked_in_node_terms():
    from patchray.nodes.bridge.validate import check_sampling_rows

    check_sampling_rows(128, 4, 4)
    with pytest.raises(ValueError) as err:
        check_sampling_rows(8, 16, 4)  # 16 ranks on a 64x64 image (8x8 latent) of a UNet that downsamples rows by 4
    text = str(err.value)
    assert "latent_image is 64 px high: 2 band(s) of 32 px for 16 ranks" in text
    assert "set num_ranks on the PatchRay Cluster node to 2 or fewer" in text and "at least 512 px high" in text
    with pytest.raises(ValueError) as err:
        check_sampling_rows(2, 2, 4)  # shorter than one band: only a taller image can help
    assert "num_ranks" not in str(err.value) and "use an image height of 32 px" in str(err.value)
    with pytest.raises(ValueError, match=r"multiple of 32 px .* use an image height of 64 or 96 px"):
        check_sampling_rows(10, 2, 4)


def test_sampling_rows_reads_the_unets_row_downsampling():
    from patchray.nodes.bridge.validate import sampling_rows

    class UNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(4, 4, 3, stride=2, padding=1)
            self.b = torch.nn.Conv2d(4, 4, 3, stride=2, padding=1)

    model = type("ModelPatcher", (), {})()
    model.model = type("BaseModel", (), {})()
    model.model.diffusion_model = UNet()
    sampling_rows(model, torch.zeros(1, 4, 16, 8), 4)  # 4 bands of 4 rows
    with pytest.raises(ValueError, match="4 band"):
        sampling_rows(model, torch.zeros(1, 4, 16, 8), 5)


def test_a_plan_must_match_its_latent_and_an_unused_plan_is_said():
    from patchray.distributed.vae.planner import plan_tiles
    from patchray.nodes.bridge.validate import plan_for_latent, plan_use_note

    plan = plan_tiles("kl", 512, 768, world_size=2).coarse.to_dict()
    plan_for_latent(plan, (1, 4, 64, 96), 8)
    with pytest.raises(ValueError, match=r"plan was made for 768x512 px, but this latent decodes to 512x512 px: set the Tile Planner's width to 512"):
        plan_for_latent(plan, (1, 4, 64, 64), 8)
    assert "unused" in plan_use_note("row", plan) and plan_use_note("tile-runs", plan) is None and plan_use_note("row", None) is None
