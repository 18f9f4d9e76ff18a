"""The Distributed KSampler node without ComfyUI: its widget -> PatchConfig mapping and its refusals.

Running the node needs ComfyUI's sampler on the ranks (a MODEL is a ComfyUI ModelPatcher); that path is tested
against the stock KSampler in tests/comfyui (opt-in, COMFYUI_DIR), and the machinery under it (model shipped once
per key, the caller's sampler on every rank, the exact final latent) in tests/distributed/test_remote_sampling.py
on real Ray ranks.
"""

import inspect

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
    from patchray.nodes.bridge import ksampler as bridge_ksampler

    # the node (schema + one call) and its widget -> PatchConfig mapping, which lives in the bridge
    return SimpleNamespace(PatchRayKSampler=ksampler.PatchRayKSampler, patch_config=bridge_ksampler.patch_config)


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
    from patchray.nodes.bridge import ksampler as bridge_ksampler

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

    args = dict(model=object(), seed=0, steps=4, cfg=5.0, scheduler="normal", positive=[], negative=[],
                latent_image={"samples": None}, denoise=1.0)
    with pytest.raises(ValueError, match="adapts its step count"):
        ks.PatchRayKSampler.execute(sampler_name="dpm_adaptive", cluster=ClusterConfig(num_ranks=2, device="cpu"), preset="otil", **args)
    with pytest.raises(TypeError, match="PatchRay Cluster"):
        ks.PatchRayKSampler.execute(sampler_name="euler", cluster="not a cluster", **args)
    with pytest.raises(TypeError, match="LATENT"):
        ks.PatchRayKSampler.execute(sampler_name="euler", cluster=ClusterConfig(num_ranks=2, device="cpu"), **dict(args, latent_image=[1]))


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
    with pytest.raises(NotImplementedError, match="use the stock KSampler"):
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


@pytest.mark.parametrize("add_noise, leftover, want_noise, want_full", [
    ("enable", "enable", True, False),   # the first sampler of a chain: noise in, leftover noise out
    ("disable", "disable", False, True),  # the second: no noise added, denoised fully at its last step
])
def test_the_advanced_node_hands_its_part_of_the_schedule_to_the_bridge(monkeypatch, add_noise, leftover, want_noise, want_full):
    from patchray.nodes import ksampler
    from patchray.nodes.bridge import ksampler as bridge_ksampler

    seen = {}

    def bridge_sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                      cluster, config, **kw):
        seen.update(seed=seed, steps=steps, denoise=denoise, **kw)
        return {"samples": "latent"}

    monkeypatch.setattr(bridge_ksampler, "sample", bridge_sample)
    out = ksampler.PatchRayKSamplerAdvanced.execute(
        "model", add_noise, 7, 20, 3.5, "euler", "simple", "pos", "neg", {"samples": None}, 10, 10000, leftover,
        "cluster")
    assert out.result == ({"samples": "latent"},)
    assert (seen["seed"], seen["steps"], seen["denoise"]) == (7, 20, 1.0)
    assert (seen["add_noise"], seen["start_step"], seen["last_step"], seen["force_full_denoise"]) == (
        want_noise, 10, 10000, want_full)


def test_the_plain_node_runs_the_whole_schedule(monkeypatch):
    from patchray.nodes import ksampler
    from patchray.nodes.bridge import ksampler as bridge_ksampler

    # the stock KSampler's call (nodes.common_ksampler): noise added, no start or end step, no forced full denoise;
    # the plain node passes none of the schedule, so the bridge's defaults are that call
    params = inspect.signature(bridge_ksampler.sample).parameters
    assert (params["add_noise"].default, params["start_step"].default, params["last_step"].default,
            params["force_full_denoise"].default) == (True, None, None, False)
    seen = {}

    def bridge_sample(*args, **kw):
        seen.update(kw)
        return {"samples": "latent"}

    monkeypatch.setattr(bridge_ksampler, "sample", bridge_sample)
    ksampler.PatchRayKSampler.execute("model", 7, 20, 3.5, "euler", "simple", "pos", "neg", {"samples": None}, 1.0, "cluster")
    assert seen and not {"add_noise", "start_step", "last_step", "force_full_denoise"} & set(seen), seen


class _StandInSample:
    """``comfy.sample`` as far as the bridge uses it, recording the sampler's call (ComfyUI is not installed in CI)."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def fix_empty_latent_channels(model, latent):
        return latent

    @staticmethod
    def prepare_noise(latent, seed, batch_index=None):
        return torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))

    def sample(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return args[8]  # the latent


@pytest.fixture()
def standin_sample(monkeypatch):
    import sys
    import types

    fake = _StandInSample()
    comfy = types.ModuleType("comfy")
    comfy.sample = fake
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.sample", fake)
    return fake


def test_the_ranks_hand_the_schedule_to_comfyuis_sampler(standin_sample):
    from types import SimpleNamespace

    from patchray.nodes.bridge import ksampler_rank

    session = SimpleNamespace(progress=lambda *a: None)
    model = SimpleNamespace(model=SimpleNamespace(__dict__={}))
    latent = torch.zeros(1, 4, 8, 8)
    inputs = {"noise": latent, "steps": 20, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple",
              "positive": [], "negative": [], "latent_image": latent, "denoise": 1.0, "seed": 7,
              "disable_noise": True, "start_step": 10, "last_step": 10000, "force_full_denoise": True}
    ksampler_rank._run(model, session, inputs)
    (args, kwargs), = standin_sample.calls
    assert args[2] == 20 and args[8] is latent
    assert (kwargs["disable_noise"], kwargs["start_step"], kwargs["last_step"], kwargs["force_full_denoise"]) == (
        True, 10, 10000, True)
    # inputs without the schedule (the plain node, and callers from before the advanced node): the whole schedule
    for key in ("disable_noise", "start_step", "last_step", "force_full_denoise"):
        inputs.pop(key)
    ksampler_rank._run(model, session, inputs)
    kwargs = standin_sample.calls[-1][1]
    assert (kwargs["disable_noise"], kwargs["start_step"], kwargs["last_step"], kwargs["force_full_denoise"]) == (
        False, None, None, False)


def test_add_noise_disable_gives_zero_noise(standin_sample):
    from patchray.nodes.bridge import model as bridge_model

    latent = torch.ones(1, 4, 6, 10)
    _, noise = bridge_model.latent_and_noise(None, {"samples": latent}, 3)
    assert noise.abs().sum() > 0  # the seeded noise
    _, none = bridge_model.latent_and_noise(None, {"samples": latent}, 3, add_noise=False)
    assert none.shape == latent.shape and not none.any()


def test_a_start_past_the_end_returns_the_latent_before_any_rank_starts(monkeypatch):
    """ComfyUI's sampler returns the latent as it came when the start step is at or past the end; the node does the
    same without starting the ranks or shipping the model (a two-expert chain would otherwise evict the other
    expert from the ranks' one-model cache)."""
    import patchray.distributed.cluster as cluster_mod
    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes.bridge import ksampler as bridge_ksampler
    from patchray.nodes.bridge import model as bridge_model

    latent = torch.randn(1, 16, 4, 6, 6)
    monkeypatch.setattr(bridge_model, "check_model_type", lambda m: None)
    monkeypatch.setattr(bridge_model, "diffusion_kind", lambda m: "dit")
    monkeypatch.setattr(bridge_model, "latent_and_noise", lambda m, lat, seed, add_noise=True: (lat["samples"], None))
    monkeypatch.setattr(bridge_model, "schedule_steps", lambda m, steps, *a: steps)

    def no_ranks(*a, **k):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(cluster_mod, "get_cluster", no_ranks)
    lines = []
    out = bridge_ksampler.sample(
        "model", 0, 20, 5.0, "euler", "simple", [], [], {"samples": latent, "batch_index": [0]}, 1.0,
        ClusterConfig(num_ranks=2), bridge_ksampler.patch_config("full_sync"), start_step=12, last_step=10,
        add_noise=False, report=lines.append)
    assert out["samples"] is latent and out["batch_index"] == [0]
    assert "nothing to sample" in lines[0] and "step 10 of 20" in lines[0]


@pytest.mark.parametrize("total, start, last, want", [
    (20, None, None, 20),
    (20, 0, 10, 10),       # Wan 2.2 14B's high-noise expert: steps 0-9
    (20, 10, 10000, 10),   # its low-noise expert: steps 10-19
    (20, 10, 10, 0),       # an empty range returns the latent untouched
    (20, 25, None, 0),
    (20, None, 0, 0),
    (20, 3, 7, 4),
])
def test_steps_run_follows_comfyuis_cut_of_the_sigmas(total, start, last, want):
    from patchray.nodes.bridge.ksampler import steps_run

    assert steps_run(total, start, last) == want


@pytest.mark.parametrize("start, last", [(-1, None), (None, -3), (2.5, None)])
def test_a_negative_or_fractional_step_is_refused_naming_the_widget(start, last):
    from patchray.nodes.bridge import ksampler as bridge_ksampler

    widget = "start_at_step" if start is not None else "end_at_step"
    with pytest.raises(ValueError, match=widget):
        bridge_ksampler.sample(None, 0, 20, 1.0, "euler", "simple", [], [], {"samples": None}, 1.0, None,
                               bridge_ksampler.patch_config("full_sync"), start_step=start, last_step=last)
