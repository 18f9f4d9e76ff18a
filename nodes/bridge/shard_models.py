"""Weight sharding of ComfyUI's diffusion models: the block table of ComfyUI's classes, and what each rank does.

The library (``distributed/parallel/shard.py``) shards any model per unit with FSDP2 given the units' globs; which
modules of ``comfy.ldm``'s classes are the blocks is the ``blocks`` field of the family table (:mod:`.families`), keyed
by the class name of ``model.diffusion_model``; parameters outside the blocks (embedders, final layer) stay whole on
every rank.

The driver decides the ``sharding`` widget (:func:`resolve_sharding`: ``auto`` from the smallest free memory the
ranks report, escalating none -> blocks -> blocks+offload) before anything ships, and refuses a ``blocks+offload`` run
whose shards would not fit the host memory of the machines the ranks are on (:func:`check_host_memory`); the ranks
shard right after the weights are loaded (:func:`apply_sharding`, called by ``ksampler_rank.begin_parts``), over all
of the cluster's ranks: every rank runs the same model calls in the same order whatever the parallelism (sequence,
cfg, batch), so the per-block gathers line up on every rank.

Widget values (saved workflows keep their meaning): ``none``, ``blocks`` and ``auto`` as before; ``blocks+offload``
is ``blocks`` with FSDP2's CPU offload (the shards in host memory, copied to the device per block).
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .families import FAMILIES

__all__ = [
    "SHARDING_NAMES", "SHARDED", "COMFY_BLOCKS", "blocks_for", "apply_sharding", "local_model_bytes", "resolve_sharding",
    "weight_bytes", "BlockBytes", "block_bytes", "check_host_memory", "offload_advice",
]

SHARDING_NAMES = ["none", "blocks", "blocks+offload", "auto"]
#: the values that shard the blocks (resolved, as the ranks receive them)
SHARDED = ("blocks", "blocks+offload")
_NODE = "PatchRay"

#: ComfyUI 0.3.64 diffusion-model class -> the globs of its blocks (one FSDP2 unit each, in forward order): the
#: ``blocks`` of the family table's rows (:mod:`.families`)
COMFY_BLOCKS: Dict[str, Tuple[str, ...]] = {c: r.blocks for r in FAMILIES if r.blocks for c in r.classes}


def blocks_for(dm, sharding: str = "blocks") -> Tuple[str, ...]:
    """The block globs of ComfyUI diffusion model ``dm``; ``NotImplementedError`` in node terms otherwise (a class
    without a row in the table, a GGUF model: ``gguf_weights.sharding_refusal``)."""
    from .gguf_weights import sharding_refusal

    why = sharding_refusal(dm, sharding)
    if why:
        raise NotImplementedError(why)
    name = type(dm).__name__
    if name not in COMFY_BLOCKS:
        raise NotImplementedError(
            f"{_NODE}: sharding={sharding} has no block table for {name} (covered: "
            f"{', '.join(sorted(COMFY_BLOCKS))}); use sharding=none"
        )
    return COMFY_BLOCKS[name]


def weight_bytes(dm) -> int:
    """Bytes of ``dm``'s parameters as loaded (fp8 one byte per element)."""
    return sum(p.numel() * p.element_size() for p in dm.parameters())


def apply_sharding(ctx, base_model, sharding: str, init=None):
    """On each rank: shard the diffusion model's blocks over ``ctx`` (``blocks``; ``blocks+offload``: the shards in host
    memory, FSDP2's CPU offload), or leave it whole (``none``); after the weights are loaded, or on the meta skeleton
    with ``init`` allocating the tensors (the weights then arrive in parts). Returns the library's ``ShardHandle`` or
    ``None``."""
    if sharding in (None, "none") or ctx.world_size == 1:
        return None
    if sharding not in SHARDED:  # backstop, not the guard: the driver resolves auto before shipping
        raise ValueError(f"sharding must be none, blocks or blocks+offload on the ranks (got {sharding!r})")
    from ...distributed.parallel.shard import shard_model

    dm = base_model.diffusion_model
    offload = sharding == "blocks+offload"
    handle = shard_model(dm, ctx, blocks_for(dm, sharding), init=init, offload=offload)
    for _, unit in handle.units:
        # A sharded block lives where FSDP2 put it (the rank's device, or the host with offload) and is gathered to the
        # device per call. ComfyUI's loader moves whole models between its load and offload devices
        # (``ModelPatcher.detach`` -> ``model.to``), which cannot swap FSDP2's DTensor parameters ("Couldn't swap
        # Linear.weight"): for the blocks it is a no-op. With offload its per-layer ``.to(device)`` (``load``) would
        # also move the host shards to the card, undoing the offload: every module inside the block keeps in place.
        for m in unit.modules() if offload else (unit,):
            m.__dict__["_apply"] = _keep_in_place(m)
    return handle


def _keep_in_place(unit):
    def _apply(fn, recurse=True):
        return unit

    return _apply


def local_model_bytes(base_model, handle=None) -> int:
    """Bytes of the parameters this rank holds on its device: its shards plus the parameters outside the blocks; with
    offload (``handle.offload``) the parameters outside the blocks plus the largest block twice (gathered in flight:
    the running one and the prefetched next), the shards being in host memory. What ComfyUI's loader should count as
    the model's size on this rank."""
    from ...distributed import comm

    if handle is not None and handle.offload:
        in_units = {id(p) for _, u in handle.units for p in u.parameters()}
        rest = sum(p.numel() * p.element_size() for p in base_model.parameters() if id(p) not in in_units)
        from ...distributed.parallel.shard import block_bytes as unit_bytes

        largest = max((unit_bytes(u) for _, u in handle.units), default=0)
        return rest + 2 * largest
    return sum(comm.local_shard(p).numel() * comm.local_shard(p).element_size() for p in base_model.parameters())


class BlockBytes(NamedTuple):
    """The driver's figures of ``dm``'s blocks (from the block table, on the whole model as loaded).

    Args:
        total: bytes of all the blocks' parameters.
        largest: bytes of the largest block (one gathered unit).
        weights: bytes of all of ``dm``'s parameters.
        per_rank_padded: bytes one rank holds of the blocks at ``N`` ranks, FSDP2's padding included (every rank
            allocates ``ceil(d0 / N)`` rows of each parameter); filled by :func:`block_bytes` for a given ``N``.
    """

    total: int
    largest: int
    weights: int
    per_rank_padded: int


def block_bytes(dm, num_ranks: int) -> Optional[BlockBytes]:
    """:class:`BlockBytes` of ComfyUI diffusion model ``dm`` sharded over ``num_ranks``; ``None`` when its class has
    no block table."""
    from ...distributed.parallel.shard import find_units

    globs = COMFY_BLOCKS.get(type(dm).__name__)
    if globs is None:
        return None
    n = max(int(num_ranks), 1)
    total = largest = padded = 0
    for _, unit in find_units(dm, globs):
        ub = 0
        for p in unit.parameters():
            nbytes = p.numel() * p.element_size()
            ub += nbytes
            if p.dim() == 0:
                padded += nbytes
            else:
                rows = p.shape[0]
                padded += math.ceil(rows / n) * (nbytes // max(rows, 1))
        total += ub
        largest = max(largest, ub)
    return BlockBytes(total, largest, weight_bytes(dm), padded)


def offload_advice(dm, num_ranks: int, link: Optional[str] = None):
    """The modelled cost of ``blocks+offload`` for ``dm`` over ``num_ranks`` ranks: the library's ``OffloadCost`` (its
    ``text``: host -> device bytes per model call and rank, their time on PCIe 4.0 x16, and whether a step is slower
    than one card with ComfyUI's offload on ``link``; ``slower`` the verdict, ``None`` when the link is unknown)."""
    from ...distributed.topology.shard_advice import offload_cost

    bb = block_bytes(dm, num_ranks)
    fraction = bb.total / bb.weights if bb is not None and bb.weights else 0.97
    return offload_cost(weight_bytes(dm), num_ranks, link, block_fraction=fraction)


def check_host_memory(dm, num_ranks: int, hosts: Sequence[Tuple[str, float, float]]) -> str:
    """Refuse (``ValueError`` in the node's terms, before anything ships) a ``blocks+offload`` run whose shards would
    not fit the host memory of a machine the ranks are on; return a one-line summary otherwise.

    Args:
        dm: the diffusion model (the driver's, as loaded).
        num_ranks: the ranks the blocks are sharded over.
        hosts: per rank ``(machine, available bytes, total bytes)`` (``ksampler_rank.host_memory``: available counts the
            memory the rank's previous model holds, which is freed before the new one arrives).
    """
    from ...distributed.topology.shard_advice import GIB, host_fits, host_headroom

    bb = block_bytes(dm, num_ranks)
    if bb is None:  # backstop, not the guard: blocks_for refused the class before
        raise NotImplementedError(f"{_NODE}: sharding=blocks+offload has no block table for {type(dm).__name__}")
    by_host: Dict[str, List[Tuple[float, float]]] = {}
    for machine, available, total in hosts:
        by_host.setdefault(machine, []).append((float(available), float(total)))
    lines = []
    for machine, ranks in sorted(by_host.items()):
        pinned = bb.per_rank_padded * len(ranks)
        # ranks on one machine read the same memory figures at about the same time: the smallest is the safe one
        available = min(a for a, _ in ranks)
        total = min(t for _, t in ranks)
        headroom = host_headroom(total)
        if not host_fits(pinned, available, total):
            raise ValueError(
                f"{_NODE}: sharding=blocks+offload keeps each rank's shards in pinned host memory: the {len(ranks)} "
                f"rank(s) on {machine} would pin {pinned / GIB:.1f} GiB ({bb.per_rank_padded / GIB:.1f} GiB each), but "
                f"that machine has {available / GIB:.1f} GiB available and {headroom / GIB:.1f} GiB must stay free (10 % "
                f"of its {total / GIB:.1f} GiB, at least 4 GiB). Nothing was loaded. Use fp8 weights, put ranks on more "
                f"machines, free host memory, or pick sharding=blocks (the shards on the cards) if they fit there"
            )
        lines.append(f"{machine}: {len(ranks)} rank(s) pin {pinned / GIB:.2f} GiB of {available / GIB:.1f} GiB available")
    return "; ".join(lines)


def resolve_sharding(sharding: str, dm, num_ranks: int, free_bytes_min: Optional[float], total_bytes_min: Optional[float] = None,
                     link: Optional[str] = None, host_ranks: bool = False):
    """The widget's value for this run (``auto`` -> ``none``, ``blocks`` or ``blocks+offload``) and the reason, decided
    on the driver from the smallest free memory the cluster reports (the same figure for every rank). ``host_ranks``:
    the ranks compute on the host (CPU ranks), where ``auto`` stops at ``blocks`` (offloading to the host frees
    nothing there)."""
    if sharding not in SHARDING_NAMES:
        raise ValueError(f"sharding must be one of {SHARDING_NAMES} (got {sharding!r})")
    if sharding in SHARDED:
        blocks_for(dm, sharding)  # refuse an uncovered class before anything ships
        return sharding, f"sharding={sharding}"
    if sharding == "none" or num_ranks < 2:
        return "none", "sharding=none"
    if free_bytes_min is None:
        return "none", "sharding=auto: no free-memory figure from the ranks; each rank holds the whole model"
    from ...distributed.topology.shard_advice import choose_sharding

    bb = block_bytes(dm, num_ranks)
    extra = {} if bb is None or not bb.weights else {
        "block_fraction": bb.total / bb.weights, "largest_block_bytes": float(bb.largest)}
    choice = choose_sharding(weight_bytes(dm), free_bytes_min, num_ranks, total_bytes_min=total_bytes_min, link=link,
                             offload=not host_ranks, **extra)
    if choice.sharding in SHARDED and bb is None:
        return "none", f"sharding=auto: {choice.reason}, but {type(dm).__name__} has no block table; each rank holds the whole model"
    if choice.sharding in SHARDED:
        from .gguf_weights import holds_ggml

        if holds_ggml(dm):
            return "none", (f"sharding=auto: {choice.reason}, but a GGUF model's quantized weights cannot be sharded; each "
                            "rank holds the whole quantized model")
    return choice.sharding, f"sharding=auto: {choice.reason}"
