"""The weight the Parallel Model ships for a patched (LoRA) weight, without ComfyUI: ``model.patch_weight`` follows
``ModelPatcher.patch_weight_to_device`` (ComfyUI 0.3.64) step by step, and on a scaled-fp8 layer goes through the
layer's own ``convert_weight`` / ``set_weight`` (asked to return the weight, so the driver's layer is untouched).

The layer here copies the arithmetic of ComfyUI 0.3.64's ``comfy.ops.scaled_fp8_ops`` Linear; the rounding is a
seeded stand-in that records its calls (ComfyUI's is ``comfy.float.stochastic_rounding``). Against ComfyUI itself,
byte for byte and sampled, in tests/comfyui/test_shard_ranks.py (``wan21-seq-scaled-lora``).
"""

import pytest
import torch

from patchray.nodes.bridge.model import patch_weight

FP8 = torch.float8_e4m3fn


class _Rounding:
    """A seeded rounding that records ``(dtype, seed)`` per call: adds seeded noise below the fp8 step, then casts."""

    def __init__(self):
        self.calls = []

    def __call__(self, value, dtype, seed=0):
        self.calls.append((dtype, seed))
        g = torch.Generator().manual_seed(seed)
        return (value * (1 + 0.01 * torch.rand(value.shape, generator=g))).to(dtype)


class ScaledLinear(torch.nn.Module):
    """ComfyUI 0.3.64's scaled-fp8 Linear: ``convert_weight`` and ``set_weight`` as in ``comfy/ops.py``."""

    def __init__(self, rounding):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.rounding = rounding
        self.scale_weight = torch.nn.Parameter(torch.tensor(0.004), requires_grad=False)
        self.weight = torch.nn.Parameter((torch.randn(8, 6, generator=g) * 0.3 / 0.004).to(FP8), requires_grad=False)

    def convert_weight(self, weight, inplace=False, **kwargs):
        if inplace:
            weight *= self.scale_weight.to(device=weight.device, dtype=weight.dtype)
            return weight
        return weight * self.scale_weight.to(device=weight.device, dtype=weight.dtype)

    def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
        weight = self.rounding(weight / self.scale_weight.to(device=weight.device, dtype=weight.dtype), self.weight.dtype, seed=seed)
        if return_weight:
            return weight
        if inplace_update:
            self.weight.data.copy_(weight)
        else:
            self.weight = torch.nn.Parameter(weight, requires_grad=False)


def _lora(w):
    """A stand-in ``comfy.lora.calculate_weight``: adds a fixed low-rank delta to the float32 weight."""
    assert w.dtype == torch.float32
    g = torch.Generator().manual_seed(2)
    return w + 0.05 * torch.randn(w.shape[0], 2, generator=g) @ torch.randn(2, w.shape[1], generator=g)


def test_scaled_fp8_weight_is_the_layers_own_set_weight_and_leaves_the_layer_alone():
    rounding = _Rounding()
    layer = ScaledLinear(rounding)
    before = layer.weight.detach().clone()
    param = layer.weight
    out = patch_weight(layer.weight, layer.weight.dtype, "blocks.0.q.weight", _lora, seed=1234, rounding=rounding,
                       set_func=layer.set_weight, convert_func=layer.convert_weight)
    # what ComfyUI writes into the layer: set_weight(calculate(convert_weight(fp32 weight)), seed=the key's)
    ref_layer = ScaledLinear(_Rounding())
    ref_layer.set_weight(_lora(ref_layer.convert_weight(before.to(torch.float32))), seed=1234)
    assert out.dtype == FP8 and out.device.type == "cpu"
    assert torch.equal(out.view(torch.uint8), ref_layer.weight.view(torch.uint8))
    assert rounding.calls == [(FP8, 1234)]  # rounded once, to the layer's dtype, with the given seed
    # the driver's layer is unchanged: same parameter object, same bytes, same scale
    assert layer.weight is param and torch.equal(layer.weight.view(torch.uint8), before.view(torch.uint8))
    assert layer.scale_weight.item() == pytest.approx(0.004)
    # the scale was applied: the weight it stands for moved by the LoRA's delta, not by a factor 1 / scale
    rel = ((out.float() * 0.004 - before.float() * 0.004).norm() / (before.float() * 0.004).norm()).item()
    assert 0.01 < rel < 0.5, rel


def test_plain_weight_is_rounded_to_its_dtype_with_the_keys_seed():
    rounding = _Rounding()
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = patch_weight(w, torch.bfloat16, "k.weight", _lora, seed=77, rounding=rounding)
    assert rounding.calls == [(torch.bfloat16, 77)]
    assert torch.equal(out, _Rounding()(_lora(w.to(torch.float32)), torch.bfloat16, seed=77))


def test_a_setter_that_cannot_return_the_weight_is_refused_by_name_before_it_runs():
    layer = ScaledLinear(_Rounding())
    before = layer.weight.detach().clone()
    calls = []

    def set_weight(weight, inplace_update=False, seed=None, **kwargs):  # another extension's setter: writes, returns nothing
        calls.append(seed)
        layer.weight = torch.nn.Parameter(weight.to(FP8), requires_grad=False)

    with pytest.raises(NotImplementedError, match=r"custom setter that cannot return the weight \(blocks\.1\.k\.weight"):
        patch_weight(layer.weight, FP8, "blocks.1.k.weight", _lora, seed=5, rounding=_Rounding(), set_func=set_weight,
                     convert_func=layer.convert_weight)
    assert calls == [] and torch.equal(layer.weight.view(torch.uint8), before.view(torch.uint8))
