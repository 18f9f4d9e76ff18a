"""ComfyUI MODEL -> what the ranks need to rebuild it: a weightless skeleton, the patched weights, the patches.

Runs in ComfyUI's process (driver side). The rank side is :mod:`.ksampler_rank`.

* The **weights** are ComfyUI's weights with the MODEL's weight patches (LoRAs, merges) applied exactly the way
  ``ModelPatcher.patch_weight_to_device`` applies them (fp32 ``comfy.lora.calculate_weight``, then
  ``comfy.float.stochastic_rounding`` seeded by the key; on a scaled-fp8 layer through its ``convert_weight`` and
  ``set_weight``), always from the original weights (``backup``), whatever ComfyUI currently has patched in place.
* The **skeleton** is a deep copy of the ``BaseModel`` whose parameters and persistent buffers are meta tensors
  (no data): the ranks get ComfyUI's own classes and configuration without a second copy of the weights, and
  ``load_state_dict(assign=True)`` fills it. Runtime state of ComfyUI's loader (low-VRAM casting hooks, the
  in-place patch markers) is not copied.
* **GGUF models** (the ComfyUI-GGUF pack's loaders) ship their quantized bytes, never a dequantized copy, with the
  LoRA patches of their quantized weights beside the skeleton (:mod:`.gguf_weights`).
* **Object patches** (e.g. ModelSamplingDiscrete) and **model_options** (CFG functions, ...) travel with each
  prompt: ComfyUI changes both without renewing ``patches_uuid``, so they cannot be part of the cached model.
* Refused with a reason: for sequence parallelism, diffusion models without a row (UNets of SD 1.x/2.x/SDXL and
  the DiTs of :mod:`.dit_models` have one); for sequence and batch parallelism, attention/block patches (they would
  see a band or a share of the rows); always, wrappers/callbacks of other extensions (they live on the driver's
  ModelPatcher and would not reach the ranks), hooks, weight wrappers. CFG parallelism runs the whole model on each
  rank: patches are fine there.
"""

from __future__ import annotations

import copy
import os
import uuid
from typing import Hashable, Optional

import torch

from . import gguf_weights

__all__ = ["comfy_root", "model_key", "portable_parts", "portable_options", "check_patches", "check_model_type", "check_conditioning", "check_area_sequence", "check_latent_channels", "area_rows", "check_rows", "check_sequence", "latent_and_noise", "diffusion_kind", "sequence_refusal", "patch_weight"]

_UNSUPPORTED_COND_KEYS = {
    "control": "ControlNet conditioning (its residuals are full-image tensors added inside the model)",
    "gligen": "GLIGEN conditioning",
    "hooks": "conditioning hooks (scheduled LoRA/weight hooks)",
    "area": "area conditioning (the UNet sees a cropped latent, not the row bands of the image)",
    "mask": "masked conditioning (the UNet sees a cropped latent, not the row bands of the image)",
}


def comfy_root() -> str:
    """The ComfyUI folder (the one holding the ``comfy`` package): the ranks put it on their import path."""
    import comfy.model_patcher  # ``comfy`` itself is a namespace package: no __file__

    return os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_patcher.__file__)))


def latent_and_noise(mp, latent_dict: dict, seed: int, add_noise: bool = True):
    """The latent and the seeded noise exactly as the stock KSampler prepares them (``nodes.common_ksampler``);
    ``add_noise=False`` (KSamplerAdvanced's add_noise disable): zeros, as ComfyUI's sampler then adds none."""
    import comfy.sample

    latent = comfy.sample.fix_empty_latent_channels(mp, latent_dict["samples"])
    if latent.dim() not in (4, 5):
        raise ValueError(f"PatchRay samples image latents [B, C, H, W] or video latents [B, C, T, H, W]; got shape {tuple(latent.shape)}")
    if not add_noise:
        return latent, torch.zeros(latent.size(), dtype=latent.dtype, layout=latent.layout, device="cpu")
    return latent, comfy.sample.prepare_noise(latent, seed, latent_dict.get("batch_index"))


def schedule_steps(mp, steps: int, sampler_name: str, scheduler: str, denoise: float) -> int:
    """The steps of the schedule ComfyUI's sampler builds for these widgets (``len(sigmas) - 1`` of
    ``comfy.samplers.KSampler``): ``steps`` for most schedulers, not for all (``ddim_uniform`` and ``beta`` round
    their timesteps), and the count a start or end step is cut against."""
    import comfy.samplers

    ks = comfy.samplers.KSampler(mp, steps=int(steps), device=mp.load_device, sampler=sampler_name, scheduler=scheduler,
                                 denoise=denoise, model_options=mp.model_options)
    return int(ks.sigmas.shape[0]) - 1


def check_rows(mp, latent: torch.Tensor, num_ranks: int) -> None:
    """Refuse, before anything is shipped, a latent whose rows cannot give every rank a band of the UNet.

    The bands are multiples of the UNet's row downsampling (the product of its row-strided convolutions' strides),
    the rule the ranks' adapters apply (``distributed.bands.band_heights``), so the verdict is theirs.
    """
    from ...distributed.bands import band_heights as split_rows

    align = 1
    for m in mp.model.diffusion_model.modules():
        if isinstance(m, torch.nn.Conv2d) and m.stride[0] > 1:
            align *= m.stride[0]
    try:
        split_rows(int(latent.shape[-2]), int(num_ranks), align)
    except ValueError as exc:
        raise ValueError(f"latent_image: {exc}") from None


def diffusion_kind(mp) -> str:
    """``"unet"`` for ComfyUI's UNetModel (SD 1.x, 2.x, SDXL), ``"dit"`` for every other diffusion model."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    return "unet" if isinstance(getattr(mp.model, "diffusion_model", None), UNetModel) else "dit"


def sequence_refusal(mp):
    """Why this MODEL cannot be sharded by sequence (row bands), or ``None`` when it can."""
    from .dit_models import find_row, refusal

    dm = getattr(mp.model, "diffusion_model", None)
    if diffusion_kind(mp) == "unet":
        if getattr(dm, "dims", 2) != 2:
            return f"PatchRay: sequence parallelism does not cover a {dm.dims}-D UNet yet; parallelism=cfg or batch work with every model"
        if type(dm).__name__ != "UNetModel":
            # a subclass adds layers the row bands were never checked against (SVD's VideoUNet: temporal blocks that
            # mix the frames held in the batch); refused rather than run unverified
            return (f"PatchRay: sequence parallelism covers ComfyUI's UNetModel (SD 1.x/2.x/SDXL), not its subclass "
                    f"{type(dm).__name__}; parallelism=cfg or batch work with every model")
        return None
    if find_row(type(dm).__name__) is None:
        from .errors import model_name

        return refusal(type(dm).__name__, type(dm).__module__, family=model_name(mp))
    return None


def check_latent_channels(mp, latent: torch.Tensor) -> None:
    """Refuse, before anything ships, a latent whose channels are not the model's (``latent_format.latent_channels``,
    the count ComfyUI itself gives an empty latent of this model): the ranks would fail inside the model's first layer.
    An all-zero latent is left alone: ComfyUI resizes it to the model's channels (``fix_empty_latent_channels``)."""
    fmt = mp.get_model_object("latent_format") if hasattr(mp, "get_model_object") else None
    want = getattr(fmt, "latent_channels", None)
    have = int(latent.shape[1]) if latent.dim() >= 2 else None
    if not isinstance(want, int) or have is None or have == want or not bool(latent.any()):
        return
    raise ValueError(
        f"latent_image has {have} channels, but this model ({type(mp.model.diffusion_model).__name__}) samples "
        f"{want}-channel latents: the latent was made for another model (its VAE or empty-latent node); make it with "
        "this model's VAE or empty latent node")


def check_sequence(mp, latent: torch.Tensor, num_ranks: int) -> None:
    """Refuse, before anything is shipped, a latent too small to give each of ``num_ranks`` a band of rows."""
    if diffusion_kind(mp) == "unet":
        if latent.dim() != 4:
            raise ValueError(f"latent_image: the UNet takes image latents [B, C, H, W]; got shape {tuple(latent.shape)}")
        return check_rows(mp, latent, num_ranks)
    from .dit_models import find_row, token_grid

    dm = mp.model.diffusion_model
    row = find_row(type(dm).__name__)
    frames, rows, cols = token_grid(row, dm, tuple(latent.shape))
    if rows < num_ranks:
        raise ValueError(
            f"latent_image: {rows} token rows ({latent.shape[-2]} latent rows, patch {row.patch(dm)[1]}) cannot give each of the "
            f"{num_ranks} sequence ranks a band: raise the latent's height, or lower num_ranks on the PatchRay Cluster node (or "
            "pick a parallelism with fewer sequence ranks)"
        )


def area_rows(extra: dict, latent_shape: tuple) -> Optional[int]:
    """The latent rows of the crop a call of this conditioning sees (``None``: the whole latent): an ``area`` in
    latent units ``(..., h, w, ..., y, x)`` or ComfyUI's ``("percentage", h, w, y, x)``, or the bounds of a mask with
    ``set_area_to_bounds``, as ComfyUI resolves them before sampling."""
    rows = int(latent_shape[-2])
    area = extra.get("area")
    if area is not None:
        area = list(area)
        if area and area[0] == "percentage":
            return max(1, min(rows, round(float(area[1]) * rows)))
        half = len(area) // 2
        if half >= 2:
            return max(1, min(int(area[half - 2]), rows - int(area[2 * half - 2])))
    mask = extra.get("mask")
    if mask is not None and extra.get("set_area_to_bounds") and isinstance(mask, torch.Tensor) and mask.ndim >= 2:
        m = mask.reshape(-1, *mask.shape[-2:]).float()
        m = torch.nn.functional.interpolate(m[:, None], size=tuple(int(d) for d in latent_shape[-2:]), mode="bilinear")
        hit = torch.nonzero(m.abs().amax(dim=(0, 1, 3)) > 0)
        return int(hit.max() - hit.min() + 1) if hit.numel() else rows
    return None


def check_area_sequence(mp, name: str, conditioning, latent_shape: tuple, num_ranks: int) -> None:
    """Refuse, before anything ships, an area or bounded mask too small for ``num_ranks`` sequence ranks (the call on
    its crop is split like any other)."""
    for item in conditioning:
        extra = item[1] if isinstance(item, (list, tuple)) and len(item) > 1 and isinstance(item[1], dict) else {}
        rows = area_rows(extra, latent_shape)
        if rows is None:
            continue
        try:
            check_sequence(mp, torch.empty(tuple(latent_shape[:-2]) + (rows, int(latent_shape[-1])), device="meta"),
                           num_ranks)
        except ValueError as exc:
            raise ValueError(
                f"{name}: an area of {rows} latent rows cannot give each of the {num_ranks} sequence ranks a band "
                f"({str(exc).split(': ', 1)[-1].split(' cannot')[0]}): make the area taller, lower num_ranks on the "
                "PatchRay Cluster node, or pick parallelism cfg or batch") from None


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(f"PatchRay: {what} is not supported yet; sample this graph without PatchRay (the stock sampler on the MODEL before PatchRay Parallel Model)")


_SEQUENCE_ONLY_COND_KEYS = ("area", "mask")


def check_conditioning(name: str, conditioning, mode: str = "sequence", kind: str = "unet") -> None:
    """Refuse conditioning the ranks cannot honour under ``mode``. Area and mask conditioning crop or weight the
    latent a call sees: a DiT's sequence split cuts each call's own tokens and follows them (``kind="dit"``), the
    UNet's row bands (patch parallelism, state kept across steps) cannot."""
    if not isinstance(conditioning, list):
        raise TypeError(f"{name} must be ComfyUI CONDITIONING (a list of [tensor, dict]); got {type(conditioning).__name__}")
    for item in conditioning:
        extra = item[1] if isinstance(item, (list, tuple)) and len(item) > 1 and isinstance(item[1], dict) else {}
        for key, why in _UNSUPPORTED_COND_KEYS.items():
            if key in _SEQUENCE_ONLY_COND_KEYS and ("sequence" not in mode or kind == "dit"):
                continue
            if extra.get(key) is not None:
                if key in _SEQUENCE_ONLY_COND_KEYS:
                    raise NotImplementedError(
                        f"PatchRay: {why} in {name} cannot be split into row bands "
                        f"(parallelism={mode}); parallelism=cfg or batch run it whole, or sample this graph without PatchRay"
                    )
                raise _refuse(f"{why} in {name}")


def check_model_type(mp) -> None:
    import comfy.model_patcher

    if not isinstance(mp, comfy.model_patcher.ModelPatcher):
        raise TypeError(f"model must be a ComfyUI MODEL (from a checkpoint or UNet loader); got {type(mp).__name__}")
    if getattr(mp.model, "diffusion_model", None) is None:
        raise _refuse("a MODEL without a diffusion model")


def _check_model(mp, mode: str = "sequence", ignore: tuple = ()) -> None:
    check_model_type(mp)
    if "sequence" in mode:
        why = sequence_refusal(mp)
        if why:
            raise NotImplementedError(why)
    to = mp.model_options.get("transformer_options", {})
    if mode in ("sequence", "cfg+sequence", "batch"):
        for key in ("patches", "patches_replace"):
            if any(to.get(key, {}).values()):
                what = "a row band" if "sequence" in mode else "a share of the call's rows"
                raise _refuse(f"the MODEL's {key} ({sorted(to[key])}) with parallelism={mode} (attention or block patches would see only {what}; parallelism=cfg runs them whole)")
    check_patches(mp, ignore)


def check_patches(mp, ignore: tuple = ()) -> None:
    """Refuse, by name, what the MODEL carries that cannot travel to the ranks whatever the parallelism: wrappers and
    callbacks of other extensions (they live on this process's ModelPatcher), a torch.compile wrapper, weight wrapper
    patches and hook patches. ``ignore``: wrapper keys of PatchRay's own (the Parallel Model's driver-side wrapper)."""
    if any(_TORCH_COMPILE_KEY in keyed for keyed in mp.wrappers.values()):
        # ComfyUI's TorchCompileModel adds a torch.compile wrapper of the whole diffusion model on the driver's MODEL:
        # the ranks run their own copies, whose attention goes through PatchRay's exchange (collectives the compiled
        # graph would have to stop at); the wrapper would not reach them
        raise NotImplementedError(
            "PatchRay: the MODEL comes through TorchCompileModel (a torch.compile wrapper of the whole diffusion "
            "model); the ranks run their own copies of the model and do not take that wrapper: connect the MODEL "
            "before the TorchCompileModel node to PatchRay, or sample a compiled model without PatchRay")
    to = mp.model_options.get("transformer_options", {}) or {}
    for kind, table in (("wrappers", mp.wrappers), ("callbacks", mp.callbacks),
                        ("wrappers", to.get("wrappers") or {}), ("callbacks", to.get("callbacks") or {})):
        # by hook point and by the key the adding node filed it under (the key usually names the extension)
        used = sorted(f"{k}: {', '.join(sorted(str(key) for key, fns in v.items() if fns and key not in ignore))}"
                      for k, v in table.items() if any(fns for key, fns in v.items() if key not in ignore))
        if used:
            raise _refuse(f"{kind} added to the MODEL by other nodes ({used})")
    extra = {k: v for k, v in (getattr(mp, "additional_models", None) or {}).items() if v}
    if "multigpu" in extra:
        # newer ComfyUI's own multi-GPU split (its MultiGPU Work Units node) clones the model onto other GPUs: the two
        # splits would each take the cards, and the ranks could not hold those clones
        raise NotImplementedError(
            "PatchRay: the MODEL carries ComfyUI's own multi-GPU split (MultiGPU Work Units): PatchRay splits the work "
            "over its ranks itself, and a model is never split twice; connect the MODEL before that node to PatchRay, "
            "or use ComfyUI's split without PatchRay")
    if extra:
        raise _refuse(f"additional models attached to the MODEL by other nodes ({sorted(extra)})")
    if mp.weight_wrapper_patches:
        raise _refuse("weight wrapper patches")
    if getattr(mp, "hook_patches", None):
        raise _refuse("hook patches (scheduled weight hooks)")


def portable_options(mp) -> dict:
    """The MODEL's ``model_options`` as the ranks take them: a copy without wrappers and callbacks filed in them
    (PatchRay's own are the driver's; any other was refused by :func:`check_patches`)."""
    import comfy.model_patcher

    options = comfy.model_patcher.create_model_options_clone(mp.model_options)
    to = options.get("transformer_options")
    if isinstance(to, dict):
        for name in ("wrappers", "callbacks"):
            to.pop(name, None)
    return options


#: the key ComfyUI's ``comfy_api.torch_helpers.set_torch_compile_wrapper`` (the TorchCompileModel node) files its
#: APPLY_MODEL wrapper under
_TORCH_COMPILE_KEY = "torch.compile"

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def _patched_weight(mp, key: str, live: torch.Tensor, backup: dict) -> torch.Tensor:
    import comfy.float
    import comfy.lora
    from comfy.model_patcher import get_key_weight

    try:  # newer ComfyUI keeps it in comfy.utils
        from comfy.utils import string_to_seed
    except ImportError:
        from comfy.model_patcher import string_to_seed

    # the original weight: ComfyUI's backup when it has patched this weight into the model (now, or when the live state
    # was read: an unload since then restored the original and emptied the backup, while ``live`` is the patched one)
    original = mp.backup[key].weight if key in mp.backup else backup.get(key, live)
    if gguf_weights.is_quantized(original):
        # GGUF: the quantized bytes as loaded (the pack never patches them in place; a LoRA's patches travel with the
        # skeleton and the rank's layer adds them per call, as the pack's does)
        return gguf_weights.raw_bytes(original)
    if key not in mp.patches:
        return original.detach().to("cpu")
    _, set_func, convert_func = get_key_weight(mp.model, key)
    return patch_weight(original, live.dtype, key, lambda w: comfy.lora.calculate_weight(mp.patches[key], w, key),
                        seed=string_to_seed(key), rounding=comfy.float.stochastic_rounding, set_func=set_func,
                        convert_func=convert_func)


def patch_weight(original: torch.Tensor, dtype: torch.dtype, key: str, calculate, *, seed: int, rounding, set_func=None,
                 convert_func=None) -> torch.Tensor:
    """The weight ``ModelPatcher.patch_weight_to_device`` (ComfyUI 0.3.64) would write for ``key``, returned on the host
    instead of written into the driver's model.

    ComfyUI's steps, in its order: the original weight in float32; the layer's ``convert_func`` (a scaled-fp8 layer's
    ``convert_weight``: times its ``scale_weight``); ``calculate`` (``comfy.lora.calculate_weight`` of the patches);
    then either ``rounding`` to the weight's dtype (``comfy.float.stochastic_rounding``, seeded by the key), or, for a
    layer with a custom setter, the setter's own arithmetic (scaled fp8's ``set_weight``: divided by ``scale_weight``,
    stochastically rounded to the layer's fp8 dtype with the same seed). The setter is asked for the weight
    (``return_weight=True``), so nothing on the driver's layer changes; a setter that cannot return it (another
    extension's quantised layer) is refused by name.

    Args:
        original: the weight as loaded (ComfyUI's backup when it has patched the model in place).
        dtype: the weight's dtype in the model (the rounding target when there is no setter).
        key: the state-dict name (errors).
        calculate: ``calculate(float32 weight) -> patched float32 weight``.
        seed: the rounding seed (``string_to_seed(key)``, as ComfyUI seeds it).
        rounding: ``rounding(value, dtype, seed=...)``.
        set_func, convert_func: what ``comfy.model_patcher.get_key_weight`` returns for ``key``.
    """
    if set_func is not None and not _returns_weight(set_func):
        raise _refuse(f"a weight with a custom setter that cannot return the weight ({key}: "
                      f"{getattr(set_func, '__qualname__', type(set_func).__name__)}, a quantised layer of another extension)")
    temp = original.detach().to("cpu", torch.float32, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    out = calculate(temp)
    if set_func is None:
        return rounding(out, dtype, seed=seed).to("cpu")
    return set_func(out, seed=seed, return_weight=True).to("cpu")


def _returns_weight(set_func) -> bool:
    """Whether ``set_func`` takes ``return_weight`` (ComfyUI's scaled-fp8 ``set_weight`` does, and then changes
    nothing on its layer)."""
    import inspect

    try:
        return "return_weight" in inspect.signature(set_func).parameters
    except (TypeError, ValueError):
        return False


def _skeleton(mp, state: dict):
    """Deep copy of the BaseModel with every state-dict tensor replaced by a meta tensor (no data)."""
    base = mp.model
    memo = {}
    for t in state.values():
        if id(t) in memo:
            continue
        # a GGUF weight keeps its class, quantization type and logical shape (the rank allocates its bytes from it)
        meta = gguf_weights.meta_like(t) if gguf_weights.is_ggml(t) else torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=False) if isinstance(t, torch.nn.Parameter) else meta
    for m in base.modules():
        for attr in ("weight_function", "bias_function"):
            value = m.__dict__.get(attr)
            if isinstance(value, list):
                memo[id(value)] = []  # ComfyUI's low-VRAM cast hooks: runtime state of this process's loader
    skeleton = copy.deepcopy(base, memo)
    for m in skeleton.modules():
        d = m.__dict__
        if "prev_comfy_cast_weights" in d:
            d["comfy_cast_weights"] = d.pop("prev_comfy_cast_weights")
        d.pop("comfy_patched_weights", None)
    gguf_weights.layer_settings(skeleton)
    import comfy.utils

    for name, original in mp.object_patches_backup.items():  # the un-patched objects; the rank re-applies ours
        comfy.utils.set_attr(skeleton, name, copy.deepcopy(original))
    for attr, value in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0), ("model_lowvram", False), ("current_weight_patches_uuid", None)):
        setattr(skeleton, attr, value)
    skeleton.device = torch.device("cpu")
    return skeleton


def model_key(mp, mode: str = "sequence", ignore: tuple = ()) -> Hashable:
    """The key the ranks cache the MODEL ``mp`` under, after the refusals of ``mode`` (the resolved parallelism;
    see the module docstring).

    It names the base weights (a token stored on ComfyUI's model object) and the weight-patch set
    (``patches_uuid``, which ComfyUI renews whenever weight patches change): equal keys, equal weights.
    """
    _check_model(mp, mode, ignore)
    base = mp.model
    token = base.__dict__.get("_patchray_token")
    if token is None:
        token = base.__dict__["_patchray_token"] = uuid.uuid4().hex
    return ("comfy-model", token, str(mp.patches_uuid))


def _live_state(mp) -> dict:
    base = mp.model
    # the GGUF pack's layers write placeholders into state_dict(): their real tensors instead
    live = gguf_weights.live_state(base, base.state_dict(keep_vars=True))
    for name, original in mp.object_patches_backup.items():
        # an object patch ComfyUI left applied (e.g. another clone's ModelSamplingDiscrete): the skeleton gets the
        # original object back, so its state comes from the original too
        prefix = name + "."
        for k in [k for k in live if k.startswith(prefix)]:
            del live[k]
        if isinstance(original, torch.nn.Module):
            live.update({prefix + k: v for k, v in original.state_dict(keep_vars=True).items()})
    return live


def _gguf_payload(mp, live: dict) -> dict:
    """What a GGUF MODEL's ranks need beside the skeleton and the bytes: the LoRA patches of its quantized weights,
    and where the pack's patcher keeps them (``patch_on_device``: on the load device, else on the offload device)."""
    return {"ggml_patches": gguf_weights.quantized_patches(mp, live),
            "ggml_patch_on_device": bool(getattr(mp, "patch_on_device", False))}


def portable_parts(mp, mode: str = "sequence", ignore: tuple = ()):
    """The MODEL for ``sampling.ship.ship_model``: ``(key, make_skeleton, names, tensor, sizes)``.

    The key is :func:`model_key`; the weights are produced one at a time (``tensor(name)``: the patched weight on
    the host), so neither a full patched copy nor a full copy in Ray's store ever exists beside ComfyUI's own weights.
    """
    key = model_key(mp, mode, ignore)  # the refusals and the key
    live = _live_state(mp)
    backup = {k: b.weight for k, b in mp.backup.items()}  # read with the live state: the two belong together
    names = list(live)
    sizes = {k: t.numel() * t.element_size() for k, t in live.items()}

    def make_skeleton() -> dict:
        payload = {"skeleton": _skeleton(mp, live)}
        if gguf_weights.holds_ggml(mp.model):
            payload.update(_gguf_payload(mp, live))
            # the GGUF pack's classes (loaded under its folder's path) and the patches' code travel by value
            gguf_weights.travel_by_value("the GGUF model (ComfyUI-GGUF's layers and tensors)", payload)
        return payload

    def tensor(name: str) -> torch.Tensor:
        return _patched_weight(mp, name, live[name], backup)

    return key, make_skeleton, names, tensor, sizes
