"""The Distributed KSampler's one call: ComfyUI's MODEL, conditioning and LATENT in, the denoised LATENT out.

Driver side (ComfyUI's process). It resolves the ``parallelism`` widget to a layout of CFG groups, sequence ranks
and batch rows (:mod:`.dit_layout`), refuses what that layout cannot honour before anything is shipped, converts the
MODEL (:mod:`.model`), prepares the latent and the seeded noise exactly as the stock KSampler does, ships the model
once per weights and patches, and runs ComfyUI's own sampler on every rank (:mod:`.ksampler_rank`, named by its
canonical module path so the ranks can import it however ComfyUI loaded the pack).
"""

from __future__ import annotations

import logging
import operator
from typing import Callable, Optional

from . import model as bridge_model
from . import shard_models as bridge_shard
from . import validate
from .errors import rank_errors_for_user
from .shim import CANONICAL

__all__ = ["PRESET_NAMES", "PARALLELISM_NAMES", "ATTENTION_NAMES", "SHARDING_NAMES", "patch_config", "sample"]

log = logging.getLogger(__name__)

_RANK = f"{CANONICAL}.nodes.bridge.ksampler_rank"

PRESET_NAMES = ["full_sync", "displaced", "otil", "balanced"]
PARALLELISM_NAMES = ["auto", "sequence", "cfg", "cfg+sequence", "batch"]  # dit_layout.MODES, without importing it here
ATTENTION_NAMES = ["auto", "gathered", "ulysses"]
SHARDING_NAMES = bridge_shard.SHARDING_NAMES
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
    *, parallelism: str = "auto", attention: str = "auto", sharding: str = "none",
    cancel_check: Optional[Callable[[], None]] = None, progress: Optional[Callable[[int, int], None]] = None,
) -> dict:
    """Run the KSampler on the ranks of ``cluster_config``; return the LATENT dict.

    Args:
        config: the :class:`PatchConfig` (:func:`patch_config`) of the UNet's row-band patch parallelism.
        parallelism: the node's widget (:data:`PARALLELISM_NAMES`; see :mod:`.dit_layout`).
        attention: sequence-parallel attention of DiTs: ``gathered`` K/V, ``ulysses`` (heads must divide by the
            sequence ranks) or ``auto`` (per call, from the modelled link cost).
        sharding: the diffusion model's weights on the ranks: ``none`` (each rank holds all of them), ``blocks``
            (1/N of each block per rank, FSDP2, gathered per block as it runs; :mod:`.shard_models`) or ``auto``
            (``blocks`` when the weights would not leave room for activations on the smallest card).
        cancel_check: ComfyUI's interrupt check, polled while the ranks work.
        progress: ``fn(done, total)`` for ComfyUI's progress bar.

    Raises:
        ValueError / TypeError / NotImplementedError: refused inputs, before anything is shipped.
        RankFailure: a rank failed (clean message; the trace is chained for the log).
    """
    from ...distributed.cluster import ClusterConfig, get_cluster
    from ...distributed.sampling.config import LayerMode, OutputMode
    from ...distributed.sampling.remote import distributed_sample
    from ...distributed.sampling.ship import ship_model_in_parts
    from .dit_layout import plan_layout
    from .dit_models import cond_refusal, find_row

    if parallelism not in PARALLELISM_NAMES:
        raise ValueError(f"parallelism must be one of {PARALLELISM_NAMES} (got {parallelism!r})")
    if attention not in ATTENTION_NAMES:
        raise ValueError(f"sequence_attention must be one of {ATTENTION_NAMES} (got {attention!r})")
    if sharding not in SHARDING_NAMES:
        raise ValueError(f"sharding must be one of {SHARDING_NAMES} (got {sharding!r})")
    if sampler_name in _ADAPTIVE and config.output is OutputMode.OTIL:
        raise ValueError(f"sampler {sampler_name!r} adapts its step count to the whole latent, which OTIL leaves approximate on each rank; pick another sampler or preset")
    if not isinstance(cluster_config, ClusterConfig):
        raise TypeError(f"cluster must come from a PatchRay Cluster node (got {type(cluster_config).__name__})")
    if not isinstance(latent_image, dict) or "samples" not in latent_image:
        raise TypeError("latent_image must be a ComfyUI LATENT (a dict with 'samples')")
    bridge_model.check_model_type(model)
    kind = bridge_model.diffusion_kind(model)
    stale = config.layer_mode is not LayerMode.FULL_SYNC or config.output is not OutputMode.GATHER
    latent, noise = bridge_model.latent_and_noise(model, latent_image, seed)
    n = cluster_config.num_ranks
    layout = plan_layout(
        parallelism, n, cfg, int(latent.shape[0]),
        sequence_refusal=bridge_model.sequence_refusal(model), unet_stale_preset=kind == "unet" and stale,
    )
    if layout.note:
        log.warning("PatchRay KSampler: %s", layout.note)
    if stale and not (kind == "unet" and layout.mode == "sequence"):
        raise ValueError(
            f"preset {config_name(config)} (stale neighbour data) is the UNet's row-band patch parallelism: it applies to "
            f"parallelism=sequence on SD 1.x/2.x/SDXL UNets; this run is parallelism={layout.mode} on a "
            f"{'UNet' if kind == 'unet' else 'DiT'}: pick preset full_sync"
        )
    if layout.seq_ranks > 1:
        if kind == "unet":  # in node terms, before the ranks start or weights ship (DiT rows: check_sequence)
            validate.sampling_rows(model, latent, layout.seq_ranks)
        bridge_model.check_sequence(model, latent, layout.seq_ranks)
        if kind == "dit":
            dm = model.model.diffusion_model
            row = find_row(type(dm).__name__)
            for name, cond in (("positive", positive), ("negative", negative)):
                why = cond_refusal(row, name, cond)
                if why:
                    raise NotImplementedError(why)
            heads = int(operator.attrgetter(row.heads)(dm))  # a dotted path ("transformer_blocks.0.attn1.heads")
            if attention == "ulysses" and heads % layout.seq_ranks:
                raise ValueError(
                    f"sequence_attention=ulysses splits the {heads} attention heads over the {layout.seq_ranks} sequence "
                    f"ranks, which does not divide; pick gathered or auto"
                )
    bridge_model.check_conditioning("positive", positive, layout.mode)
    bridge_model.check_conditioning("negative", negative, layout.mode)
    key, make_skeleton, names, tensor, sizes = bridge_model.portable_parts(model, layout.mode)
    if sharding == "blocks":
        bridge_shard.blocks_for(model.model.diffusion_model)  # an uncovered class is refused before the ranks start

    inputs = {
        "noise": noise, "latent_image": latent, "noise_mask": latent_image.get("noise_mask"), "seed": int(seed),
        "steps": int(steps), "cfg": float(cfg), "sampler_name": sampler_name, "scheduler": scheduler,
        "denoise": float(denoise), "positive": positive, "negative": negative, "model_options": model.model_options,
        "object_patches": dict(model.object_patches), "layout": layout._asdict(), "kind": kind, "attention": attention,
    }
    root = bridge_model.comfy_root()
    with rank_errors_for_user():
        rank_cluster = get_cluster(cluster_config)
        free_min = total_min = None
        if sharding == "auto" and n > 1:
            mem = rank_cluster.run(f"{_RANK}:device_memory", timeout_s=60.0, cancel_check=cancel_check)
            free_min, total_min = min(m[0] for m in mem), min(m[1] for m in mem)
        resolved, why = bridge_shard.resolve_sharding(sharding, model.model.diffusion_model, n, free_min, total_min)
        if sharding == "auto":
            log.info("PatchRay KSampler: %s", why)
        key = key + (("sharding", resolved),)  # a sharded model and a whole one are different things on the ranks

        def make_payload(make=make_skeleton, resolved=resolved):
            return dict(make(), sharding=resolved)

        # the weights travel a part at a time (numpy views of Ray's shared store): beside ComfyUI's own weights the
        # host holds at most one part in flight (sampling/ship.py)
        ship_model_in_parts(
            rank_cluster, key, make_payload, names, tensor, f"{_RANK}:begin_parts", end=f"{_RANK}:end_parts", sizes=sizes,
            prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel_check,
        )
        result = distributed_sample(
            rank_cluster, key, f"{_RANK}:sample", inputs, config,
            prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel_check, progress=progress,
            timeout_s=cluster_config.call_timeout_s,
        )
    if result["calls"] == 0 and float(denoise) > 0:
        raise RuntimeError(
            "PatchRay Distributed KSampler: the ranks sampled without calling the model through PatchRay's wrapper "
            "(another extension replaced ComfyUI's diffusion-model call?); refusing to return an unsharded result"
        )
    log.info("PatchRay KSampler: %d model calls on %d ranks (%s: %d CFG group(s) x %d sequence rank(s)%s)",
             result["calls"], n, layout.mode, layout.cfg_groups, layout.seq_ranks, ", batch rows split" if layout.batch else "")
    out = latent_image.copy()
    out["samples"] = result["latent"]
    return out


def config_name(config) -> str:
    """The preset a PatchConfig came from (for messages)."""
    from ...distributed.sampling.config import PRESETS

    for name in PRESET_NAMES:
        base = PRESETS[name].replace(split_batch=False)
        if (base.layer_mode, base.output, base.groupnorm) == (config.layer_mode, config.output, config.groupnorm):
            return name
    return "(custom)"
