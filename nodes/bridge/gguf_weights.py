"""GGUF models (the ComfyUI-GGUF pack's ``Unet Loader (GGUF)``) on the ranks: quantized tensors travel as they are.

The pack keeps each weight as a ``GGMLTensor`` (a ``torch.Tensor`` subclass of the raw GGML bytes, ``uint8 [rows,
bytes per row]``, with ``tensor_type`` (the GGML quantization type) and ``tensor_shape`` (the logical shape) as Python
attributes) inside its ``GGMLOps`` layers, which dequantize the weight at every call. Its ``GGUFModelPatcher`` applies
a LoRA to a quantized weight by attaching the patches to the tensor (``tensor.patches = [(patches, key)]``): the layer
dequantizes, then adds the patches, at every call.

Design decisions:

* **The ranks hold the quantized bytes, never a dequantized model.** The driver ships each GGML tensor's bytes; the
  skeleton's placeholder keeps the tensor's class, quantization type and logical shape, and the rank's tensor is
  allocated from it (``sampling.ship.materialize_meta`` keeps a tensor subclass's attributes). The pack's own layers
  dequantize per call on the ranks, as in ComfyUI's process.
* **A LoRA on a quantized weight is applied as the pack applies it**: its patches travel with the skeleton (once per
  model and weight-patch set, like the weights) and are attached to the rank's tensor; the layer adds them per call
  in the compute dtype (``GGMLLayer.get_weight``), exactly as stock. A LoRA on the pack's unquantized (F32/F16)
  tensors ships patched, the way ComfyUI's and the pack's patcher write it (``model.patch_weight``).
* **The pack is never imported here.** Its tensors and layers are recognised by what they carry (``tensor_type`` and
  ``tensor_shape``; ``ggml_save_to_state_dict``); its classes reach the ranks by value (``travel
  .travel_by_value``: the pack is loaded under its folder's path, a name no rank can import), so a rank needs the
  ``gguf`` package (the pack's dependency), not the pack.
* **No weight sharding.** FSDP2 gathers a parameter as a plain tensor: a gathered GGML weight would lose its
  quantization type, and the layer would read raw bytes as weights. ``sharding=blocks`` is refused by name before
  any rank starts; ``auto`` keeps each rank's model whole (quantized weights are a quarter to a half of fp16's).
"""

from __future__ import annotations

import functools
from typing import Dict, Optional

import torch

__all__ = [
    "is_ggml", "is_quantized", "is_ggml_layer", "holds_ggml", "live_state", "meta_like", "layer_settings", "raw_bytes",
    "quantized_patches", "attach_patches", "travel_by_value", "sharding_refusal",
]

#: GGML types the pack's layers use as plain torch tensors (``dequant.TORCH_COMPATIBLE_QTYPES``: None, F32, F16)
_TORCH_TYPES = ("F32", "F16")
#: the pack's per-layer dequantization settings (class attributes its loader sets on ``GGMLOps.Linear``)
_LAYER_SETTINGS = ("dequant_dtype", "patch_dtype")


def is_ggml(t) -> bool:
    """Whether ``t`` is one of the pack's ``GGMLTensor`` weights (quantized or not)."""
    return isinstance(t, torch.Tensor) and "tensor_type" in getattr(t, "__dict__", {}) and "tensor_shape" in t.__dict__


def is_quantized(t) -> bool:
    """Whether ``t`` holds GGML-quantized bytes (the pack's ``dequant.is_quantized``: a type other than F32/F16)."""
    if not is_ggml(t) or t.tensor_type is None:
        return False
    return getattr(t.tensor_type, "name", str(t.tensor_type)) not in _TORCH_TYPES


def is_ggml_layer(module) -> bool:
    """Whether ``module`` is one of the pack's ``GGMLOps`` layers (its state dict holds placeholders, see
    :func:`live_state`)."""
    return callable(getattr(type(module), "ggml_save_to_state_dict", None))


def holds_ggml(module) -> bool:
    """Whether ``module`` holds any GGML-quantized tensor (a GGUF model)."""
    return any(is_quantized(p) for p in module.parameters())


def live_state(base, state: dict) -> dict:
    """``state`` (``base.state_dict(keep_vars=True)``) with the pack's layers' real tensors.

    The pack's layers write a fake state dict for ComfyUI's memory estimate: meta tensors in place of their weights,
    and a ``temp.weight`` the size of the largest dequantized weight. Their entries are replaced by the layers' own
    parameters and persistent buffers, in the state dict's order; ``temp.weight`` is dropped."""
    real, fake = {}, set()
    for path, m in base.named_modules():
        if not is_ggml_layer(m):
            continue
        prefix = f"{path}." if path else ""
        children = {f"{prefix}{n}." for n, _ in m.named_children()}
        fake.update(k for k in state if k.startswith(prefix) and not any(k.startswith(c) for c in children))
        real.update({prefix + n: p for n, p in m._parameters.items() if p is not None})
        real.update({prefix + n: b for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set})
    if not fake:
        return state
    out = {}
    for k, v in state.items():
        if k not in fake:
            out[k] = v
        elif k in real:
            out[k] = real.pop(k)
    out.update(real)
    return out


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A placeholder of GGML tensor ``t`` on the meta device: its class, its raw size and dtype, its quantization type
    and logical shape, no data and no LoRA patches (the rank attaches those: :func:`attach_patches`)."""
    meta = torch.empty(t.size(), dtype=t.dtype, device="meta").as_subclass(type(t))
    meta.__dict__.update({k: v for k, v in t.__dict__.items() if k not in ("patches", "_is_param")})
    meta.__dict__["patches"] = []
    return meta


def layer_settings(skeleton) -> None:
    """Pin the pack's dequantization settings on each of ``skeleton``'s GGML layers (instance attributes): the pack's
    loader writes them on a shared class, which a rank receives as it was when the model shipped."""
    for m in skeleton.modules():
        if is_ggml_layer(m):
            for name in _LAYER_SETTINGS:
                m.__dict__[name] = getattr(m, name, None)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of GGML tensor ``t`` as a plain tensor on the host (what ships; the rank's placeholder gives them
    back their type)."""
    return t.detach().as_subclass(torch.Tensor).to("cpu")


def _to_host(item):
    if isinstance(item, torch.Tensor):
        return item.detach().to("cpu")
    if isinstance(item, tuple):
        return tuple(_to_host(x) for x in item)
    if isinstance(item, list):
        return [_to_host(x) for x in item]
    return item


def quantized_patches(mp, live: dict) -> Dict[str, list]:
    """The MODEL's weight patches (LoRAs) of its GGML-quantized weights, on the host: ``{key: patches}`` (what the
    pack's ``GGUFModelPatcher.patch_weight_to_device`` attaches to those tensors)."""
    return {k: _to_host(p) for k, p in mp.patches.items() if p and is_quantized(live.get(k))}


def attach_patches(base, patches: Optional[Dict[str, list]], device) -> int:
    """Rank side: attach ``patches`` (:func:`quantized_patches`) to the GGML tensors of ``base`` as the pack's patcher
    does (``tensor.patches = [(patches, key)]``, the patches on ``device``: the rank's offload device, or its load
    device where the driver's MODEL patches on the device). Returns how many tensors carry patches."""
    for key, p in (patches or {}).items():
        t = functools.reduce(getattr, key.split("."), base)
        if not is_quantized(t):  # backstop, not the guard: the driver sends patches of quantized weights only
            raise RuntimeError(f"PatchRay: {key} is not a GGML-quantized weight on this rank")
        t.patches = [(_to_device(p, device), key)]
    return len(patches or {})


def _to_device(item, device):
    if isinstance(item, torch.Tensor):
        return item.to(device)
    if isinstance(item, tuple):
        return tuple(_to_device(x, device) for x in item)
    if isinstance(item, list):
        return [_to_device(x, device) for x in item]
    return item


def travel_by_value(what: str, payload) -> None:
    """Make ``payload`` (a GGUF model's skeleton and patches) travel to the ranks: the pack's classes by value
    (``travel.travel_by_value``), with ``torch.ops`` pickled by reference.

    Why the latter: Ray's pickler, writing a function by value, also writes the submodules of the modules it uses
    whose names the code mentions (``torch`` and ``comfy.ops.cast_to`` in the pack's layers: ``torch.ops``).
    ``torch.ops`` is a ``ModuleType`` subclass, which the pickler's exact-type table does not treat as a module:
    without a reducer it fails with "cannot pickle '_Ops' object". The reducer imports it by name on the rank (it is
    in every torch process's ``sys.modules``)."""
    import copyreg

    ops_type = type(torch.ops)
    if ops_type not in copyreg.dispatch_table:
        copyreg.pickle(ops_type, _module_by_name)
    from . import travel

    travel.travel_by_value(what, payload)


def _module_by_name(module):
    import importlib

    return importlib.import_module, (module.__name__,)


def sharding_refusal(dm, sharding: str) -> Optional[str]:
    """Why ``sharding`` (``blocks`` or ``blocks+offload``) cannot shard diffusion model ``dm``, or ``None``: a GGUF
    model's quantized tensors (see the module docstring)."""
    if not holds_ggml(dm):
        return None
    return (f"PatchRay: sharding={sharding} cannot shard a GGUF model's quantized weights (the ComfyUI-GGUF pack's "
            f"GGML tensors: weight sharding gathers plain tensors, which would lose their quantization type); use "
            f"sharding=none (each rank holds the quantized model, a quarter to a half of its fp16 size), or load the "
            f"fp8 or fp16 file of the model with ComfyUI's Load Diffusion Model to shard its blocks")
