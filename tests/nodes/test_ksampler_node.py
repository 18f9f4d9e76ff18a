"""The Distributed KSampler node without ComfyUI: its widget -> PatchConfig mapping and its refusals.

Running the node needs ComfyUI's sampler on the ranks (a MODEL is a ComfyUI ModelPatcher); that path is tested
against the stock KSampler in tests/comfyui (opt-in, COMFYUI_DIR), and the machinery under it (model shipped once
per key, the caller's sampler on every rank, the exact final latent) in tests/distributed/test_remote_sampling.py
on real Ray ranks.
"""


import pytest
import torch

from patchray.distributed.sampling.config import PRESETS, OutputMode

# What each preset of the node is documented to be (the preset widget's tooltip and docs/), written out by hand:
# (layer_mode, groupnorm, output, warmup_steps, refresh_every). No preset splits CFG across ranks in the node.
_DOCUMENTED = {
    "full_sync": ("full_sync", "sync", "gather", 0, 0),
    "displaced": ("displaced", "corrected_async", "gather", 4, 0),
    "otil": ("no_sync", "sync", "otil", 4, 10),
    "balanced": ("no_sync", "sync", "gather", 4, 5),
    "compressed": ("displaced", "corrected_async", "gather", 4, 0),
    "compressed_2bit": ("displaced", "corrected_async", "gather", 4, 0),
    "otil_compressed": ("displaced", "corrected_async", "otil", 4, 0),
}


@pytest.fixture(scope="module")
def ks():
    from types import SimpleNamespace

    from patchray.nodes import ksampler
    from patchray.nodes.bridge import sampling_options

    # the node (schema + one call) and its widget -> PatchConfig mapping, which lives in the bridge
    return SimpleNamespace(PatchRayKSampler=ksampler.PatchRayKSampler, patch_config=sampling_options.patch_config)


@pytest.mark.parametrize("name", sorted(_DOCUMENTED))
def test_presets_are_the_documented_ones_without_cfg_split(ks, name):
    cfg = ks.patch_config(name)
    got = (cfg.layer_mode.value, cfg.groupnorm.value, cfg.output.value, cfg.warmup_steps, cfg.refresh_every)
    assert got == _DOCUMENTED[name]
    assert cfg.split_batch is False
    if cfg.output is OutputMode.OTIL:  # the OTIL paper's exchange: a quarter of the 8x8 latent blocks
        assert (cfg.k_ratio, cfg.block_size) == (0.25, 8)


def test_knobs_override_the_preset(ks):
    cfg = ks.patch_config("otil", warmup_steps=2, refresh_every=0, k_ratio=0.5, block_size=4)
    assert (cfg.warmup_steps, cfg.refresh_every, cfg.k_ratio, cfg.block_size) == (2, 0, 0.5, 4)
    assert cfg.output is OutputMode.OTIL
    # full_sync has no stale steps to tune; balanced has no OTIL exchange to tune
    assert ks.patch_config("full_sync", warmup_steps=3) == PRESETS["full_sync"].replace(split_batch=False)
    assert ks.patch_config("balanced", k_ratio=0.5).k_ratio == PRESETS["balanced"].k_ratio


def test_auto_picks_the_preset_from_the_link(ks):
    assert ks.patch_config("auto", link="pcie4_x16_no_p2p").exchange_bits == 4
    assert ks.patch_config("auto", link="nvlink") == PRESETS["full_sync"].replace(split_batch=False)
    assert ks.patch_config("auto") == PRESETS["full_sync"].replace(split_batch=False)  # no GPU link known: exact


def test_auto_counts_the_ranks_that_share_the_latent(ks):
    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes.bridge import sampling_options as bridge_ksampler

    # PCIe without P2P: displaced's stream hides behind compute at 2 ranks, not at 4 (the arithmetic is in
    # tests/distributed/test_sampling_config.py)
    two = ks.patch_config("auto", link="pcie4_x16_no_p2p", ranks=2)
    four = ks.patch_config("auto", link="pcie4_x16_no_p2p", ranks=4)
    assert (two.layer_mode, two.exchange_bits) == (PRESETS["displaced"].layer_mode, 0)
    assert four.exchange_bits == 4
    # the widgets still apply to the chosen preset
    assert ks.patch_config("auto", warmup_steps=2, link="pcie4_x16_no_p2p", ranks=2).warmup_steps == 2
    # cfg+sequence: two CFG groups, each of half the ranks, share a latent; CPU ranks: no GPU link
    cpu4 = ClusterConfig(num_ranks=4, device="cpu")
    assert bridge_ksampler.auto_inputs(None, cpu4, "cfg+sequence")["ranks"] == 2
    assert bridge_ksampler.auto_inputs(None, cpu4, "sequence")["ranks"] == 4
    assert bridge_ksampler.auto_inputs(None, cpu4, "sequence")["link"] is None
    # cfg and batch: every rank holds whole latents, nothing of a latent travels between ranks -> exact
    assert bridge_ksampler.auto_inputs(None, cpu4, "batch")["ranks"] == 1
    assert ks.patch_config("auto", link="pcie4_x16_no_p2p", ranks=1) == PRESETS["full_sync"].replace(split_batch=False)


def test_bad_widgets_are_refused_with_the_fix(ks):
    with pytest.raises(ValueError, match="preset must be one of"):
        ks.patch_config("fast")
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        ks.patch_config("otil", warmup_steps=0)


def test_refusals_before_touching_comfyui(ks):
    from patchray.distributed.cluster import ClusterConfig

    args = dict(model=object(), seed=0, steps=4, cfg=5.0, sampler_name="euler", scheduler="normal", positive=[],
                negative=[], latent_image={"samples": None}, denoise=1.0)
    cluster = ClusterConfig(num_ranks=2, device="cpu")
    with pytest.raises(TypeError, match="PatchRay Cluster"):
        ks.PatchRayKSampler.execute(cluster="not a cluster", **args)
    with pytest.raises(ValueError, match="parallelism must be one of"):
        ks.PatchRayKSampler.execute(cluster=cluster, parallelism="diagonal", **args)
    with pytest.raises(ValueError, match="k_ratio"):
        ks.PatchRayKSampler.execute(cluster=cluster, preset="otil", k_ratio=0.0, **args)
    with pytest.raises(TypeError, match="LATENT"):
        ks.PatchRayKSampler.execute(cluster=cluster, **dict(args, latent_image=[1]))


def test_schema_offers_comfyuis_samplers_and_the_presets(ks):
    schema = ks.PatchRayKSampler.define_schema()
    inputs = {i.id: i for i in schema.inputs}
    assert {"euler", "dpmpp_2m", "uni_pc"} <= set(inputs["sampler_name"].options)
    assert {"normal", "karras"} <= set(inputs["scheduler"].options)
    assert list(inputs["preset"].options) == [
        "full_sync", "auto", "displaced", "compressed", "compressed_2bit", "compressed_1bit", "otil", "otil_compressed", "balanced"
    ]
    assert all(name in inputs["preset"].tooltip for name in inputs["preset"].options)
    assert inputs["seed"].control_after_generate


@pytest.mark.parametrize("key", ["control", "gligen", "hooks", "area", "mask"])
def test_conditioning_the_bands_cannot_honour_is_refused_with_the_reason(key):
    import torch

    from patchray.nodes.bridge import model as _model

    cond = [[torch.zeros(1, 77, 8), {"pooled_output": torch.zeros(1, 8), key: object()}]]
    with pytest.raises(NotImplementedError, match="sample this graph without PatchRay"):
        _model.check_conditioning("positive", cond)
    _model.check_conditioning("positive", [[torch.zeros(1, 77, 8), {"pooled_output": torch.zeros(1, 8), "strength": 0.5}]])
    with pytest.raises(TypeError, match="CONDITIONING"):
        _model.check_conditioning("negative", {"not": "a list"})


# ComfyUI's KSampler (Advanced) inputs, in its order (nodes.KSamplerAdvanced, ComfyUI 0.3.64), written out by hand:
# a workflow moving from the stock node to PatchRay's keeps its widget values in this order
_STOCK_ADVANCED = ["model", "add_noise", "noise_seed", "steps", "cfg", "sampler_name", "scheduler", "positive",
                   "negative", "latent_image", "start_at_step", "end_at_step", "return_with_leftover_noise"]


def test_the_advanced_node_takes_the_stock_advanced_inputs_then_the_clusters():
    from patchray.nodes.ksampler import PatchRayKSampler, PatchRayKSamplerAdvanced

    adv = [i.id for i in PatchRayKSamplerAdvanced.define_schema().inputs]
    plain = [i.id for i in PatchRayKSampler.define_schema().inputs]
    assert adv[: len(_STOCK_ADVANCED)] == _STOCK_ADVANCED
    # after them, the same cluster inputs as the plain node, from "cluster" on
    assert adv[len(_STOCK_ADVANCED):] == plain[plain.index("cluster"):]
    inputs = {i.id: i for i in PatchRayKSamplerAdvanced.define_schema().inputs}
    assert (inputs["add_noise"].default, inputs["return_with_leftover_noise"].default) == ("enable", "disable")
    assert (inputs["start_at_step"].default, inputs["end_at_step"].default) == (0, 10000)


class _StandInNodes:
    """ComfyUI's ``nodes`` module as far as the Distributed KSampler uses it: ``common_ksampler``, recording its call
    (ComfyUI is not installed in CI; the real composition is tested against the stock nodes in tests/comfyui)."""

    def __init__(self):
        self.calls = []

    def common_ksampler(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, **kw):
        self.calls.append(dict(model=model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, **kw))
        return ({"samples": "latent"},)


@pytest.fixture
def composed(monkeypatch):
    """The KSampler nodes with ComfyUI's ``common_ksampler`` stood in and the Parallel Model's patch recorded."""
    import sys

    from patchray.nodes.bridge import parallel_model

    nodes = _StandInNodes()
    patched = []

    def patch_model(model, options, hooks):
        patched.append((model, options))
        return ("patched", model)

    monkeypatch.setitem(sys.modules, "nodes", nodes)
    monkeypatch.setattr(parallel_model, "patch_model", patch_model)
    return nodes, patched


@pytest.mark.parametrize("add_noise, leftover, want_disable_noise, want_full", [
    ("enable", "enable", False, False),   # the first sampler of a chain: noise in, leftover noise out
    ("disable", "disable", True, True),  # the second: no noise added, denoised fully at its last step
])
def test_the_advanced_node_is_the_stock_advanced_sampler_on_a_parallel_model(composed, add_noise, leftover,
                                                                            want_disable_noise, want_full):
    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes import ksampler

    nodes, patched = composed
    cluster = ClusterConfig(num_ranks=2, device="cpu")
    out = ksampler.PatchRayKSamplerAdvanced.execute(
        "model", add_noise, 7, 20, 3.5, "euler", "simple", "pos", "neg", {"samples": None}, 10, 10000, leftover,
        cluster, parallelism="cfg", sharding="blocks")
    assert out.result == ({"samples": "latent"},)
    (model, options), = patched
    assert model == "model" and (options.cluster, options.parallelism, options.sharding) == (cluster, "cfg", "blocks")
    (call,) = nodes.calls
    # nodes.KSamplerAdvanced.sample's call of common_ksampler (ComfyUI 0.3.64), written out by hand
    assert call == dict(model=("patched", "model"), seed=7, steps=20, cfg=3.5, sampler_name="euler", denoise=1.0,
                        disable_noise=want_disable_noise, start_step=10, last_step=10000, force_full_denoise=want_full)


def test_the_plain_node_is_the_stock_ksampler_on_a_parallel_model(composed):
    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes import ksampler

    nodes, patched = composed
    ksampler.PatchRayKSampler.execute("model", 7, 20, 3.5, "euler", "simple", "pos", "neg", {"samples": None}, 0.6,
                                      ClusterConfig(num_ranks=2, device="cpu"))
    (call,) = nodes.calls
    # nodes.KSampler.sample's call: the whole schedule, noise added, denoise passed through
    assert call == dict(model=("patched", "model"), seed=7, steps=20, cfg=3.5, sampler_name="euler", denoise=0.6,
                        disable_noise=False, start_step=None, last_step=None, force_full_denoise=False)


@pytest.mark.parametrize("start, last", [(-1, None), (None, -3), (2.5, None)])
def test_a_negative_or_fractional_step_is_refused_naming_the_widget(start, last):
    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes.bridge import ksampler as bridge_ksampler
    from patchray.nodes.bridge.sampling_options import SamplingOptions

    with pytest.raises(ValueError, match="at_step must be a step number"):
        bridge_ksampler.ksample(None, SamplingOptions(ClusterConfig(num_ranks=2, device="cpu")), 0, 20, 1.0, "euler",
                                "simple", [], [], {"samples": None}, start_step=start, last_step=last)
