"""Weight sharding of ComfyUI's diffusion models: the block table of ComfyUI's classes, and what each rank does.

The library (``distributed/parallel/shard.py``) shards any model per unit with FSDP2 given the units' globs; this
module holds ComfyUI's knowledge: which modules of ``comfy.ldm``'s classes are the blocks. The rows are data, keyed by
the class name of ``model.diffusion_model``; parameters outside the blocks (embedders, final layer) stay whole on every
rank.

The driver decides the ``sharding`` widget (:func:`resolve_sharding`: ``auto`` from the smallest free memory the
ranks report) before anything ships; the ranks shard right after the weights are loaded (:func:`apply_sharding`,
called by ``ksampler_rank.build``), over all of the cluster's ranks: every rank runs the same model calls in the same
order whatever the parallelism (sequence, cfg, batch), so the per-block gathers line up on every rank.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

__all__ = ["SHARDING_NAMES", "COMFY_BLOCKS", "blocks_for", "apply_sharding", "local_model_bytes", "resolve_sharding", "weight_bytes"]

SHARDING_NAMES = ["none", "blocks", "auto"]

#: ComfyUI 0.3.64 diffusion-model class -> the globs of its blocks (one FSDP2 unit each, in forward order)
COMFY_BLOCKS: Dict[str, Tuple[str, ...]] = {
    "Flux": ("double_blocks.*", "single_blocks.*"),
    "Chroma": ("double_blocks.*", "single_blocks.*"),
    "WanModel": ("blocks.*",),
    "VaceWanModel": ("blocks.*",),
    "CameraWanModel": ("blocks.*",),
    "QwenImageTransformer2DModel": ("transformer_blocks.*",),
    "HunyuanVideo": ("double_blocks.*", "single_blocks.*"),
    "LTXVModel": ("transformer_blocks.*",),
    # the layers inside each TimestepEmbedSequential: ComfyUI's UNet iterates a block's layers and calls each one
    # (``forward_timestep_embed``), never the block's own forward, so a unit's gather hook must sit on the layers
    "UNetModel": ("input_blocks.*.*", "middle_block.*", "output_blocks.*.*"),
}


def blocks_for(dm) -> Tuple[str, ...]:
    """The block globs of ComfyUI diffusion model ``dm``; ``NotImplementedError`` in node terms otherwise."""
    name = type(dm).__name__
    if name not in COMFY_BLOCKS:
        raise NotImplementedError(
            f"PatchRay Distributed KSampler: sharding=blocks has no block table for {name} (covered: "
            f"{', '.join(sorted(COMFY_BLOCKS))}); use sharding=none"
        )
    return COMFY_BLOCKS[name]


def weight_bytes(dm) -> int:
    """Bytes of ``dm``'s parameters as loaded (fp8 one byte per element)."""
    return sum(p.numel() * p.element_size() for p in dm.parameters())


def apply_sharding(ctx, base_model, sharding: str, init=None):
    """On each rank: shard the diffusion model's blocks over ``ctx`` (``blocks``), or leave it whole (``none``); after
    the weights are loaded, or on the meta skeleton with ``init`` allocating the tensors (the weights then arrive in
    parts). Returns the library's ``ShardHandle`` or ``None``."""
    if sharding in (None, "none") or ctx.world_size == 1:
        return None
    if sharding != "blocks":  # backstop, not the guard: the driver resolves auto before shipping
        raise ValueError(f"sharding must be none or blocks on the ranks (got {sharding!r})")
    from ...distributed.parallel.shard import shard_model

    dm = base_model.diffusion_model
    handle = shard_model(dm, ctx, blocks_for(dm), init=init)
    for _, unit in handle.units:
        # A sharded block lives where FSDP2 put it (the rank's device) and is gathered there per call. ComfyUI's loader
        # moves whole models between its load and offload devices (``ModelPatcher.detach`` -> ``model.to``), which
        # cannot swap FSDP2's DTensor parameters ("Couldn't swap Linear.weight"): for the blocks it is a no-op.
        unit.__dict__["_apply"] = _keep_in_place(unit)
    return handle


def _keep_in_place(unit):
    def _apply(fn, recurse=True):
        return unit

    return _apply


def local_model_bytes(base_model) -> int:
    """Bytes of the parameters this rank holds (its shards plus the parameters outside the blocks): what ComfyUI's
    loader should count as the model's size on this rank."""
    from ...distributed import comm

    return sum(comm.local_shard(p).numel() * comm.local_shard(p).element_size() for p in base_model.parameters())


def resolve_sharding(sharding: str, dm, num_ranks: int, free_bytes_min: Optional[float], total_bytes_min: Optional[float] = None):
    """The widget's value for this run (``auto`` -> ``none`` or ``blocks``) and the reason, decided on the driver from
    the smallest free memory the cluster reports (the same figure for every rank)."""
    if sharding not in SHARDING_NAMES:
        raise ValueError(f"sharding must be one of {SHARDING_NAMES} (got {sharding!r})")
    if sharding == "blocks":
        blocks_for(dm)  # refuse an uncovered class before anything ships
        return "blocks", "sharding=blocks"
    if sharding == "none" or num_ranks < 2:
        return "none", "sharding=none"
    if free_bytes_min is None:
        return "none", "sharding=auto: no free-memory figure from the ranks; each rank holds the whole model"
    from ...distributed.topology.shard_advice import choose_sharding

    choice = choose_sharding(weight_bytes(dm), free_bytes_min, num_ranks, total_bytes_min=total_bytes_min)
    if choice.sharding == "blocks" and type(dm).__name__ not in COMFY_BLOCKS:
        return "none", f"sharding=auto: {choice.reason}, but {type(dm).__name__} has no block table; each rank holds the whole model"
    return choice.sharding, f"sharding=auto: {choice.reason}"
