"""Weight sharding per block with PyTorch's FSDP2, over the same ranks as sequence parallelism.

A model bigger than one card is held as 1/N of each block's parameters per rank; a block's weights are gathered
just before it runs and freed after it (FSDP2's ``fully_shard`` with ``reshard_after_forward``), while the next
block's gather is already under way (explicit forward prefetch). The ranks are the sequence-parallel ranks of
``parallel/sequence.py`` and ``sampling/dit.py``: one process group, one :class:`ParallelContext`; the sequence
adapters see ordinary full parameters inside a block's forward and never know the weights were sharded.

Design decisions:

* **FSDP2, not a hand-written gather.** ``fully_shard`` shards every parameter on dim 0 as a ``DTensor``, packs a
  block's shards into one flat all-gather and swaps the gathered tensors in as plain parameters for the forward
  (so code that reads ``module.weight``, ComfyUI's per-layer casting included, runs unchanged). ``comm`` wraps it
  (the only caller of ``torch.distributed``) and routes its all-gather through a counted, gloo-safe call.
* **The plan is data.** The caller passes the globs of the modules that become one sharded unit each (a transformer
  block, a UNet block), read from its family table: the diffusers classes' rows are ``blocks`` of
  ``sampling/dit_families.py`` (``SHARD_FAMILIES``, ``shard_blocks_for``); a host application's classes are rows
  of its own bridge. This module holds no table. The shallowest module matching a glob is the unit (``blocks.*`` takes
  ``blocks.3``, not ``blocks.3.attn1``). Parameters outside the units (embedders, final layer: 1-3 % of a DiT)
  stay whole on every rank, and the model's own class is left as it is (hosts look models up by class name).
* **fp8 stays fp8.** No dtype policy is set: each parameter keeps its dtype in memory and on the wire. FSDP2
  (torch 2.13) gathers a block that mixes dtypes (fp8 weights, bf16 biases and norms, as ComfyUI loads fp8
  checkpoints) as one ``uint8`` byte buffer and views each parameter back in its dtype, so a float8 weight costs
  one byte per element in the shard, on the wire and gathered. A separate group per dtype is not needed.
* **Scalars stay whole.** A 0-d parameter has no dim 0 to shard (FSDP2 refuses it): ComfyUI's scaled-fp8 layers
  hold their ``scale_weight`` / ``scale_input`` so. Each rank keeps such a parameter whole on its layer
  (``comm.kept_whole``; FSDP2's ``ignored_params``), so the scale travels with its layer and is never gathered.
* **Exact.** A gathered parameter is the original tensor, byte for byte; the forward computes the same ops on the
  same values, so a sharded run equals the unsharded one up to what sequence parallelism itself changes.
* **A load-time property, not an adapter.** Sharding replaces the parameters (each rank keeps 1/N of them), so it
  is undone by loading the weights again, not by a ``remove``; :func:`shard_model` refuses an already sharded
  model. Host memory offload of the shards (FSDP2's ``CPUOffloadPolicy``, ``offload=True``; the node's
  ``blocks+offload``) is the fallback for ranks that still do not fit: every gather then crosses host -> device as
  well (``topology/shard_advice.offload_cost`` models it).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .. import comm
from ..context import ParallelContext

__all__ = ["ShardFamily", "shard_blocks_of", "find_units", "shard_model", "ShardHandle", "block_bytes"]


class ShardFamily(NamedTuple):
    """One model class (by name) and the modules that are sharded as one unit each.

    Args:
        name: short family name (errors, benchmark records).
        classes: class names (``type(model).__name__``) the row serves.
        blocks: ``fnmatch`` globs over module paths; the shallowest match is a unit, in forward order.
    """

    name: str
    classes: Tuple[str, ...]
    blocks: Tuple[str, ...]


def shard_blocks_of(model: nn.Module, families: Sequence[ShardFamily]) -> Tuple[str, ...]:
    """The block globs of ``model``'s class in ``families`` (a family table's rows: the diffusers classes'
    ``sampling.dit_families.SHARD_FAMILIES``); ``NotImplementedError`` naming the class when no row has it."""
    name = comm.base_class(model).__name__
    for fam in families:
        if name in fam.classes:
            return fam.blocks
    known = sorted(c for f in families for c in f.classes)
    raise NotImplementedError(
        f"weight sharding has no block table for {name} (known: {', '.join(known)}); a row names the globs of its "
        f"transformer or UNet blocks"
    )


def find_units(model: nn.Module, blocks: Sequence[str]) -> List[Tuple[str, nn.Module]]:
    """``(path, module)`` of every unit ``blocks`` names: the shallowest matches, in ``named_modules`` order (the
    forward order of the blocks of these models)."""
    units: List[Tuple[str, nn.Module]] = []
    taken: List[str] = []
    for path, module in model.named_modules():
        if not path or any(path == t or path.startswith(t + ".") for t in taken):
            continue
        if any(fnmatch.fnmatchcase(path, g) for g in blocks):
            units.append((path, module))
            taken.append(path)
    return units


def block_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters as held unsharded (each in its own dtype)."""
    total = 0
    for p in module.parameters():
        shape = p.shape  # a DTensor reports its global shape
        total += int(torch.Size(shape).numel()) * p.element_size()
    return total


class ShardHandle:
    """What :func:`shard_model` did: the units, the gather tally, and the figures a benchmark or a check reads."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, units: List[Tuple[str, nn.Module]], tally: comm.ShardTally,
                 offload: bool):
        self.model = model
        self.ctx = ctx
        self.units = units
        self.tally = tally
        self.offload = offload

    @property
    def sharded_bytes(self) -> int:
        """Bytes of the sharded units' parameters, unsharded (what one rank gathers per forward); the scalars each rank
        keeps whole (``comm.kept_whole``) are not gathered and not counted."""
        return sum(int(torch.Size(p.shape).numel()) * p.element_size()
                   for _, m in self.units for p in m.parameters() if not comm.kept_whole(p))

    def local_bytes(self) -> int:
        """Bytes of parameters this rank holds: its shards plus the parameters outside the units."""
        total = 0
        for p in self.model.parameters():
            t = comm.local_shard(p)
            total += t.numel() * t.element_size()
        return total

    def local_shapes(self) -> Dict[str, Tuple[torch.Size, torch.Size, torch.dtype]]:
        """``path -> (global shape, local shape, dtype)`` of every sharded parameter (not the scalars kept whole)."""
        out = {}
        for path, unit in self.units:
            for name, p in unit.named_parameters():
                if comm.kept_whole(p):
                    continue
                out[f"{path}.{name}"] = (torch.Size(p.shape), comm.local_shard(p).shape, comm.local_shard(p).dtype)
        return out


def shard_model(
    model: nn.Module,
    ctx: ParallelContext,
    blocks: Sequence[str],
    *,
    prefetch: int = 1,
    offload: bool = False,
    init: Optional[Callable[[nn.Module], None]] = None,
) -> ShardHandle:
    """Shard ``model``'s blocks over ``ctx``'s ranks (FSDP2, one unit per block, forward prefetch).

    Args:
        model: the model, its parameters on ``ctx.device`` (or on the host with ``offload``), every rank holding the
            same weights (each rank keeps its 1/N and drops the rest).
        ctx: the ranks (the sequence-parallel group when composed with :func:`~patchray.distributed.sampling.dit.parallelize_dit`).
        blocks: globs of the units: a family table's row for the model's class (the diffusers classes':
            ``sampling.dit_families.shard_blocks_for(model)``).
        prefetch: how many next blocks' gathers start when a block's forward begins (0: none; 1 is FSDP2's usual).
        offload: keep the shards in host memory (FSDP2's ``CPUOffloadPolicy``): before a block's all-gather each rank
            copies its shard to ``ctx.device``. FSDP2 requires the shards on the host when it sets up, so with ``init``
            allocate the sharded units on the host (``materialize_meta(model, ctx.device, shard_device=cpu)``); on CPU
            ranks the copy is a no-op but the offload path runs (FSDP2 accepts the policy on a CPU mesh under gloo).
        init: for a model built on the meta device: ``init(model)`` runs after the blocks are sharded and before
            the first forward, so each rank allocates only its shards (e.g. ``model.to_empty(device=...)`` and
            loading or drawing each local tensor; see :func:`~patchray.distributed.comm.local_shard`).

    Returns:
        :class:`ShardHandle`.

    Raises:
        NotImplementedError: globs that match no module, or a model already sharded.
        ValueError: a negative ``prefetch``.

    Example:
        >>> handle = shard_model(transformer, ctx, shard_blocks_for(transformer))  # doctest: +SKIP
        >>> handle.local_bytes() < handle.sharded_bytes  # doctest: +SKIP
        True
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (got {prefetch})")
    if any(comm.is_sharded(m) for m in model.modules()):
        raise NotImplementedError(f"{comm.base_class(model).__name__} is already sharded; load its weights again to shard it anew")
    if blocks is None:
        raise TypeError("blocks: the globs of the units are required (the diffusers classes': "
                        "sampling.dit_families.shard_blocks_for(model))")
    globs = tuple(blocks)
    units = find_units(model, globs)
    if not units:
        # a glob may match nothing in one configuration (a FLUX variant without single-stream blocks); none matching
        # anything is a table that does not fit the model
        raise NotImplementedError(f"weight sharding: no module of {comm.base_class(model).__name__} matches {list(globs)}")
    tally = comm.ShardTally()
    handle = ShardHandle(model, ctx, units, tally, offload)
    if ctx.world_size == 1:
        if init is not None:
            init(model)
        return handle  # nothing to share: the model stays as it is
    for _, unit in units:
        if not any(True for _ in unit.parameters()):
            continue
        comm.fully_shard(unit, ctx, tally, offload=offload)
    if init is not None:
        init(model)
    sharded = [u for _, u in units if comm.is_sharded(u)]
    comm.set_forward_prefetch(sharded, prefetch)
    return handle
