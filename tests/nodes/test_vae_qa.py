"""What a first-hour user of the VAE side meets, checked without ComfyUI (the same cases run in a real ComfyUI in
tests/comfyui/test_vae_qa_server.py): refusals worded in the nodes' widgets, never the command line's flags, with
sizes as ComfyUI orders them (width x height), raised before any rank starts."""

import re

import pytest
import torch

from .test_vae_nodes import _kl_vae

_FLAG = re.compile(r"--[a-z]")


def _untouched_cluster(n=2):
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=n, device="cpu", init_timeout_s=117.0)  # a config no test starts


@pytest.mark.parametrize(
    "family, width, height, ranks, expect",
    [
        # 200x136 px is 25x17 latent at 8x: one tile window only; the planner suggests 256x176
        ("kl", 200, 136, 2, ["200x136 px cannot be tiled for 2 rank(s)", "set width to 256 and height to 176"]),
        ("kl", 120, 64, 2, ["120x64 px", "at least 128 px on the image's shorter side", "set width to"]),
        ("kl", 256, 176, 64, ["for 64 rank(s)", "set ranks to 4", "width to 928 and height to 640"]),
        # the widgets step by 8 px; a 16x family needs multiples of 16
        ("wan22", 1008, 1000, 2, ["family wan22 decodes in steps of 16 px", "set height to 992 or 1008"]),
    ],
)
def test_tile_planner_refusals_name_its_widgets_not_command_line_flags(family, width, height, ranks, expect):
    from patchray.nodes.planner import PatchRayTilePlanner

    with pytest.raises(ValueError) as info:
        PatchRayTilePlanner.execute(family=family, width=width, height=height, frames=1, ranks=ranks, choice="balanced")
    msg = str(info.value)
    assert not _FLAG.search(msg), msg
    for part in expect:
        assert part in msg, msg


def test_the_suggested_request_plans():
    """The size and rank count the Tile Planner suggests are ones it then accepts (the suggestion is not invented)."""
    from patchray.nodes.planner import PatchRayTilePlanner

    with pytest.raises(ValueError) as info:
        PatchRayTilePlanner.execute(family="kl", width=256, height=176, frames=1, ranks=64, choice="balanced")
    msg = str(info.value)
    ranks = int(re.search(r"set ranks to (\d+)", msg).group(1))
    width, height = map(int, re.search(r"width to (\d+) and height to (\d+)", msg).groups())
    PatchRayTilePlanner.execute(family="kl", width=256, height=176, frames=1, ranks=ranks, choice="balanced")
    PatchRayTilePlanner.execute(family="kl", width=width, height=height, frames=1, ranks=64, choice="balanced")


def test_tile_runs_on_a_latent_too_small_for_tiles_is_refused_in_node_terms_before_any_rank_starts():
    from patchray.distributed.cluster import registry
    from patchray.nodes.vae import PatchRayVAEDecode

    before = registry._current
    z = torch.randn(1, 4, 17, 25)  # 200x136 px at 8x
    with pytest.raises(ValueError) as info:
        PatchRayVAEDecode.execute(samples={"samples": z}, vae=_kl_vae(4), cluster=_untouched_cluster(2), mode="tile-runs",
                                  precision="fp32", gn_sync=False)
    msg = str(info.value)
    assert msg.startswith("PatchRay Distributed VAE Decode: mode 'tile-runs' cannot tile the 200x136 px image of 'samples'"), msg
    assert "use mode 'row'" in msg and "decode an image of at least 256x176 px" in msg, msg
    assert not _FLAG.search(msg), msg
    assert registry._current is before, "no cluster was started"


def _kl_formula(shape, dtype):
    """ComfyUI 0.3.64's estimate for its KL VAEs' decode (comfy/sd.py, ``VAE.memory_used_decode``), per sample."""
    return 2178 * shape[2] * shape[3] * 64 * torch.empty((), dtype=dtype).element_size()


def test_a_decode_larger_than_this_machines_memory_is_refused_before_any_rank_starts():
    """An Empty Latent Image at the widgets' limit (16384 x 16384): ComfyUI's own estimate for its decode is 2.3 TB,
    more than any machine that runs this test has free; CPU ranks would compute it in this machine's memory."""
    from patchray.distributed.cluster import registry
    from patchray.nodes.vae import PatchRayVAEDecode

    vae = _kl_vae(4)
    vae.memory_used_decode = _kl_formula
    before = registry._current
    with pytest.raises(ValueError) as info:
        PatchRayVAEDecode.execute(samples={"samples": torch.zeros(1, 4, 2048, 2048)}, vae=vae, cluster=_untouched_cluster(2),
                                  mode="row", precision="fp32", gn_sync=False)
    msg = str(info.value)
    assert msg.startswith("PatchRay Distributed VAE Decode: 'samples' is 1 image(s) of 16384x16384 px to decode"), msg
    assert "GiB is free" in msg and "CPU rank(s) of 'cluster'" in msg and "smaller image" in msg, msg
    assert registry._current is before, "no cluster was started"


def test_the_memory_check_counts_what_the_ranks_and_the_result_take():
    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes.bridge.vae import check_host_memory

    gib = 2**30
    cpu, gpu = _untouched_cluster(2), ClusterConfig(num_ranks=2, device="cuda")
    # CPU ranks: half of ComfyUI's estimate (an upper bound, 2.3x the measured KL peak) + the result twice
    check_host_memory("N", "samples", "x", 6 * gib, gib // 4, cpu, available=3 * gib + gib // 2)
    with pytest.raises(ValueError, match=r"N: 'samples' is x; that needs about 3.5 GiB .* and 3.5 GiB is free: decode fewer"):
        check_host_memory("N", "samples", "x", 6 * gib, gib // 4, cpu, available=3 * gib + gib // 2 - 1)
    # GPU ranks: only the result, three copies, comes through this machine's memory
    check_host_memory("N", "samples", "x", 100 * gib, gib, gpu, available=3 * gib)
    with pytest.raises(ValueError, match="result coming back from the GPU ranks"):
        check_host_memory("N", "samples", "x", 100 * gib, gib, gpu, available=3 * gib - 1)


@pytest.mark.usefixtures("ray_session")
def test_a_plan_wired_into_auto_mode_that_chose_row_is_reported_unused():
    """mode auto (the default) with a Tile Planner plan wired in: when auto picks row mode the plan is not used, and
    the node says so instead of dropping it silently."""
    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes.planner import PatchRayTilePlanner
    from patchray.nodes.vae import PatchRayVAEDecode

    from ..conftest import TEST_PYTHONPATH

    cluster = ClusterConfig(num_ranks=2, device="cpu", extra_pythonpath=(TEST_PYTHONPATH,))
    plan = PatchRayTilePlanner.execute(family="kl", width=128, height=512, frames=1, ranks=2, choice="coarse").args[0]
    z = torch.randn(1, 4, 64, 16, generator=torch.Generator().manual_seed(3))  # 128x512 px at 8x: the plan's size
    out = PatchRayVAEDecode.execute(samples={"samples": z}, vae=_kl_vae(4), cluster=cluster, mode="auto", precision="fp32",
                                    gn_sync=False, plan=plan)
    assert "plan is unused: mode auto chose row mode" in out.ui.value and "set mode to tile-runs" in out.ui.value
    tiled = PatchRayVAEDecode.execute(samples={"samples": z}, vae=_kl_vae(4), cluster=cluster, mode="tile-runs", precision="fp32",
                                      gn_sync=False, plan=plan)
    assert tiled.ui is None or "plan is unused" not in str(tiled.ui.value)


def test_the_family_widgets_say_which_comfyui_vae_each_family_is():
    """A user knows their VAE by ComfyUI's name (Wan 2.2, HunyuanVideo), not by PatchRay's family key."""
    from patchray.distributed.vae.families import FAMILIES
    from patchray.nodes.bench import PatchRayBenchmark
    from patchray.nodes.bridge.vae_layouts import LAYOUTS
    from patchray.nodes.planner import PatchRayTilePlanner

    for node in (PatchRayTilePlanner, PatchRayBenchmark):
        family = next(i for i in node.define_schema().inputs if i.id == "family")
        for row in LAYOUTS:
            if row.family:
                assert f"{row.family}: " in family.tooltip and row.name in family.tooltip, (node, row.name)
        assert all(name in family.tooltip for name in FAMILIES), node


def test_a_plan_for_a_family_of_another_ratio_is_refused_before_any_rank_starts():
    """A Tile Planner left on family kl (8 px per latent) wired to a 2x VAE at the same pixel size: the plan's latent
    rectangles are not this latent's; refused naming the planner's family widget."""
    from patchray.distributed.cluster import registry
    from patchray.nodes.planner import PatchRayTilePlanner
    from patchray.nodes.vae import PatchRayVAEDecode

    plan = PatchRayTilePlanner.execute(family="kl", width=256, height=512, frames=1, ranks=2, choice="coarse").args[0]
    before = registry._current
    with pytest.raises(ValueError, match=r"'plan' was made for family kl \(8 px per latent\), but 'vae' .* has 2 px per latent: plan "
                                         r"with a family of 2 px per latent"):
        PatchRayVAEDecode.execute(samples={"samples": torch.randn(1, 4, 256, 128)}, vae=_kl_vae(2), cluster=_untouched_cluster(2),
                                  mode="tile-runs", precision="fp32", gn_sync=False, plan=plan)
    assert registry._current is before


def test_a_benchmark_larger_than_this_machines_memory_is_refused_on_cpu_ranks():
    """The Benchmark's shape is free text: 16384x16384 with the full model on CPU ranks would decode a 1 TB reference
    in one process. Refused naming the widgets; the CPU auto suite and GPU ranks are not."""
    from patchray.nodes.bridge.diagnostics import CPU_AUTO, check_bench_memory

    gib = 2**30
    with pytest.raises(ValueError, match=r"shape 16384x16384 with size full needs about 1024.0 GiB .* set size to tiny"):
        check_bench_memory("kl", 16384, 16384, 1, "full", True, 20 * gib)
    check_bench_memory("kl", 16384, 16384, 1, "full", False, 20 * gib)  # GPU ranks: their memory, their OOM records
    check_bench_memory("kl", CPU_AUTO["height"], CPU_AUTO["width"], 1, CPU_AUTO["size"], True, 1 * gib)
    # the same 512x512 KL decode measured at 0.93 GiB in one process is allowed with 1 GiB free, refused with 0.9
    check_bench_memory("kl", 512, 512, 1, "full", True, 1 * gib)
    with pytest.raises(ValueError, match="benchmark refused"):
        check_bench_memory("kl", 512, 512, 1, "full", True, int(0.9 * gib))


@pytest.mark.parametrize(
    "family, shape, expect",
    [
        # the widget is WIDTHxHEIGHT[xFRAMES]; the benchmark's own check words it height first for its command line
        ("kl", "1001x603", "family kl needs width and height in multiples of 8 px: use 1000x600"),
        ("wan22", "8x8x5", "use 16x16x5"),  # never a 0x0 suggestion
        ("wan", "832x480x80", "decodes 4k + 1 frames: use 832x480x77 or 832x480x81"),
        ("kl", "512x256x5", "decodes single images: use 512x256"),
    ],
)
def test_benchmark_shape_refusals_are_in_the_widgets_order(family, shape, expect):
    from patchray.nodes.bridge.diagnostics import bench_request

    assert bench_request("kl", "1000x600", "auto", "cpu")[:3] == (600, 1000, 1)  # height, width, frames for the benchmark
    with pytest.raises(ValueError) as info:
        bench_request(family, shape, "auto", "cpu")
    assert expect in str(info.value) and not _FLAG.search(str(info.value))


@pytest.mark.parametrize("family", ["ltx_video_090", "ltx_video"])
def test_an_ltx_encode_of_a_frame_count_comfyui_refuses_is_refused_the_same_way(family, monkeypatch):
    """ComfyUI's LTX-Video VAE encodes only 1 + 8k frames (``VideoVAE.encode`` in
    comfy/ldm/lightricks/vae/causal_video_autoencoder.py raises for 13): the stock VAE Encode fails on 13 frames, so
    the distributed one must not return a latent of 9 of them; refused naming the counts that work, before any rank
    starts. (The full-size layouts' conversion to these families is checked in test_vae_convert.py; here the VAE's
    spec is the family's own, so no 200-570 M weights are built.)"""
    from patchray.distributed.cluster import registry
    from patchray.distributed.vae.spec import spec_for_family
    from patchray.nodes.bridge import convert
    from patchray.nodes.vae import PatchRayVAEEncode

    monkeypatch.setattr(convert, "vae_spec", lambda vae: spec_for_family(family, size="tiny"))
    before = registry._current
    with pytest.raises(ValueError) as info:
        PatchRayVAEEncode.execute(pixels=torch.rand(13, 64, 64, 3), vae=object(), cluster=_untouched_cluster(2), precision="fp32")
    msg = str(info.value)
    assert msg.startswith("PatchRay Distributed VAE Encode: 'pixels' has 13 frame(s), but the LTX-Video"), msg
    assert "encodes 1 + 8k frames (1, 9, 17, ...)" in msg and "give it 9 or 17 frames" in msg, msg
    assert not _FLAG.search(msg), msg
    assert registry._current is before, "no cluster was started"


def test_video_vaes_comfyui_encodes_at_any_frame_count_are_not_refused_for_it():
    """Wan and HunyuanVideo encode 6 frames in ComfyUI (two latent frames): no frame-step refusal for them."""
    from patchray.nodes.bridge.vae_layouts import encode_frame_step

    assert [encode_frame_step(f) for f in ("wan", "wan22", "hunyuan_video", "kl")] == [1, 1, 1, 1]
