"""GGUF models (the ComfyUI-GGUF pack) on the ranks, without ComfyUI or the pack: what the driver reads and ships,
what the rank rebuilds, and the sharding refusal.

The stand-in pack below copies what PatchRay relies on of the pack's ``ops.py`` (city96/ComfyUI-GGUF): a
``GGMLTensor`` of raw bytes whose ``shape`` property answers the logical (dequantized) shape and whose ``detach`` and
``clone`` return itself, Python attributes ``tensor_type``/``tensor_shape``/``patches``; a layer that writes a fake
state dict (meta placeholders and a ``temp.weight``), dequantizes per call, adds the tensor's patches, and whose code
mentions ``torch.ops``. Its format is a toy row quantization (int8 values and a float32 scale per row: more bytes per
row than values, as in GGML's blocks). It is loaded under its file path, as ComfyUI loads custom nodes, so no rank
can import it. Against the real pack and ComfyUI: tests/comfyui/test_gguf_ranks.py (opt-in).
"""

import subprocess
import sys
import textwrap

import pytest
import torch

from patchray.distributed.context import ParallelContext
from patchray.distributed.sampling.ship import fill_tensors, materialize_meta
from patchray.distributed.sampling.weights import from_arrays, to_arrays
from patchray.nodes.bridge import gguf_weights as gw
from patchray.nodes.bridge import shard_models as bs

PACK = '''
import enum
import torch


class QType(enum.IntEnum):  # gguf.GGMLQuantizationType's names
    F32 = 0
    F16 = 1
    Q8_0 = 8


class GGMLTensor(torch.Tensor):
    def __init__(self, *args, tensor_type, tensor_shape, patches=[], **kwargs):
        super().__init__()
        self.tensor_type = tensor_type
        self.tensor_shape = tensor_shape
        self.patches = patches

    def __new__(cls, *args, tensor_type, tensor_shape, patches=[], **kwargs):
        return super().__new__(cls, *args, **kwargs)

    def clone(self, *args, **kwargs):
        return self

    def detach(self, *args, **kwargs):
        return self

    @property
    def shape(self):
        if not hasattr(self, "tensor_shape"):
            self.tensor_shape = self.size()
        return self.tensor_shape


def quantize(w):
    """Rows of int8 values and a float32 scale: uint8 [rows, cols + 4]."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(w / scale).to(torch.int8)
    raw = torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)
    return GGMLTensor(raw, tensor_type=QType.Q8_0, tensor_shape=w.shape)


def dequantize(t):
    cols = t.tensor_shape[1]
    raw = t.as_subclass(torch.Tensor)
    return raw[:, :cols].view(torch.int8).float() * raw[:, cols:].contiguous().view(torch.float32)


class Linear(torch.nn.Module):
    dequant_dtype = None
    patch_dtype = None

    def __init__(self, w, b):
        super().__init__()
        self.weight = torch.nn.Parameter(quantize(w), requires_grad=False)
        self.bias = torch.nn.Parameter(GGMLTensor(b, tensor_type=QType.F32, tensor_shape=b.shape), requires_grad=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return self.ggml_save_to_state_dict(destination, prefix, keep_vars)

    def ggml_save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = torch.zeros_like(self.weight, device="meta")
        destination[prefix + "bias"] = torch.zeros_like(self.bias, device="meta")
        destination[prefix + "temp.weight"] = torch.empty(*self.weight.tensor_shape, device="meta")

    def forward(self, x):
        w = dequantize(self.weight)
        for patches, key in self.weight.patches:  # ComfyUI's patch lists; here each item a tensor to add
            for delta in patches:
                w = w + delta
        return torch.ops.aten.linear(x, w, self.bias.as_subclass(torch.Tensor))


class WanModel(torch.nn.Module):  # not the pack's: a diffusion model named like a row of the block table
    def __init__(self, layer):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"ffn": layer})])
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.blocks[0]["ffn"](x))
'''


@pytest.fixture
def pack(tmp_path):
    """The stand-in pack, loaded under its file path as ComfyUI loads a custom node (no rank can import it)."""
    import importlib.util

    from ray import cloudpickle

    path = tmp_path / "ComfyUI-FakeGGUF" / "ops.py"
    path.parent.mkdir()
    path.write_text(PACK)
    name = str(path.with_suffix("")).replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    if cloudpickle.cloudpickle._is_registered_pickle_by_value(module):
        cloudpickle.unregister_pickle_by_value(module)
    sys.modules.pop(name, None)


def _model(pack):
    g = torch.Generator().manual_seed(0)
    return pack.WanModel(pack.Linear(torch.randn(6, 8, generator=g), torch.randn(6, generator=g)))


def test_quantized_means_a_type_other_than_f32_and_f16(pack):
    q = pack.quantize(torch.ones(2, 4))
    f32 = pack.GGMLTensor(torch.ones(3), tensor_type=pack.QType.F32, tensor_shape=torch.Size([3]))
    assert gw.is_ggml(q) and gw.is_quantized(q)
    assert gw.is_ggml(f32) and not gw.is_quantized(f32)
    assert not gw.is_ggml(torch.ones(3)) and not gw.is_quantized(torch.nn.Parameter(torch.ones(3)))
    assert gw.holds_ggml(_model(pack)) and not gw.holds_ggml(torch.nn.Linear(2, 2))


def test_the_live_state_holds_the_layers_tensors_not_their_fake_state_dict(pack):
    dm = _model(pack)
    state = dm.state_dict(keep_vars=True)
    assert state["blocks.0.ffn.weight"].is_meta and "blocks.0.ffn.temp.weight" in state  # the pack's fake
    live = gw.live_state(dm, state)
    layer = dm.blocks[0]["ffn"]
    assert list(live) == ["blocks.0.ffn.weight", "blocks.0.ffn.bias", "head.weight", "head.bias"]  # order kept
    assert live["blocks.0.ffn.weight"] is layer.weight and live["blocks.0.ffn.bias"] is layer.bias
    assert live["head.weight"] is dm.head.weight
    plain = torch.nn.Linear(2, 2)
    assert gw.live_state(plain, plain.state_dict(keep_vars=True)).keys() == {"weight", "bias"}


def test_a_placeholder_keeps_the_class_type_and_raw_size_without_data_or_patches(pack):
    w = pack.quantize(torch.randn(6, 8))
    w.patches = [("driver's live patches", "k")]
    meta = gw.meta_like(w)
    assert type(meta) is type(w) and meta.is_meta and meta.dtype == torch.uint8
    assert meta.size() == torch.Size([6, 12]) and meta.shape == torch.Size([6, 8])  # raw bytes, logical shape
    assert meta.tensor_type == pack.QType.Q8_0 and meta.patches == []


def test_the_rank_allocates_a_subclass_by_its_storage_size_with_its_attributes(pack):
    """``empty_like`` of a meta tensor reads the Python ``shape``, which the pack's tensor redefines: the rank's tensor
    came out the dequantized size (8 columns for 12 bytes), and without the quantization type."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(gw.meta_like(pack.quantize(torch.randn(6, 8))), requires_grad=False)
    model.register_buffer("scale", torch.empty(3, device="meta"))
    materialize_meta(model, torch.device("cpu"))
    w = model.weight
    assert type(w) is pack.GGMLTensor and not w.is_meta and w.size() == torch.Size([6, 12])
    assert w.tensor_type == pack.QType.Q8_0 and w.tensor_shape == torch.Size([6, 8]) and w.patches == []
    assert type(model.scale) is torch.Tensor and model.scale.shape == (3,)  # plain tensors as before


def test_a_shipped_tensor_of_another_size_is_refused_not_broadcast():
    model = torch.nn.Linear(4, 3)
    ctx = ParallelContext.single(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"weight: the shipped tensor has size \(1, 4\), the rank's \(3, 4\)"):
        fill_tensors(model, {"weight": torch.zeros(1, 4)}, ctx)
    assert fill_tensors(model, {"weight": torch.ones(3, 4)}, ctx) == 48 and torch.equal(model.weight, torch.ones(3, 4))


def test_a_gguf_model_travels_by_value_and_the_rank_computes_what_the_driver_does(pack, tmp_path):
    """The driver's side (placeholders, bytes, the LoRA patches of the quantized weight, the classes by value with
    ``torch.ops`` by reference), then a fresh interpreter that never saw the pack: it rebuilds the model as the rank
    does (materialize, fill, attach) and computes exactly the driver's output with the same patch attached."""
    from ray import cloudpickle

    dm = _model(pack)
    live = gw.live_state(dm, dm.state_dict(keep_vars=True))
    memo = {id(t): torch.nn.Parameter(gw.meta_like(t) if gw.is_ggml(t) else torch.empty_like(t, device="meta"),
                                      requires_grad=False) for t in live.values()}
    import copy

    skeleton = copy.deepcopy(dm, memo)
    gw.layer_settings(skeleton)
    delta = 0.1 * torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    mp = type("MP", (), {"patches": {"blocks.0.ffn.weight": [delta], "head.weight": [(1.0,)]}})()
    payload = {"skeleton": skeleton, "ggml_patches": gw.quantized_patches(mp, live)}
    assert list(payload["ggml_patches"]) == ["blocks.0.ffn.weight"]  # only quantized weights' patches travel this way
    gw.travel_by_value("the GGUF model", payload)
    weights = {k: gw.raw_bytes(t) if gw.is_quantized(t) else t.detach() for k, t in live.items()}
    assert type(weights["blocks.0.ffn.weight"]) is torch.Tensor and weights["blocks.0.ffn.weight"].shape == (6, 12)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    dm.blocks[0]["ffn"].weight.patches = [([delta], "blocks.0.ffn.weight")]  # as the pack's patcher attaches it
    with torch.no_grad():
        want = dm(x)
    data = cloudpickle.dumps((payload, to_arrays(weights), x))
    code = textwrap.dedent("""
        import pickle, sys, torch
        from patchray.distributed.context import ParallelContext
        from patchray.distributed.sampling.ship import fill_tensors, materialize_meta
        from patchray.distributed.sampling.weights import from_arrays
        from patchray.nodes.bridge import gguf_weights as gw
        payload, (arrays, views), x = pickle.loads(sys.stdin.buffer.read())
        assert not any("FakeGGUF" in m for m in sys.modules)  # the classes came by value
        model = payload["skeleton"]
        materialize_meta(model, torch.device("cpu"))
        fill_tensors(model, from_arrays(arrays, views, copy=False), ParallelContext.single(torch.device("cpu")))
        print(gw.attach_patches(model, payload["ggml_patches"], torch.device("cpu")))
        w = model.blocks[0]["ffn"].weight
        print(type(w).__name__, tuple(w.size()), tuple(w.shape), w.tensor_type.name, w.dtype)
        with torch.no_grad():
            sys.stdout.buffer.write(pickle.dumps(model(x)))
    """)
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, cwd=str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    head, _, tail = out.stdout.partition(b"GGMLTensor")
    assert head.decode().split() == ["1"]
    line, _, rest = tail.partition(b"\n")
    assert line.decode().split() == ["(6,", "12)", "(6,", "8)", "Q8_0", "torch.uint8"]
    import pickle

    got = pickle.loads(rest)
    assert torch.equal(got, want)  # the same bytes, type and patch: the same arithmetic, bit for bit


def test_weight_sharding_refuses_a_gguf_model_by_name_and_auto_keeps_it_whole(pack):
    gguf_dm, plain_dm = _model(pack), pack.WanModel(torch.nn.Linear(8, 6))
    assert bs.blocks_for(plain_dm) == ("blocks.*",)
    for sharding in ("blocks", "blocks+offload"):
        with pytest.raises(NotImplementedError, match=f"sharding={sharding.replace('+', '.')} cannot shard a GGUF model.*"
                                                      "use sharding=none.*fp8 or fp16 file"):
            bs.blocks_for(gguf_dm, sharding)
        with pytest.raises(NotImplementedError, match="cannot shard a GGUF model"):
            bs.resolve_sharding(sharding, gguf_dm, 2, None)
    gib = 1024**3
    # free memory far below the model: auto shards the plain model, keeps the GGUF one whole and says why
    assert bs.resolve_sharding("auto", plain_dm, 2, 1.0, 8 * gib)[0] in bs.SHARDED
    resolved, why = bs.resolve_sharding("auto", gguf_dm, 2, 1.0, 8 * gib)
    assert resolved == "none" and "GGUF model's quantized weights cannot be sharded" in why
    assert gw.sharding_refusal(plain_dm, "blocks") is None
