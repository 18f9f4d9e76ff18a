"""Every node's execute with ComfyUI-shaped inputs, on real CPU Ray ranks (no mocks of Ray or torch.distributed).

The schema classes come from the stand-in in ``standin/`` when ComfyUI is absent; everything below them
(the cluster, the planner, the probe, the benchmark) is the real library.
"""

import json

import pytest
import torch

pytestmark = pytest.mark.usefixtures("ray_session")

RANKS = 2


@pytest.fixture(scope="module")
def cluster():
    from patchray.distributed.cluster import get_cluster
    from patchray.nodes.cluster import PatchRayCluster

    config = PatchRayCluster.execute(num_ranks=RANKS, device="cpu", address="", gpu_ids="").args[0]
    get_cluster(config)  # what the first node to use the handle does (the node itself starts nothing: test_cluster_lazy.py)
    out = PatchRayCluster.execute(num_ranks=RANKS, device="cpu", address="", gpu_ids="")
    again, info = out.args
    assert again == config and config.num_ranks == RANKS and config.device == "cpu"
    described = json.loads(info)  # a running cluster of the node's configuration is described as it runs
    assert described["started"] is True and described["num_ranks"] == RANKS and described["backend"] == "gloo"
    assert len(described["ranks"]) == RANKS and len({r["pid"] for r in described["ranks"]}) == RANKS
    assert "2 cpu rank(s)" in out.ui.value and "they start when" not in out.ui.value
    return config


def test_cluster_node_reuses_the_running_cluster(cluster):
    from patchray.distributed.cluster import get_cluster
    from patchray.nodes.cluster import PatchRayCluster

    first = get_cluster(cluster)
    again = PatchRayCluster.execute(num_ranks=RANKS, device="cpu", address="", gpu_ids="").args[0]
    assert again == cluster and get_cluster(again) is first  # a second prompt pays no start-up


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_ranks=0, device="cpu"), "num_ranks"),
        (dict(num_ranks=2, device="tpu"), "device"),
        (dict(num_ranks=2, device="cpu", gpu_ids="0"), "gpu_ids|pin GPUs"),
    ],
)
def test_cluster_node_refuses_bad_settings(kwargs, message):
    from patchray.nodes.cluster import cluster_config

    with pytest.raises(ValueError, match=message):
        cluster_config(**kwargs)


def test_tile_planner_node_plans_and_draws():
    from patchray.distributed.vae.planner import TilePlan, plan_tiles
    from patchray.nodes.planner import PatchRayTilePlanner

    out = PatchRayTilePlanner.execute(family="kl", width=768, height=512, frames=1, ranks=RANKS, choice="fine")
    plan, preview, text = out.args
    want = plan_tiles("kl", 512, 768, world_size=RANKS).fine.to_dict()
    assert plan == want  # the wire carries exactly the planner's plan
    TilePlan.from_dict(plan)  # and the decode node can rebuild it
    from patchray.nodes.bridge.preview import legend_height

    assert preview.shape == (1, 512 + legend_height(768), 768, 3) and preview.dtype == torch.float32  # the plan, then its legend
    assert 0.0 <= preview.min() and preview.max() <= 1.0
    assert len(text.splitlines()) >= 2 and "window" in text
    # each tile core is tinted with its rank's colour: the centres of two ranks' first tiles differ
    centres = []
    for rank, (start, _) in enumerate(plan["runs"]):
        y0, y1, x0, x1 = plan["tiles_latent"][start]
        centres.append(preview[0, (y0 + y1) * 4, (x0 + x1) * 4])
    assert not torch.allclose(centres[0], centres[1])


def test_tile_planner_node_draws_over_an_image():
    from patchray.nodes.planner import PatchRayTilePlanner

    image = torch.zeros(1, 512, 512, 3)
    image[..., 0] = 1.0  # pure red
    from patchray.nodes.bridge.preview import legend_height

    preview = PatchRayTilePlanner.execute(family="kl", width=512, height=512, frames=1, ranks=RANKS, choice="coarse", image=image).args[1]
    assert preview.shape == (1, 512 + legend_height(512), 512, 3)
    grey = PatchRayTilePlanner.execute(family="kl", width=512, height=512, frames=1, ranks=RANKS, choice="coarse").args[1]
    # away from the outlines, the red shows through the tint: more red, same rank tint on green/blue
    assert preview[0, 100, 100, 0] > grey[0, 100, 100, 0] + 0.2
    torch.testing.assert_close(preview[0, 100, 100, 1:], grey[0, 100, 100, 1:] - 0.35 * 0.55)


def test_tile_planner_node_reports_impossible_requests():
    from patchray.nodes.planner import PatchRayTilePlanner

    with pytest.raises(ValueError, match="tile"):
        PatchRayTilePlanner.execute(family="kl", width=64, height=64, frames=1, ranks=RANKS, choice="balanced")


def test_topology_node_without_gpus(cluster):
    from patchray.nodes.topology import PatchRayTopologyProbe

    out = PatchRayTopologyProbe.execute(measure=False, cluster=cluster)
    heatmap, summary, report_json = out.args
    assert heatmap.ndim == 4 and heatmap.shape[0] == 1 and heatmap.shape[-1] == 3
    assert heatmap.shape[1] > 50 and heatmap.shape[2] > 50
    report = json.loads(report_json)
    assert report["schema"] == 1
    assert report["cluster"]["ranks"] == RANKS and report["cluster"]["all_reduce_ok"] is True
    assert "PatchRay topology probe" in summary
    assert out.ui["patchray_topology"][0]["schema"] == 1  # what the web extension renders
