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
    # fp32, exact row mode: only reduction-order differences (bound 1e-4 on outputs in about [-1, 1])
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4
    def cached_vae_keys(ctx):  # defined here so Ray sends it by value (this test module is not importable on the ranks)
        from patchray.distributed.cluster import rank_cache

        entry = rank_cache().get("patchray.vae.model")  # rank_tasks.VAE_SLOT: (("vae", key, dtype), vae)
        return [] if entry is None else [entry[0][1]]

    # what the ranks hold, asked of the ranks: one VAE each, under this spec's key
    assert cluster.run(cached_vae_keys) == [[spec.key], [spec.key]]

    # second call: only the key travels; the ranks answer from their cache
    out2 = api.distributed_decode(cluster, spec._replace(state_dict=None), z, mode="row")
    assert torch.equal(out2, out)
    # the same settings as an options value: the same call
    out3 = api.distributed_decode(cluster, spec._replace(state_dict=None), z, api.DecodeOptions(mode="row"))
    assert torch.equal(out3, out)

    x = torch.rand(1, 3, 19 * 8, 13 * 8) * 2 - 1
    lat = api.distributed_encode(cluster, spec, x)
    with torch.no_grad():
        ref_lat = vae.encode(x).latent_dist.mean
    assert (lat - ref_lat).abs().max().item() <= 1e-4


def test_tile_runs_decode_equals_one_rank_and_auto_decodes_exactly_without_a_topology():
    from patchray.distributed.vae.planner import TilePlan, plan_tiles
    from patchray.distributed.vae.tiled import decode_local

    vae, spec = _tiny_kl_spec()
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    z = torch.randn(1, vae.config.latent_channels, 40, 40)
    report = plan_tiles("kl", 320, 320, 1, 2)
    plan = (report.balanced or report.coarse).to_dict()
    tiled = api.distributed_decode(cluster, spec, z, mode="tile-runs", plan=plan)
    with torch.no_grad():
        one = decode_local(vae, z, TilePlan.from_dict(plan))  # the same tiles, decoded and blended in this process
        full = vae.decode(z).sample
    assert tiled.shape == one.shape == (1, 3, 320, 320)
    # the same tiles decoded on two ranks or one: equal up to fp32 reassociation
    assert (tiled - one).abs().max().item() <= 1e-4
    assert (tiled - full).abs().max().item() > 1e-3  # tiles are not the full decode: the next check can tell them apart
    # auto on CPU ranks (no topology to consult) decodes in row mode: exact, unlike the tiles
    auto = api.distributed_decode(cluster, spec, z, mode="auto")
    assert (auto - full).abs().max().item() <= 1e-4


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
    with pytest.raises(TypeError, match="unexpected keyword.*colour.*accepted: .*balance"):
        api.distributed_decode(cluster, spec, torch.randn(1, 4, 16, 16), colour="red")
    with pytest.raises(TypeError, match="unexpected keyword.*gn_sync"):  # a decode-only setting
        api.distributed_encode(cluster, spec, torch.rand(1, 3, 64, 64), gn_sync=True)
    with pytest.raises(ValueError, match="on_oom must be one of"):
        api.DecodeOptions(on_oom="retry")
    with pytest.raises(TypeError, match="options must be a DecodeOptions"):
        api.decode_report(cluster, spec, torch.randn(1, 4, 16, 16), "row")


def test_latents_and_inputs_that_cannot_fit_are_refused_on_the_driver():
    # refused here, before anything is shipped: a plain ValueError with the message alone, not a rank's error
    # wrapped by Ray (whose type would be RayTaskError(ValueError) and whose text carries the rank's traceback)
    _, spec = _tiny_kl_spec()
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    channels = spec.config["latent_channels"]
    cases = [
        (lambda: api.distributed_decode(cluster, spec, torch.randn(1, channels + 3, 16, 16), mode="row"), "channels"),
        (lambda: api.distributed_decode(cluster, spec, torch.randn(1, channels + 3, 16, 16), mode="tile-runs"), "channels"),
        (lambda: api.distributed_decode(cluster, spec, torch.randn(1, channels, 1, 16), mode="row"), "at most 1 ranks"),
        (lambda: api.distributed_decode(cluster, spec, torch.randn(channels, 16, 16), mode="row"), "4-D"),
        (lambda: api.distributed_encode(cluster, spec, torch.rand(1, 3, 8, 64)), "at most 1 ranks"),
        (lambda: api.distributed_encode(cluster, spec, torch.rand(1, 3, 60, 64)), "divisible by 8"),
        (lambda: api.distributed_encode(cluster, spec, torch.rand(1, 4, 64, 64)), "channels"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words) as info:
            call()
        assert type(info.value) is ValueError and "ray::" not in str(info.value), str(info.value)


def test_weights_in_the_diffusers_format_are_checked_before_they_travel():
    from patchray.distributed.vae.convert import UnsupportedVaeError

    vae, spec = _tiny_kl_spec()
    checked = api.spec_from_diffusers("kl", spec.config, spec.state_dict)
    assert checked.family == "kl" and checked.state_dict is spec.state_dict
    assert checked.key == api.spec_from_diffusers("kl", spec.config, {k: v.clone() for k, v in spec.state_dict.items()}).key
    broken = dict(spec.state_dict)
    del broken["decoder.conv_out.weight"]
    with pytest.raises(UnsupportedVaeError, match="missing.*decoder.conv_out.weight"):
        api.spec_from_diffusers("kl", spec.config, broken)


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
