"""PatchRay Parallel Model without ComfyUI: its schema, its options, and what travels to the ranks.

The patched MODEL sampled by ComfyUI's own sampler nodes is tested against the same nodes on the unpatched MODEL in
tests/comfyui/test_parallel_model_server.py (opt-in, a real ComfyUI server); here: the widgets (the Distributed
KSampler's, by name), the guider and sampler objects' way to the ranks (what is refused, what travels by value), and
the guidance the layout decides the CFG split from.
"""

import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch

from patchray.distributed.cluster import ClusterConfig
from patchray.nodes.bridge import parallel_model as pm
from patchray.nodes.bridge import travel
from patchray.nodes.bridge.sampling_options import SamplingOptions

# The Distributed KSampler's cluster inputs, in order, written out by hand: the Parallel Model takes them after "model"
_CLUSTER_INPUTS = ["cluster", "preset", "warmup_steps", "refresh_every", "k_ratio", "block_size", "parallelism",
                   "sequence_attention", "balance", "sharding"]


def test_the_node_takes_the_model_then_the_distributed_ksamplers_cluster_inputs():
    from patchray.nodes.ksampler import PatchRayKSampler
    from patchray.nodes.parallel_model import PatchRayParallelModel

    schema = PatchRayParallelModel.define_schema()
    assert schema.node_id == "PatchRayParallelModel"
    assert [i.id for i in schema.inputs] == ["model"] + _CLUSTER_INPUTS
    ks = {i.id: i for i in PatchRayKSampler.define_schema().inputs}
    for i in schema.inputs[1:]:  # the same widgets: options, defaults and tooltips
        other = ks[i.id]
        assert (getattr(i, "options", None), getattr(i, "default", None), i.tooltip) == (
            getattr(other, "options", None), getattr(other, "default", None), other.tooltip), i.id
    assert [o.io_type for o in schema.outputs] == ["MODEL"]
    assert all(i.tooltip for i in schema.inputs) and all(o.tooltip for o in schema.outputs)


def test_options_refuse_a_bad_widget_in_its_name():
    cluster = ClusterConfig(num_ranks=2, device="cpu")
    SamplingOptions(cluster)  # the defaults are valid
    for change, match in ((dict(preset="fast"), "preset must be one of"),
                          (dict(parallelism="tensor"), "parallelism must be one of"),
                          (dict(sequence_attention="flash"), "sequence_attention must be one of"),
                          (dict(balance="fair"), "balance must be one of"),
                          (dict(sharding="layers"), "sharding must be one of"),
                          (dict(block_size=0), "block_size"),
                          (dict(k_ratio=1.5), "k_ratio"),
                          (dict(warmup_steps=-2), "warmup_steps")):
        with pytest.raises(ValueError, match=match):
            SamplingOptions(cluster, **change)
    with pytest.raises(TypeError, match="PatchRay Cluster"):
        SamplingOptions("cluster")
    # hashable and frozen: the options are part of the patched MODEL's identity
    assert hash(SamplingOptions(cluster)) == hash(SamplingOptions(cluster))


class _Guider:
    """A guider's shape as ComfyUI's ``CFGGuider`` has it (the attributes its ``__init__`` and ``set_conds`` set)."""

    def __init__(self, conds, cfg=None, options=None):
        self.model_patcher = "the driver's model"
        self.model_options = options or {}
        self.original_conds = conds
        if cfg is not None:
            self.cfg = cfg


@pytest.mark.parametrize("conds, cfg, options, want", [
    ({"positive": [1]}, None, None, 1.0),                           # BasicGuider: one conditioning per step
    ({"positive": [1], "negative": [1]}, 1.0, None, 1.0),           # CFGGuider at cfg 1: ComfyUI skips uncond
    ({"positive": [1], "negative": [1]}, 1.0, {"disable_cfg1_optimization": True}, 2.0),
    ({"positive": [1], "negative": [1]}, 5.5, None, 5.5),           # CFGGuider
    ({"positive": [1], "middle": [1], "negative": [1]}, None, None, 2.0),  # DualCFGGuider: three per step
    ({"positive": [1], "negative": []}, 7.0, None, 1.0),            # an empty negative evaluates nothing
])
def test_the_layout_reads_how_many_conditionings_a_guider_evaluates(conds, cfg, options, want):
    assert pm.guider_scale(_Guider(conds, cfg, options)) == want


def test_a_guider_is_sent_without_its_model_and_one_holding_another_model_is_refused():
    g = _Guider({"positive": [1]}, 3.0)
    g.inner_model, g.conds, g.loaded_models = object(), {}, []
    cls, state = pm.portable_guider(g)
    assert cls is _Guider and state == {"original_conds": {"positive": [1]}, "cfg": 3.0}
    g.refiner = {"model": torch.nn.Linear(2, 2)}
    with pytest.raises(NotImplementedError, match=r"_Guider .* 'refiner'"):
        pm.portable_guider(g)


def test_what_does_not_pickle_is_refused_by_name_before_any_rank_starts():
    with pytest.raises(NotImplementedError, match="the sampler Locked cannot travel to the ranks"):
        travel.travel_by_value("the sampler Locked", SimpleNamespace(lock=threading.Lock()))


def test_code_of_another_custom_node_pack_travels_by_value(tmp_path, monkeypatch):
    """A sampler function defined in another pack's folder (which the ranks cannot import) is pickled by value: the
    bytes load in a fresh interpreter that has no such pack, and compute what the function computes."""
    from ray import cloudpickle

    roots = tmp_path / "custom_nodes"
    pack = roots / "third_party_sampler"
    pack.mkdir(parents=True)
    (pack / "__init__.py").write_text(textwrap.dedent('''
        def sample_twice(x):
            return helper(x) * 2

        def helper(x):
            return x + 1
    '''))
    monkeypatch.syspath_prepend(str(roots))
    monkeypatch.setattr(travel, "_custom_node_roots", lambda: [str(roots)])
    import third_party_sampler

    try:
        sampler = SimpleNamespace(sampler_function=third_party_sampler.sample_twice, extra_options={})
        travel.travel_by_value("the sampler KSAMPLER", sampler)
        assert cloudpickle.cloudpickle._is_registered_pickle_by_value(third_party_sampler)
        data = cloudpickle.dumps(sampler)
        code = ("import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); "
                "assert 'third_party_sampler' not in sys.modules; print(s.sampler_function(4))")
        out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, cwd=str(tmp_path), timeout=120)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout.decode().strip() == "10"
    finally:
        cloudpickle.unregister_pickle_by_value(third_party_sampler)
        sys.modules.pop("third_party_sampler", None)


def test_a_class_of_a_module_loaded_under_its_path_travels_by_value(tmp_path):
    """ComfyUI loads comfy_extras (BasicGuider, DualCFGGuider...) under their file paths as module names, which no rank
    can import: such a guider class travels by value and is rebuilt in a fresh interpreter."""
    import importlib.util

    from ray import cloudpickle

    path = tmp_path / "nodes_custom_sampler.py"
    path.write_text("class Guider_Basic:\n    def predict(self, x):\n        return x * 3\n")
    name = str(path.with_suffix(""))  # what ComfyUI's load_custom_node names it
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    try:
        travel.travel_by_value("the guider Guider_Basic", (module.Guider_Basic, {"cfg": 1.0}))
        data = cloudpickle.dumps((module.Guider_Basic, {"cfg": 1.0}))
        code = "import pickle, sys; cls, state = pickle.loads(sys.stdin.buffer.read()); print(cls().predict(5), state['cfg'])"
        out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout.decode().split() == ["15", "1.0"]
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop(name, None)


def test_the_rank_rebuilds_the_drivers_guider_around_its_own_model():
    from patchray.nodes.bridge.ksampler_rank import rebuild_guider

    class Guider(_Guider):
        def __init__(self):  # never called on the rank: the state comes from the driver
            raise AssertionError("the rank must not run the guider's __init__")

    state = {"original_conds": {"positive": [1]}, "cfg": 2.5, "extra": "kept"}
    model = SimpleNamespace(model_options={"transformer_options": {"rank": True}})
    g = rebuild_guider((Guider, state), model)
    assert type(g) is Guider and g.model_patcher is model and g.model_options is model.model_options
    assert (g.original_conds, g.cfg, g.extra) == ({"positive": [1]}, 2.5, "kept")


def _patcher(**over):
    """A ModelPatcher's attributes as check_patches reads them (ComfyUI 0.3.64's names)."""
    base = dict(wrappers={}, callbacks={}, model_options={"transformer_options": {}}, weight_wrapper_patches={},
                hook_patches={}, additional_models={})
    return SimpleNamespace(**dict(base, **over))


def test_a_model_carrying_comfyuis_own_multigpu_split_is_refused_by_name():
    from patchray.nodes.bridge.model import check_patches

    check_patches(_patcher())  # nothing attached: accepted
    with pytest.raises(NotImplementedError, match="ComfyUI's own multi-GPU split .*never split twice"):
        check_patches(_patcher(additional_models={"multigpu": ["clone on cuda:1"]}))
    with pytest.raises(NotImplementedError, match=r"additional models .*\['style'\]"):
        check_patches(_patcher(additional_models={"style": ["m"], "empty": []}))


def test_wrappers_of_other_extensions_are_refused_by_key_and_patchrays_own_pass():
    from patchray.nodes.bridge.model import check_patches

    ours = _patcher(wrappers={"outer_sample": {pm.OUTER_KEY: [print]}})
    check_patches(ours, ignore=(pm.OUTER_KEY,))
    with pytest.raises(NotImplementedError, match="easycache"):
        check_patches(_patcher(wrappers={"outer_sample": {"easycache": [print]}}), ignore=(pm.OUTER_KEY,))
    in_options = _patcher(model_options={"transformer_options": {"wrappers": {"diffusion_model": {"x.y": [print]}}}})
    with pytest.raises(NotImplementedError, match="x.y"):
        check_patches(in_options, ignore=(pm.OUTER_KEY,))
    with pytest.raises(NotImplementedError, match="TorchCompileModel"):
        check_patches(_patcher(wrappers={"apply_model": {"torch.compile": [print]}}))


def test_auto_keeps_a_conditioning_the_sequence_split_cannot_follow_whole():
    """Under parallelism auto, a UNet's area/mask conditions and a DiT row's refused conditionings (FLUX reference
    latents) are reasons to pick a whole-model split (cfg, batch) instead of refusing: the reason names the
    conditioning."""
    Flux = type("Flux", (), {})  # the DiT table finds rows by class name
    mp = SimpleNamespace(model=SimpleNamespace(diffusion_model=Flux()))
    plain = {"positive": [[torch.zeros(1, 4, 8), {"pooled_output": torch.zeros(1, 8)}]], "negative": []}
    assert pm._sequence_cond_reason(mp, "dit", plain) is None
    area = {"positive": [[torch.zeros(1, 4, 8), {"area": (8, 8, 0, 0)}]]}
    assert "area conditioning in positive" in pm._sequence_cond_reason(mp, "unet", area)
    assert pm._sequence_cond_reason(mp, "dit", area) is None  # a DiT's split follows each call's crop
    ref = {"negative": [[torch.zeros(1, 4, 8), {"reference_latents": [torch.zeros(1, 16, 4, 4)]}]]}
    why = pm._sequence_cond_reason(mp, "dit", ref)
    assert "Kontext" in why and "in negative" in why and "use parallelism" not in why


def test_a_latent_of_another_models_channels_is_refused_before_shipping_but_an_empty_one_is_left_to_comfyui():
    from patchray.nodes.bridge.model import check_latent_channels

    class _Patcher:
        model = SimpleNamespace(diffusion_model=type("WanModel", (), {})())

        def get_model_object(self, name):
            assert name == "latent_format"
            return SimpleNamespace(latent_channels=16)

    mp = _Patcher()
    check_latent_channels(mp, torch.randn(1, 16, 5, 8, 8))  # the model's own channels
    check_latent_channels(mp, torch.zeros(1, 4, 8, 8))  # empty: ComfyUI resizes it (fix_empty_latent_channels)
    with pytest.raises(ValueError) as exc:
        check_latent_channels(mp, torch.randn(1, 4, 8, 8))
    text = str(exc.value)
    assert "4 channels" in text and "16-channel" in text and "WanModel" in text and "VAE" in text
