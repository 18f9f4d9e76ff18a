"""The Cluster node starts no rank: the first node to use its handle does, after that node's own checks.

A request the nodes refuse from their inputs alone (a latent with fewer rows than ranks, a plan made for another rank
count, an unknown widget value) is refused without the rank start-up (15-25 s on CPU ranks). The process-wide cluster
is read before and after: a node that started ranks would have replaced it with a cluster of its configuration. The
Distributed KSampler's refusals need ComfyUI's MODEL: tests/comfyui/test_refuse_before_ranks.py (opt-in) runs them
in a fresh process and checks that Ray was never started. The start on first use and the reuse across prompts run
on real ranks in test_nodes.py.
"""

import json

import pytest
import torch

from .comfy_shapes import ComfyLikeVAE, kl_to_ldm

RANKS = 3  # no other node test builds a cluster of 3 ranks: a start here would be this test's own


def _current():
    from patchray.distributed.cluster import registry

    return registry._current


@pytest.fixture(scope="module")
def handle():
    from patchray.distributed.cluster import running_cluster
    from patchray.nodes.cluster import PatchRayCluster

    before = _current()
    out = PatchRayCluster.execute(num_ranks=RANKS, device="cpu", address="", gpu_ids="")
    config, info = out.args
    assert _current() is before and running_cluster(config) is None  # nothing started
    described = json.loads(info)
    assert described["started"] is False and described["num_ranks"] == RANKS
    assert (described["device_kind"], described["backend"]) == ("cpu", "gloo")
    assert out.ui.value.startswith(f"{RANKS} cpu rank(s), gloo: they start when a PatchRay node first uses them")
    return config


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(5)
    model = AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                          block_out_channels=[32] * 4, layers_per_block=1, latent_channels=4, norm_num_groups=32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ComfyLikeVAE(model, kl_to_ldm(model.state_dict(), 4))  # 8 px per latent, like every KL VAE


def test_the_cluster_node_starts_no_rank(handle):
    from patchray.nodes.cluster import PatchRayCluster

    before = _current()
    again = PatchRayCluster.execute(num_ranks=RANKS, device="cpu", address="", gpu_ids="").args[0]
    assert again == handle and _current() is before  # the same handle, still nothing started


def test_a_refused_decode_starts_no_rank(handle, vae):
    from patchray.nodes.vae import PatchRayVAEDecode

    before = _current()
    with pytest.raises(ValueError, match=rf"2 latent rows, fewer than the {RANKS} ranks.*set num_ranks on the PatchRay Cluster node to 2 or fewer"):
        PatchRayVAEDecode.execute(samples={"samples": torch.randn(1, 4, 2, 6)}, vae=vae, cluster=handle, mode="row")
    from patchray.distributed.vae.planner import plan_tiles

    plan = plan_tiles("kl", 512, 512, world_size=2).coarse.to_dict()  # what the Tile Planner node outputs for 2 ranks
    with pytest.raises(ValueError, match=rf"'plan' was made for 2 ranks but 'cluster' has {RANKS}.*set ranks on the PatchRay Tile Planner"):
        PatchRayVAEDecode.execute(samples={"samples": torch.randn(1, 4, 64, 64)}, vae=vae, cluster=handle, mode="tile-runs", plan=plan)
    assert _current() is before


def test_a_refused_encode_starts_no_rank(handle, vae):
    from patchray.nodes.vae import PatchRayVAEEncode

    before = _current()
    with pytest.raises(ValueError, match="'balance' must be one of"):
        PatchRayVAEEncode.execute(pixels=torch.rand(1, 16, 16, 3), vae=vae, cluster=handle, balance="fastest")
    with pytest.raises(ValueError, match=rf"cannot be encoded on the {RANKS} ranks of 'cluster'.*num_ranks"):
        PatchRayVAEEncode.execute(pixels=torch.rand(1, 16, 64, 3), vae=vae, cluster=handle)
    assert _current() is before


def test_a_refused_benchmark_starts_no_rank(handle, tmp_path):
    """The Benchmark's shape widget is checked against the device kind the Cluster node's settings give (cpu here)."""
    from patchray.nodes.bridge import diagnostics

    before = _current()
    with pytest.raises(ValueError, match=r"shape '1000x1000x3': family wan decodes 4k \+ 1 frames: use 1000x1000x1 or 1000x1000x5"):
        diagnostics.benchmark(handle, "wan", "1000x1000x3", "tiny", "decoder", 1, str(tmp_path))
    with pytest.raises(ValueError, match=r"needs about .* GiB on the CPU ranks .* set size to tiny"):
        diagnostics.benchmark(handle, "kl", "16384x16384", "full", "decoder", 1, str(tmp_path))
    assert _current() is before


def test_an_existing_ray_cluster_is_not_contacted_by_the_cluster_node():
    """With address set, the node neither connects nor places anything: the device kind of device auto is then the
    Ray cluster's to decide, when a node first uses the handle."""
    from patchray.nodes.cluster import PatchRayCluster

    before = _current()
    out = PatchRayCluster.execute(num_ranks=2, device="auto", address="ray://127.0.0.1:1", gpu_ids="")
    described = json.loads(out.args[1])
    assert described["started"] is False and described["address"] == "ray://127.0.0.1:1"
    assert described["device_kind"] == "decided by the Ray cluster"
    assert out.ui.value.startswith("2 rank(s), nccl on GPUs, gloo on CPUs: they start when")
    assert _current() is before
