"""distributed_decode / distributed_encode on the Ray cluster (CPU ranks, real gloo) against one-process diffusers."""

import pytest
import torch

from patchray.distributed.cluster import ClusterConfig, get_cluster
from patchray.distributed.vae import api
from patchray.distributed.vae.families import FAMILIES, build_vae

pytestmark = pytest.mark.usefixtures("ray_session")


def _tiny_kl_spec():
    vae = build_vae("kl", size="tiny", seed=3)
    sd = {k: v.clone() for k, v in vae.state_dict().items()}
    return vae, api.VaeSpec(family="kl", config=dict(FAMILIES["kl"].tiny_config), state_dict=sd, key="test-kl-seed3")


def test_row_decode_and_encode_equal_single_process_and_weights_travel_once():
    vae, spec = _tiny_kl_spec()
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    c = vae.config.latent_channels
    z = torch.randn(2, c, 19, 13)  # odd sizes, batch 2
    out = api.distributed_decode(cluster, spec, z, mode="row")
    with torch.no_grad():
        ref = vae.decode(z).sample
    # fp32, exact row mode: only reduction-order differences (issue bound 1e-4 on outputs in about [-1, 1])
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4
    assert spec.key in cluster._patchray_weights_on_ranks

    # second call: only the key travels; the ranks answer from their cache
    out2 = api.distributed_decode(cluster, spec._replace(state_dict=None), z, mode="row")
    assert torch.equal(out2, out)

    x = torch.rand(1, 3, 19 * 8, 13 * 8) * 2 - 1
    lat = api.distributed_encode(cluster, spec, x)
    with torch.no_grad():
        ref_lat = vae.encode(x).latent_dist.mean
    assert (lat - ref_lat).abs().max().item() <= 1e-4


def test_tile_runs_decode_returns_the_image_and_auto_picks_row():
    vae, spec = _tiny_kl_spec()
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    z = torch.randn(1, vae.config.latent_channels, 40, 40)
    tiled = api.distributed_decode(cluster, spec, z, mode="tile-runs")
    assert tiled.shape == (1, 3, 320, 320) and torch.isfinite(tiled).all()
    assert api.choose_mode("kl", 320, 320, 1, 2) == "row"


def test_rebuilt_cluster_gets_the_weights_again():
    vae, spec = _tiny_kl_spec()
    cfg = ClusterConfig(num_ranks=2, device="cpu")
    cluster = get_cluster(cfg)
    z = torch.randn(1, vae.config.latent_channels, 16, 16)
    api.distributed_decode(cluster, spec, z, mode="row")
    cluster.shutdown()  # a fault or a settings change replaces the cluster
    fresh = get_cluster(cfg)
    assert fresh is not cluster
    out = api.distributed_decode(fresh, spec, z, mode="row")
    with torch.no_grad():
        assert (out - vae.decode(z).sample).abs().max().item() <= 1e-4


def test_bad_requests_are_refused_with_the_fix():
    _, spec = _tiny_kl_spec()
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    with pytest.raises(ValueError, match="mode must be one of"):
        api.distributed_decode(cluster, spec, torch.randn(1, 4, 16, 16), mode="diagonal")
    with pytest.raises(ValueError, match="dtype must be one of"):
        api.distributed_decode(cluster, spec, torch.randn(1, 4, 16, 16), dtype="fp8")
    with pytest.raises(ValueError, match="channels"):
        api.distributed_decode(cluster, spec, torch.randn(1, 7, 16, 16), mode="row")
    with pytest.raises(ValueError, match="unknown family|known families"):
        api.spec_for_family("sd35")


def _saved_report(name):
    from pathlib import Path

    from patchray.distributed.topology import report_from_saved

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "topology" / name
    topo = (folder / "topo_m.txt").read_text()
    p2p = [(folder / f).read_text() for f in ("p2p.txt", "p2p_r.txt", "p2p_w.txt") if (folder / f).exists()]
    return report_from_saved(topo, p2p)


def test_auto_follows_the_topology_advice():
    # a consumer board without GPU peer-to-peer: the advice prefers whole tiles (no per-layer exchange)
    no_p2p = _saved_report("consumer_2x3090_no_p2p")
    assert api.choose_mode("kl", 2048, 2048, 1, 2, no_p2p) == "tile-runs"
    # NVLink: exact row mode
    nvlink = _saved_report("hgx_h100_8gpu_nvlink")
    assert api.choose_mode("kl", 2048, 2048, 1, 2, nvlink) == "row"
    # an image too small for tiles on this many ranks stays in row mode whatever the link
    assert api.choose_mode("kl", 128, 128, 1, 2, no_p2p) == "row"
