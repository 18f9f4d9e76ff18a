"""ComfyUI's own sampler on each rank, with the UNet call routed through the patch-parallel session.

Runs in the rank processes (sent by name, ``patchray.nodes.bridge.ksampler_rank:...``), never in ComfyUI's process.
ComfyUI is imported only after :func:`prepare` has put its folder on the import path, with ``--cpu`` semantics on
CPU ranks (ComfyUI's device logic assumes CUDA otherwise). GPU ranks see one GPU (Ray's ``CUDA_VISIBLE_DEVICES``),
which ComfyUI's model management then uses as its device.

Each rank runs ``comfy.sample.sample`` — the stock KSampler path: sigmas from ComfyUI's scheduler, its sampler,
CFG, model_options — on identical inputs (the driver prepared the seeded noise). A DIFFUSION_MODEL wrapper (ComfyUI's
own extension point around ``UNetModel.forward``) hands every UNet call to :class:`RankSession.denoise`, so each
rank computes its row band; the final latent is assembled exactly from every rank's own band.

ComfyUI decides per UNet call whether cond and uncond share one batch, from this device's free memory; ranks that
decided differently would make different collective calls. A CALC_COND_BATCH wrapper (ComfyUI's extension point
around that decision) makes every rank decide from the group's minimum free memory: for the duration of the call
only, the model the wrapper is handed answers ``memory_required`` with the agreed verdict. Nothing process-wide
(``comfy.model_management``) is replaced, and the model is restored exactly when the call ends, also on error.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import torch

__all__ = ["WRAPPER_KEY", "prepare", "build", "sample", "agreed_batching", "patch_parallel"]

WRAPPER_KEY = "patchray.patch_parallel"


def prepare(ctx, comfy_root: str) -> None:
    """Make ComfyUI importable in this rank process (once), on the rank's device."""
    if comfy_root not in sys.path:
        sys.path.append(comfy_root)  # appended: ComfyUI's top-level names must not shadow installed packages
    if "comfy.model_management" not in sys.modules:
        import comfy.cli_args  # parses no command line unless comfy.options enabled it (ComfyUI's main.py does)

        if ctx.device.type == "cpu":
            comfy.cli_args.args.cpu = True
    import comfy.model_management as mm

    dev = mm.get_torch_device()
    if dev.type != ctx.device.type:
        raise RuntimeError(f"ComfyUI on this rank chose device {dev}, the rank runs on {ctx.device}")


def build(ctx, payload: dict):
    """The rank's ModelPatcher: the shipped skeleton (original objects) filled with the patched weights.

    Object patches are not part of it: ComfyUI changes them without renewing ``patches_uuid``, so they travel with
    every prompt and go on the per-run clone in :func:`sample`.
    """
    import comfy.model_management as mm
    import comfy.model_patcher

    mm.unload_all_models()  # the previous model (if any) is being replaced: give its memory back first
    mm.soft_empty_cache()
    base = payload["skeleton"]
    base.load_state_dict(payload["state_dict"], strict=True, assign=True)
    return comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())


_NOT_SET = object()


def agreed_batching(session, free_memory: Callable[[torch.device], float]):
    """A CALC_COND_BATCH wrapper: cond/uncond batching decided from the ranks' minimum free memory.

    ComfyUI batches when ``model.memory_required(shape) * 1.5 < free_memory`` (``comfy.samplers._calc_cond_batch``).
    Inside the call, ``model.memory_required`` is an instance attribute that returns ``-inf`` when the batch fits
    the agreed (minimum) free memory and ``+inf`` when it does not, so every rank's comparison gives the same
    answer whatever its own free memory. One tiny all-reduce per call.

    Args:
        session: the rank's ``RankSession`` (its ``agree_min`` is the collective).
        free_memory: ``free_memory(device) -> bytes``, ComfyUI's ``model_management.get_free_memory``.
    """

    def wrapper(executor, model, conds, x_in, *args, **kwargs):
        agreed = session.agree_min(free_memory(x_in.device))
        required = model.memory_required  # the model's own estimate (bound method or an earlier override)
        own = model.__dict__.get("memory_required", _NOT_SET)

        def memory_required(input_shape, cond_shapes=None):
            fits = required(input_shape, cond_shapes=cond_shapes if cond_shapes is not None else {}) * 1.5 < agreed
            return -math.inf if fits else math.inf

        model.memory_required = memory_required
        try:
            return executor(model, conds, x_in, *args, **kwargs)
        finally:
            if own is _NOT_SET:
                del model.memory_required
            else:
                model.memory_required = own

    return wrapper


def patch_parallel(session):
    """A DIFFUSION_MODEL wrapper: every UNet call goes through ``session.denoise`` (the rank computes its band)."""

    def wrapper(executor, x, timesteps, context=None, y=None, control=None, transformer_options=None, **kwargs):
        if control is not None:
            raise NotImplementedError("PatchRay Distributed KSampler: ControlNet is not supported yet; use the stock KSampler")
        # ComfyUI's UNet writes into transformer_options: a call without them gets a dict of its own
        transformer_options = {} if transformer_options is None else transformer_options
        stream = tuple(transformer_options.get("cond_or_uncond", ()))  # cond and uncond may arrive in separate calls
        return session.denoise(
            executor.class_obj, executor, x, timesteps, stream=stream,
            context=context, y=y, control=control, transformer_options=transformer_options, **kwargs,
        )

    return wrapper


def sample(ctx, mp, session, inputs: dict) -> torch.Tensor:
    """``comfy.sample.sample`` with the UNet call routed through ``session``; returns the final latent."""
    import comfy.model_management as mm
    import comfy.patcher_extension as pe
    import comfy.sample

    model = mp.clone()
    model.model_options = inputs["model_options"]
    for name, obj in inputs["object_patches"].items():
        model.add_object_patch(name, obj)
    model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, patch_parallel(session))
    model.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, agreed_batching(session, mm.get_free_memory))
    steps = int(inputs["steps"])

    def callback(step, x0, x, total_steps):
        session.progress(step + 1, total_steps)

    with torch.inference_mode():
        return comfy.sample.sample(
            model,
            inputs["noise"],
            steps,
            inputs["cfg"],
            inputs["sampler_name"],
            inputs["scheduler"],
            inputs["positive"],
            inputs["negative"],
            inputs["latent_image"],
            denoise=inputs["denoise"],
            noise_mask=inputs.get("noise_mask"),
            callback=callback,
            disable_pbar=True,
            seed=inputs["seed"],
        )
