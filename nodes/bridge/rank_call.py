"""What one sampling run sends its ranks, and whether its calls fit them: the part of the Parallel Model's driver
that the measured plan (:mod:`.auto_plan`) uses too.

* :func:`rank_inputs`: the guider without its model (:func:`portable_guider`), the sampler object, the schedule's
  tensors on the host, the MODEL's options and object patches, and the layout; what cannot travel is refused by name.
* :func:`check_call_memory`: a latent whose smallest call on a rank ComfyUI estimates larger than that rank's memory
  is refused before anything ships.
* :data:`OUTER_KEY`: the key the Parallel Model's wrapper is filed under (the checks of a MODEL's wrappers ignore it).
"""

from __future__ import annotations

import logging

import torch

from . import model as bridge_model
from .travel import travel_by_value

__all__ = ["OUTER_KEY", "portable_guider", "guider_scale", "rank_inputs", "rank_call_shape", "check_call_memory"]

log = logging.getLogger(__name__)


#: the key PatchRay files its OUTER_SAMPLE wrapper under (one per MODEL: patching again replaces it)
OUTER_KEY = "patchray.parallel_model"


_GUIDER_RUNTIME = ("model_patcher", "model_options", "inner_model", "conds", "loaded_models")


def portable_guider(guider):
    """``(class, state)`` of a guider without its model: what the ranks rebuild it from. Refuses, naming the guider
    and the attribute, state that holds a model (it would not be the rank's)."""
    cls = type(guider)
    state = {k: v for k, v in vars(guider).items() if k not in _GUIDER_RUNTIME}
    for name, value in state.items():
        if _holds_model(value):
            raise NotImplementedError(
                f"PatchRay Parallel Model: the guider {cls.__name__} ({cls.__module__}) keeps a model in its attribute "
                f"{name!r}; the ranks sample with their own copy of the MODEL and cannot take it: sample this MODEL "
                "with ComfyUI's own guiders (CFGGuider, BasicGuider, DualCFGGuider, PerpNegGuider) or without the "
                "Parallel Model node")
    return cls, state


def _holds_model(value, depth: int = 0) -> bool:
    if isinstance(value, torch.nn.Module) or type(value).__name__ == "ModelPatcher":
        return True
    if depth > 2:
        return False
    if isinstance(value, dict):
        return any(_holds_model(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_model(v, depth + 1) for v in value[:64])
    return False


def guider_scale(guider) -> float:
    """The guidance the layout decides the CFG split from: 1.0 when the guider evaluates one conditioning per step
    (BasicGuider; a CFGGuider at cfg 1 with ComfyUI's cfg-1 shortcut), else its scale (or 2.0 for guiders with
    several conditionings and no single ``cfg``, e.g. DualCFGGuider)."""
    conds = [k for k, v in (getattr(guider, "original_conds", None) or {}).items() if v]
    if len(conds) < 2:
        return 1.0
    cfg = getattr(guider, "cfg", None)
    options = getattr(guider, "model_options", None) or {}
    if isinstance(cfg, (int, float)) and len(conds) == 2 and not options.get("disable_cfg1_optimization", False):
        return float(cfg)
    return 2.0


def rank_inputs(guider, noise, latent_image, sampler, sigmas, denoise_mask, seed, layout, kind: str, attention: str) -> dict:
    """What one sampling run sends its ranks (``ksampler_rank.sample``'s ``inputs``): the guider without its model, the
    sampler object, the schedule's tensors on the host, the MODEL's model options and object patches, and the layout.
    Refuses, by name, what cannot travel (:func:`portable_guider`, :func:`.travel.travel_by_value`)."""
    mp = guider.model_patcher
    guider_cls, guider_state = portable_guider(guider)
    fn = getattr(sampler, "sampler_function", None)
    inputs = {
        "guider": (guider_cls, guider_state), "sampler": sampler, "sigmas": sigmas.detach().to("cpu"),
        "noise": noise.detach().to("cpu"), "latent_image": latent_image.detach().to("cpu"),
        "denoise_mask": denoise_mask.detach().to("cpu") if denoise_mask is not None else None, "seed": seed,
        "model_options": bridge_model.portable_options(mp), "object_patches": dict(mp.object_patches),
        "layout": layout._asdict() if layout is not None else None, "kind": kind, "attention": attention,
    }
    travel_by_value(f"the guider {guider_cls.__name__}", inputs["guider"])
    travel_by_value(f"the sampler {type(sampler).__name__} ({getattr(fn, '__name__', '?')})", sampler)
    travel_by_value("the MODEL's model options and object patches", (inputs["model_options"], inputs["object_patches"]))
    return inputs


_GIB = 1024**3


def rank_call_shape(latent_shape: tuple, layout) -> tuple:
    """The smallest model call a rank of ``layout`` makes for a latent of ``latent_shape``: ComfyUI evaluates one
    conditioning at a time when memory is short (all of the latent's batch rows), ``batch`` gives each rank its share
    of those rows, and sequence ranks take a band of the rows (the last but one dimension, all frames)."""
    shape = list(latent_shape)
    n = max(1, int(layout.num_ranks))
    if layout.batch:
        shape[0] = -(-shape[0] // n)
    if layout.seq_ranks > 1:
        shape[-2] = -(-shape[-2] // int(layout.seq_ranks))
    return tuple(shape)


def check_call_memory(model, latent_shape: tuple, layout, memory) -> None:
    """Refuse, before anything ships, a latent whose smallest model call on a rank ComfyUI itself estimates larger than
    the memory that rank can use (``BaseModel.memory_required``, the figure ComfyUI plans its loads and batching with).

    What a rank can use: GPU ranks their card (ComfyUI offloads weights to make room for the activations); CPU ranks
    the host's available memory shared by the ranks on it (they run their calls at the same time, so N CPU ranks each
    sized against the whole free memory would together exhaust the machine).

    Args:
        model: the ComfyUI MODEL (its ``memory_required``).
        latent_shape: the latent as sampled (``[B, C, H, W]`` or ``[B, C, T, H, W]``).
        layout: the run's :class:`.dit_layout.Layout`.
        memory: per rank ``(free bytes, total bytes, device type)`` (``ksampler_rank.device_memory``).
    """
    estimate = getattr(getattr(model, "model", None), "memory_required", None)
    if estimate is None or not memory:
        return
    call = rank_call_shape(latent_shape, layout)
    try:
        need = float(estimate(list(call)))
    except Exception as exc:  # an estimate is advice: a model that cannot give one is not refused over it
        log.debug("memory estimate unavailable: %s", exc)
        return
    cpu = all(len(m) > 2 and m[2] == "cpu" for m in memory)
    if cpu:
        have = min(float(m[0]) for m in memory) / len(memory)  # embedded CPU ranks share one host's memory
        where = f"the host's available memory ({min(float(m[0]) for m in memory) / _GIB:.1f} GiB) shared by its {len(memory)} CPU ranks"
    else:
        have = min(float(m[1]) for m in memory)
        where = "the smallest rank's card"
    if need <= have:
        return
    shrink = (need / have) ** 0.5
    batch_hint = f" or batch_size (each rank's calls hold {call[0]} of the batch's {latent_shape[0]} rows)" if call[0] > 1 else ""
    raise ValueError(
        f"latent_image: ComfyUI estimates {need / _GIB:.1f} GiB for one model call on each rank at this size (latent "
        f"{'x'.join(str(d) for d in latent_shape[2:])}, {layout.mode} over {layout.num_ranks} ranks: each rank's call "
        f"covers {'x'.join(str(d) for d in call[2:])}); a rank has {have / _GIB:.1f} GiB ({where}). Lower width and "
        f"height about {shrink:.1f}x{batch_hint}, or use more ranks"
        + (" with parallelism sequence" if layout.seq_ranks <= 1 else "")
    )
