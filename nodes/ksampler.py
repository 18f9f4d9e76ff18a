"""Distributed KSampler: the stock KSampler's inputs, run patch-parallel on the cluster's ranks.

Every rank runs ComfyUI's own sampler and scheduler on the MODEL as loaded (LoRAs and patches applied); each
rank's UNet computes one band of latent rows (DistriFusion-style patch parallelism, with OTIL's top-k output
exchange in the ``otil`` preset). ``full_sync`` equals the stock KSampler within floating-point tolerance.
"""

from __future__ import annotations

import logging

from . import _model
from ._comfy import interrupt_check, io, progress_callback, sampler_lists
from ._library import CANONICAL
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayKSampler", "patch_config"]

log = logging.getLogger(__name__)

_RANK = f"{CANONICAL}.nodes._ksampler_rank"

PRESET_NAMES = ["full_sync", "displaced", "otil", "balanced"]
# samplers whose step control reads the whole latent: with OTIL's approximate remote regions the ranks would take
# different numbers of steps, and their collectives would not line up
_ADAPTIVE = {"dpm_adaptive"}


def patch_config(preset: str, warmup_steps: int = -1, refresh_every: int = -1, k_ratio: float = 0.25, block_size: int = 8):
    """The PatchConfig for the node's widgets (-1: the preset's own value). CFG is not split across ranks."""
    from ..distributed.sampling.config import OutputMode, preset as make

    if preset not in PRESET_NAMES:
        raise ValueError(f"preset must be one of {PRESET_NAMES} (got {preset!r})")
    over = {"split_batch": False}  # ComfyUI may evaluate cond and uncond in separate calls: every rank takes both
    if preset != "full_sync":
        if int(warmup_steps) >= 0:
            over["warmup_steps"] = int(warmup_steps)
        if int(refresh_every) >= 0:
            over["refresh_every"] = int(refresh_every)
    config = make(preset, **over)
    if config.output is OutputMode.OTIL:
        config = config.replace(k_ratio=float(k_ratio), block_size=int(block_size))
    return config


class PatchRayKSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        samplers, schedulers = sampler_lists()
        return io.Schema(
            node_id="PatchRayKSampler",
            display_name="PatchRay Distributed KSampler",
            category=f"{CATEGORY}/sampling",
            description=(
                "The KSampler, patch-parallel across the cluster's ranks: every rank runs ComfyUI's own sampler and "
                "scheduler on the MODEL as loaded, and its UNet computes one band of latent rows. full_sync equals the "
                "stock KSampler; displaced/otil/balanced trade exactness for less traffic (stale neighbour data between "
                "synchronous steps). UNet models (SD 1.x, SD 2.x, SDXL)."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model (from a checkpoint loader; LoRAs and model patches applied)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True, tooltip="The random seed for the noise (same noise as the stock KSampler)."),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="The number of denoising steps."),
                io.Float.Input("cfg", default=8.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip="Classifier-free guidance scale."),
                io.Combo.Input("sampler_name", options=samplers, tooltip="ComfyUI's sampler, run on every rank."),
                io.Combo.Input("scheduler", options=schedulers, tooltip="ComfyUI's scheduler (the sigma schedule)."),
                io.Conditioning.Input("positive", tooltip="Positive conditioning."),
                io.Conditioning.Input("negative", tooltip="Negative conditioning."),
                io.Latent.Input("latent_image", tooltip="The latent to denoise (an Empty Latent Image for txt2img)."),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01, tooltip="How much of the schedule to run (1.0 = all; less for img2img)."),
                CLUSTER.Input("cluster", tooltip="The rank cluster, from PatchRay Cluster. The latent's rows are split across its ranks."),
                io.Combo.Input(
                    "preset",
                    options=PRESET_NAMES,
                    default="full_sync",
                    tooltip=(
                        "full_sync: exact, every layer exchanges every step. displaced: DistriFusion, neighbours' data one step "
                        "stale and sent asynchronously. otil: stale layers plus only the top-k most-changed latent blocks sent "
                        "per step, periodic refresh. balanced: stale layers, full output exchange, frequent refresh."
                    ),
                ),
                io.Int.Input("warmup_steps", default=-1, min=-1, max=1000, tooltip="Synchronous steps at the start (-1: the preset's, 4). Ignored by full_sync."),
                io.Int.Input("refresh_every", default=-1, min=-1, max=1000, tooltip="Run every Nth step synchronous to refresh stale data (-1: the preset's; 0: never). Ignored by full_sync."),
                io.Float.Input("k_ratio", default=0.25, min=0.01, max=1.0, step=0.01, tooltip="otil: fraction of each band's latent blocks sent per step (the OTIL paper: 0.25)."),
                io.Int.Input("block_size", default=8, min=1, max=64, tooltip="otil: side of a latent block in latent pixels (the OTIL paper: 8)."),
            ],
            outputs=[io.Latent.Output(display_name="LATENT", tooltip="The denoised latent, like the stock KSampler's.")],
        )

    @classmethod
    def execute(
        cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise, cluster,
        preset="full_sync", warmup_steps=-1, refresh_every=-1, k_ratio=0.25, block_size=8,
    ) -> io.NodeOutput:
        from ..distributed.cluster import ClusterConfig, get_cluster
        from ..distributed.sampling.config import OutputMode
        from ..distributed.sampling.remote import distributed_sample, ship_model

        config = patch_config(preset, warmup_steps, refresh_every, k_ratio, block_size)
        if sampler_name in _ADAPTIVE and config.output is OutputMode.OTIL:
            raise ValueError(f"sampler {sampler_name!r} adapts its step count to the whole latent, which OTIL leaves approximate on each rank; pick another sampler or preset")
        if not isinstance(cluster, ClusterConfig):
            raise TypeError(f"cluster must come from a PatchRay Cluster node (got {type(cluster).__name__})")
        if not isinstance(latent_image, dict) or "samples" not in latent_image:
            raise TypeError("latent_image must be a ComfyUI LATENT (a dict with 'samples')")
        _model.check_conditioning("positive", positive)
        _model.check_conditioning("negative", negative)
        key, make_payload = _model.portable_model(model)

        latent, noise = _model.latent_and_noise(model, latent_image, seed)
        inputs = {
            "noise": noise, "latent_image": latent, "noise_mask": latent_image.get("noise_mask"), "seed": int(seed),
            "steps": int(steps), "cfg": float(cfg), "sampler_name": sampler_name, "scheduler": scheduler,
            "denoise": float(denoise), "positive": positive, "negative": negative, "model_options": model.model_options,
            "object_patches": dict(model.object_patches),
        }
        root = _model.comfy_root()
        rank_cluster = get_cluster(cluster)
        cancel = interrupt_check()
        ship_model(rank_cluster, key, make_payload, f"{_RANK}:build", prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel)
        progress = progress_callback(steps)
        result = distributed_sample(
            rank_cluster, key, f"{_RANK}:sample", inputs, config,
            prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel, progress=progress,
            timeout_s=cluster.call_timeout_s,
        )
        if result["calls"] == 0 and float(denoise) > 0:
            raise RuntimeError(
                "PatchRay Distributed KSampler: the ranks sampled without calling the UNet through PatchRay's wrapper "
                "(another extension replaced ComfyUI's diffusion-model call?); refusing to return an unsharded result"
            )
        log.info("PatchRay KSampler: %d UNet calls on %d ranks, preset %s", result["calls"], cluster.num_ranks, preset)
        if progress is not None:
            progress(steps, steps)
        out = latent_image.copy()
        out["samples"] = result["latent"]
        return io.NodeOutput(out)
