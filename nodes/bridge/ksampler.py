"""The Distributed KSampler's one call: ComfyUI's MODEL, conditioning and LATENT in, the denoised LATENT out.

Driver side (ComfyUI's process). It refuses what the bands cannot honour before anything is shipped, converts the
MODEL (:mod:`.model`), prepares the latent and the seeded noise exactly as the stock KSampler does, ships the model
once per weights and patches, and runs ComfyUI's own sampler on every rank (:mod:`.ksampler_rank`, named by its
canonical module path so the ranks can import it however ComfyUI loaded the pack).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from . import model as bridge_model
from . import validate
from .errors import rank_errors_for_user
from .shim import CANONICAL

__all__ = ["PRESET_NAMES", "patch_config", "sample"]

log = logging.getLogger(__name__)

_RANK = f"{CANONICAL}.nodes.bridge.ksampler_rank"

PRESET_NAMES = ["full_sync", "displaced", "otil", "balanced"]
# samplers whose step control reads the whole latent: with OTIL's approximate remote regions the ranks would take
# different numbers of steps, and their collectives would not line up
_ADAPTIVE = {"dpm_adaptive"}


def patch_config(preset: str, warmup_steps: int = -1, refresh_every: int = -1, k_ratio: float = 0.25, block_size: int = 8):
    """The PatchConfig for the node's widgets (-1: the preset's own value). CFG is not split across ranks."""
    from ...distributed.sampling.config import OutputMode, preset as make

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


def sample(
    model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise, cluster_config, config,
    *, cancel_check: Optional[Callable[[], None]] = None, progress: Optional[Callable[[int, int], None]] = None,
) -> dict:
    """Run the KSampler patch-parallel on the ranks of ``cluster_config``; return the LATENT dict.

    Args:
        config: the :class:`PatchConfig` (:func:`patch_config`).
        cancel_check: ComfyUI's interrupt check, polled while the ranks work.
        progress: ``fn(done, total)`` for ComfyUI's progress bar.

    Raises:
        ValueError / TypeError / NotImplementedError: refused inputs, before anything is shipped.
        RankFailure: a rank failed (clean message; the trace is chained for the log).
    """
    from ...distributed.cluster import ClusterConfig, get_cluster
    from ...distributed.sampling.config import OutputMode
    from ...distributed.sampling.remote import distributed_sample, ship_model

    if sampler_name in _ADAPTIVE and config.output is OutputMode.OTIL:
        raise ValueError(f"sampler {sampler_name!r} adapts its step count to the whole latent, which OTIL leaves approximate on each rank; pick another sampler or preset")
    if not isinstance(cluster_config, ClusterConfig):
        raise TypeError(f"cluster must come from a PatchRay Cluster node (got {type(cluster_config).__name__})")
    if not isinstance(latent_image, dict) or "samples" not in latent_image:
        raise TypeError("latent_image must be a ComfyUI LATENT (a dict with 'samples')")
    bridge_model.check_conditioning("positive", positive)
    bridge_model.check_conditioning("negative", negative)
    key, make_payload = bridge_model.portable_model(model)

    latent, noise = bridge_model.latent_and_noise(model, latent_image, seed)
    validate.sampling_rows(model, latent, cluster_config.num_ranks)  # in node terms, before the ranks start or weights ship
    bridge_model.check_rows(model, latent, cluster_config.num_ranks)
    inputs = {
        "noise": noise, "latent_image": latent, "noise_mask": latent_image.get("noise_mask"), "seed": int(seed),
        "steps": int(steps), "cfg": float(cfg), "sampler_name": sampler_name, "scheduler": scheduler,
        "denoise": float(denoise), "positive": positive, "negative": negative, "model_options": model.model_options,
        "object_patches": dict(model.object_patches),
    }
    root = bridge_model.comfy_root()
    with rank_errors_for_user():
        rank_cluster = get_cluster(cluster_config)
        ship_model(rank_cluster, key, make_payload, f"{_RANK}:build", prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel_check)
        result = distributed_sample(
            rank_cluster, key, f"{_RANK}:sample", inputs, config,
            prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel_check, progress=progress,
            timeout_s=cluster_config.call_timeout_s,
        )
    if result["calls"] == 0 and float(denoise) > 0:
        raise RuntimeError(
            "PatchRay Distributed KSampler: the ranks sampled without calling the UNet through PatchRay's wrapper "
            "(another extension replaced ComfyUI's diffusion-model call?); refusing to return an unsharded result"
        )
    log.info("PatchRay KSampler: %d UNet calls on %d ranks", result["calls"], cluster_config.num_ranks)
    out = latent_image.copy()
    out["samples"] = result["latent"]
    return out
