"""The VAE nodes under trouble, on real CPU Ray ranks: a rank that runs out of memory (the cluster's
``rank_memory_mb`` cap, which raises torch's own ``OutOfMemoryError``), inputs that cannot work (refused in the
driver before any rank starts), progress per stage, and the fallback note."""

import dataclasses

import pytest
import torch

from ..conftest import TEST_PYTHONPATH
from .test_vae_nodes import _kl_vae

pytestmark = pytest.mark.usefixtures("ray_session")

# 8 MiB per call and rank: a 32x16 latent (256x128 px, 32-channel decoder) needs about 10 MiB per rank in row
# mode at 2 ranks (measured with the same counter in one process: 10.0 MiB for a 16-row band), about 6 MiB per rank
# for one of two row-tiled tiles, and the small decodes below well under 8 MiB.
_CAP_MB = 8


@pytest.fixture(scope="module")
def capped():
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=2, device="cpu", rank_memory_mb=_CAP_MB, extra_pythonpath=(TEST_PYTHONPATH,))


@pytest.fixture(scope="module")
def vae8():
    return _kl_vae(4)


# ------------------------------------------------------------------------------ the memory cap itself (no ranks)


def test_memory_cap_counts_live_storages_once_and_releases_freed_ones():
    from patchray.distributed.cluster.memory import memory_cap

    mib = 1 << 18  # float32 elements in one MiB
    cpu = torch.device("cpu")
    with memory_cap(1.0, cpu):
        a = torch.ones(int(0.6 * mib))
        view = a[: mib // 2].view(-1, 2)  # a view shares the storage: not counted again
        a.add_(1.0)  # in place: same storage
        del a, view
        b = torch.ones(int(0.6 * mib))  # fits only because the first 0.6 MiB were released
        with pytest.raises(torch.OutOfMemoryError, match="rank_memory_mb"):
            torch.ones(int(0.6 * mib))
        del b
    with memory_cap(None, cpu):
        torch.ones(2 * mib)  # no cap, no count
    with pytest.raises(ValueError, match="rank_memory_mb"):
        dataclasses.replace(_config(), rank_memory_mb=0)


def _config():
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=2, device="cpu")


# ------------------------------------------------------------------------------ stages found by structure (no ranks)


@pytest.mark.parametrize("family, frames", [("kl", None), ("wan", 3)])
def test_stages_are_the_top_level_blocks_and_video_decoders_count_each_frame_call(family, frames):
    from patchray.distributed.context import ParallelContext
    from patchray.distributed.vae.families import build_vae, latent_shape
    from patchray.distributed.vae.stages import stage_progress

    vae = build_vae(family, size="tiny")
    shape = latent_shape(family, 64, 48, frames=1 + 4 * (frames - 1) if frames else 1, size="tiny")
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    seen = []
    with torch.no_grad(), stage_progress(vae.decoder, ParallelContext.single(), frames=frames, report=lambda d, t: seen.append((d, t))) as c:
        vae.decode(z)
    # diffusers' decoders: a mid-block and a ModuleList of up-blocks; Wan's decoder runs once per latent frame
    per_call = len(vae.decoder.up_blocks) + 1
    calls = frames or 1
    assert [d for d, _ in seen] == list(range(1, per_call * calls + 1))
    assert seen[-1] == (per_call * calls, per_call * calls)
    assert c.history == seen
    assert not vae.decoder._forward_hooks and not vae.decoder._forward_pre_hooks  # hooks removed


def test_encoder_frame_chunks_are_counted_from_the_frames_each_call_takes():
    from patchray.distributed.context import ParallelContext
    from patchray.distributed.vae.families import build_vae
    from patchray.distributed.vae.stages import stage_blocks, stage_progress

    vae = build_vae("wan", size="tiny")
    x = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    seen = []
    with torch.no_grad(), stage_progress(vae.encoder, ParallelContext.single(), frames=9, report=lambda d, t: seen.append((d, t))):
        vae.encode(x)
    # Wan encodes 1 frame, then chunks of 4: 3 calls for 9 frames. The first call cannot know (it assumes 1 frame per
    # call); from the second call on the total is exact, and the last figure is full.
    per_call = len(stage_blocks(vae.encoder))
    assert [d for d, _ in seen] == list(range(1, 3 * per_call + 1))
    assert all(t == 3 * per_call for _, t in seen[per_call:])


def _stage_history_task(ctx, family, shape):
    """On real ranks: a row decode with rank 0 counting stages; rank 0 returns what it reported."""
    from patchray.distributed.vae.families import build_vae
    from patchray.distributed.vae.row import row_decode
    from patchray.distributed.vae.stages import stage_progress

    vae = build_vae(family, size="tiny")
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    frames = shape[2] if len(shape) == 5 else None
    with stage_progress(vae.decoder, ctx, frames=frames) as counter:
        row_decode(vae, z, ctx)
    return None if counter is None else counter.history


def test_rank_zero_reports_increasing_stages_during_a_real_row_decode(capped):
    from patchray.distributed.cluster import get_cluster
    from patchray.distributed.vae.families import latent_shape

    cluster = get_cluster(capped)
    shape = latent_shape("wan", 64, 48, frames=5, size="tiny")  # 2 latent frames: the decoder runs twice
    history, other = cluster.run(_stage_history_task, "wan", shape)
    assert other is None  # only rank 0 counts
    done = [d for d, _ in history]
    assert len(done) > 2 and done == sorted(set(done)) and history[-1][0] == history[-1][1]


# ------------------------------------------------------------------------------ out of memory on a rank


def _live_tensor_bytes(ctx):
    """Bytes of every storage a live Python tensor on this rank holds (each storage once)."""
    import gc

    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_a_rank_out_of_memory_frees_its_call_and_the_group_keeps_working(capped, vae8):
    from patchray.distributed.cluster import RankFailure, get_cluster
    from patchray.distributed.vae.api import distributed_decode
    from patchray.nodes.bridge.convert import vae_spec

    spec = vae_spec(vae8)
    cluster = get_cluster(capped)
    distributed_decode(cluster, spec, torch.randn(1, 4, 8, 16), mode="row")  # weights on the ranks, fits
    before = cluster.run(_live_tensor_bytes)
    with pytest.raises((torch.OutOfMemoryError, RankFailure), match="OutOfMemoryError|ran out of memory"):
        distributed_decode(cluster, spec, torch.randn(1, 4, 32, 16), mode="row", on_oom="raise")
    cluster = get_cluster(capped)
    after = cluster.run(_live_tensor_bytes)
    # nothing the failed call allocated survives on either rank (4 KiB: small bookkeeping tensors may differ)
    assert all(a <= b + 4096 for a, b in zip(after, before)), (before, after)
    image = distributed_decode(cluster, spec, torch.randn(1, 4, 8, 16), mode="row")
    assert image.shape == (1, 3, 64, 128)


def test_the_decode_node_retries_row_tiled_and_says_so(capped, vae8, monkeypatch):
    from patchray.nodes import vae as node_vae

    figures = []
    monkeypatch.setattr(node_vae, "_progress", lambda: (lambda done, total: figures.append((done, total))))
    z = torch.randn(1, 4, 32, 16, generator=torch.Generator().manual_seed(1))
    out = node_vae.PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=capped, mode="row", precision="fp32", gn_sync=False)
    image, note = out.args[0], out.ui.value
    assert "ran out of memory" in note and "row-tiled" in note and "row mode" in note
    stock = vae8.decode(z)
    assert image.shape == stock.shape == (1, 256, 128, 3)
    # what it claims: the two-tile row-tiled decode, which one process reproduces from the same plan (row mode
    # inside each tile is exact up to fp32 reassociation: within one 8-bit level)
    from patchray.distributed.vae.api import _row_tiled_plan
    from patchray.distributed.vae.planner import TilePlan
    from patchray.distributed.vae.tiled import decode_local
    from patchray.nodes.bridge.convert import decoded_to_image, vae_spec

    plan = TilePlan.from_dict(_row_tiled_plan(vae_spec(vae8), z, 2, 2))
    assert plan.tile_count == 2 and plan.grid == (2, 1)
    assert (image - decoded_to_image(decode_local(vae8.model, z, plan))).abs().max() <= 1 / 255
    # and close to the untiled decode on average only: each tile normalises over its own rows (random weights
    # amplify the GroupNorm difference), blended across the seam
    assert (image - stock).abs().mean() < 0.1
    # stages never go back across the retry (the retry continues the count), and the node fills the bar at the end
    done = [d for d, _ in figures[:-1]]
    assert done and done == sorted(done) and all(d <= t for d, t in figures)
    assert figures[-1] == (1, 1)
    # the same prompt again starts row-tiled at once (remembered), and says why
    again = node_vae.PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=capped, mode="row", precision="fp32", gn_sync=False)
    assert "earlier run" in again.ui.value and torch.equal(again.args[0], image)
    # a decode that fits gets no note
    small = node_vae.PatchRayVAEDecode.execute(samples={"samples": z[..., :8, :]}, vae=vae8, cluster=capped, mode="row", precision="fp32", gn_sync=False)
    assert small.ui is None and (small.args[0] - vae8.decode(z[..., :8, :])).abs().max() <= 1 / 255


# ------------------------------------------------------------------------------ inputs refused before any rank starts


def _untouched_cluster():
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=3, device="cpu", init_timeout_s=119.0)  # a config no test starts


def _image_vae():
    return _kl_vae(2)  # 4 latent channels, ratio 2


@pytest.mark.parametrize(
    "z, expect",
    [
        (torch.randn(1, 16, 8, 8), ["'samples' has 16 latent channels", "takes 4", "'vae'"]),
        (torch.randn(1, 4, 3, 8, 8), ["'samples' is a video latent", "'vae'"]),
        (torch.randn(1, 4, 2, 8), ["'samples' has 2 latent rows", "3 ranks of 'cluster'", "num_ranks", "PatchRay Cluster"]),
        (torch.full((1, 4, 8, 8), float("nan")), ["'samples' holds 256 NaN and 0 infinite"]),
        (torch.randn(1, 4, 8, 8).index_fill_(2, torch.tensor([3]), float("inf")), ["'samples' holds 0 NaN and 32 infinite"]),
    ],
    ids=["channels", "video-latent", "rows", "nan", "inf"],
)
def test_bad_latents_get_one_message_in_node_terms_before_any_rank_starts(z, expect):
    from patchray.distributed.cluster import registry
    from patchray.nodes.vae import PatchRayVAEDecode

    before = registry._current
    with pytest.raises(ValueError) as info:
        PatchRayVAEDecode.execute(samples={"samples": z}, vae=_image_vae(), cluster=_untouched_cluster(), mode="auto",
                                  precision="fp32", gn_sync=False)
    msg = str(info.value)
    assert msg.startswith("PatchRay Distributed VAE Decode: ")
    for part in expect:
        assert part in msg, msg
    assert "Ray" not in msg.replace("PatchRay", "") and "Traceback" not in msg
    assert registry._current is before, "no cluster was started (nothing was shipped)"


def test_a_tile_plan_for_another_rank_count_is_refused_before_any_rank_starts():
    from patchray.distributed.cluster import registry
    from patchray.nodes.planner import PatchRayTilePlanner
    from patchray.nodes.vae import PatchRayVAEDecode

    plan = PatchRayTilePlanner.execute(family="kl", width=128, height=512, frames=1, ranks=2, choice="coarse").args[0]
    before = registry._current
    with pytest.raises(ValueError, match=r"'plan' was made for 2 ranks but 'cluster' has 3.*Tile Planner"):
        PatchRayVAEDecode.execute(samples={"samples": torch.randn(1, 4, 64, 16)}, vae=_kl_vae(4), cluster=_untouched_cluster(),
                                  mode="tile-runs", precision="fp32", gn_sync=False, plan=plan)
    assert registry._current is before


def test_an_image_too_small_to_encode_on_the_ranks_is_refused_before_any_rank_starts():
    from patchray.distributed.cluster import registry
    from patchray.nodes.vae import PatchRayVAEEncode

    before = registry._current
    with pytest.raises(ValueError, match=r"'pixels'.*num_ranks.*PatchRay Cluster"):
        PatchRayVAEEncode.execute(pixels=torch.rand(1, 4, 16, 3), vae=_image_vae(), cluster=_untouched_cluster(), precision="fp32")
    assert registry._current is before


def test_the_fallback_note_lists_the_vaes_patchray_shards():
    from patchray.nodes.bridge.vae_layouts import LAYOUTS
    from patchray.nodes.vae import PatchRayVAEDecode

    vae = _image_vae()
    vae.first_stage_model._sd = {"taesd_decoder.1.weight": torch.zeros(64, 4, 3, 3)}  # a VAE PatchRay leaves alone
    out = PatchRayVAEDecode.execute(samples={"samples": torch.randn(1, 4, 8, 8)}, vae=vae, cluster=_untouched_cluster(),
                                    mode="auto", precision="auto", gn_sync=False)
    note = out.ui.value
    assert "TAESD" in note and "used ComfyUI's own single-device decode" in note
    covered = {row.name for row in LAYOUTS if row.family}
    assert covered and all(name in note for name in covered)
    assert not any(row.name in note.split("PatchRay shards:")[-1] for row in LAYOUTS if not row.family)


def test_a_tile_plan_for_another_image_size_is_refused_before_any_rank_starts():
    from patchray.distributed.cluster import registry
    from patchray.nodes.planner import PatchRayTilePlanner
    from patchray.nodes.vae import PatchRayVAEDecode

    plan = PatchRayTilePlanner.execute(family="kl", width=128, height=512, frames=1, ranks=3, choice="coarse").args[0]
    before = registry._current
    # the latent decodes to 128 x 256 px (ratio 8): the plan's 128 x 512 cannot tile it
    with pytest.raises(ValueError, match=r"plan was made for 128x512 px.*decodes to 128x256 px.*height to 256"):
        PatchRayVAEDecode.execute(samples={"samples": torch.randn(1, 4, 32, 16)}, vae=_kl_vae(4), cluster=_untouched_cluster(),
                                  mode="tile-runs", precision="fp32", gn_sync=False, plan=plan)
    assert registry._current is before


def test_a_plan_wired_into_row_mode_is_reported_unused_not_silently_dropped(capped, vae8):
    from patchray.nodes.planner import PatchRayTilePlanner
    from patchray.nodes.vae import PatchRayVAEDecode

    # a plan of a size this latent does not have: row mode must neither use nor refuse it, only say so
    plan = PatchRayTilePlanner.execute(family="kl", width=128, height=512, frames=1, ranks=2, choice="coarse").args[0]
    z = torch.randn(1, 4, 8, 16, generator=torch.Generator().manual_seed(3))
    out = PatchRayVAEDecode.execute(samples={"samples": z}, vae=vae8, cluster=capped, mode="row", precision="fp32", gn_sync=False, plan=plan)
    assert "plan is unused" in out.ui.value
    # fp32 row mode is exact up to reassociation: within one 8-bit level of the one-process decode
    assert (out.args[0] - vae8.decode(z)).abs().max() <= 1 / 255
