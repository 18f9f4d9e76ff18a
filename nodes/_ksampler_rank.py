"""ComfyUI's own sampler on each rank, with the UNet call routed through the patch-parallel session.

Runs in the rank processes (sent by name, ``patchray.nodes._ksampler_rank:...``), never in ComfyUI's process.
ComfyUI is imported only after :func:`prepare` has put its folder on the import path, with ``--cpu`` semantics on
CPU ranks (ComfyUI's device logic assumes CUDA otherwise). GPU ranks see one GPU (Ray's ``CUDA_VISIBLE_DEVICES``),
which ComfyUI's model management then uses as its device.

Each rank runs ``comfy.sample.sample`` — the stock KSampler path: sigmas from ComfyUI's scheduler, its sampler,
CFG, model_options — on identical inputs (the driver prepared the seeded noise). A DIFFUSION_MODEL wrapper (ComfyUI's
own extension point around ``UNetModel.forward``) hands every UNet call to :class:`RankSession.denoise`, so each
rank computes its row band; the final latent is assembled exactly from every rank's own band.
"""

from __future__ import annotations

import sys

import torch

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


def sample(ctx, mp, session, inputs: dict) -> torch.Tensor:
    """``comfy.sample.sample`` with the UNet call routed through ``session``; returns the final latent."""
    import comfy.patcher_extension as pe
    import comfy.sample

    import comfy.model_management as mm

    model = mp.clone()
    model.model_options = inputs["model_options"]
    for name, obj in inputs["object_patches"].items():
        model.add_object_patch(name, obj)

    def agreed_batching(executor, *args, **kwargs):
        # ComfyUI decides from this device's free memory whether cond and uncond share one UNet call; ranks that
        # decided differently would make different collective calls. Every rank decides from the group's minimum.
        agreed = session.agree_min(mm.get_free_memory(mm.get_torch_device()))
        own = mm.get_free_memory

        def free_memory(dev=None, torch_free_too=False):
            return (agreed, agreed) if torch_free_too else agreed

        mm.get_free_memory = free_memory
        try:
            return executor(*args, **kwargs)
        finally:
            mm.get_free_memory = own

    def patch_parallel(executor, x, timesteps, context=None, y=None, control=None, transformer_options={}, **kwargs):
        if control is not None:
            raise NotImplementedError("PatchRay Distributed KSampler: ControlNet is not supported yet; use the stock KSampler")
        stream = tuple(transformer_options.get("cond_or_uncond", ()))  # cond and uncond may arrive in separate calls
        return session.denoise(
            executor.class_obj, executor, x, timesteps, stream=stream,
            context=context, y=y, control=control, transformer_options=transformer_options, **kwargs,
        )

    model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, patch_parallel)
    model.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, agreed_batching)
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
