"""Weight sharding's communication: thin wrappers over PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Design decisions:

* **Part of comm, in its own file.** :mod:`.comm` is the door every other module uses (it re-exports every name
  here); this file holds the FSDP2 calls because they are a different job from the plain collectives: sharding a
  module's parameters, prefetching the next block's gather, and routing FSDP2's all-gather through one function
  that counts it and stages it on the host for gloo. It is one of the three comm modules the structure test
  (tests/distributed/test_structure.py) lets use ``torch.distributed``, and only :mod:`.comm` imports it.
* **FSDP2 is imported where it is used.** ``torch.distributed.fsdp`` and ``DeviceMesh`` load only when a model is
  sharded, so a decode or a sampling run without sharding never imports them.
* **Scalar parameters stay whole.** FSDP2 shards on dim 0 and refuses a 0-d parameter ("fully_shard doesn't support
  scalar parameters"); ComfyUI's scaled-fp8 layers hold their scales as 0-d parameters (``scale_weight``,
  ``scale_input``). :func:`fully_shard` passes them to FSDP2 as ``ignored_params`` (:func:`kept_whole` is the rule):
  every rank holds its own full copy as loaded, in its dtype, on the module where the layer reads it, so a gathered
  layer computes with exactly the scale the unsharded one does. They are bytes, not a gather: 4 per scale.
* The design of weight sharding (per-block units, prefetch, dtypes on the wire) is in ``docs/sharding.md``.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.distributed as dist

from .context import ParallelContext

__all__ = ["ShardTally", "fully_shard", "kept_whole", "is_sharded", "base_class", "set_forward_prefetch", "local_shard"]


class ShardTally:
    """Bytes and calls of the weight all-gathers FSDP2 made on this rank (``sharded``'s traffic; comm's own
    accounting does not see them: FSDP2 calls ``all_gather_single``, which is not one of :data:`COUNTED_OPS`)."""

    def __init__(self):
        self.calls = 0
        self.received = 0  # bytes that arrived from the peers (the gathered buffer less this rank's own piece)
        self.gathered = 0  # bytes of the gathered (unsharded) buffers

    def reset(self) -> None:
        self.calls = self.received = self.gathered = 0


def _gather_comm(ctx: ParallelContext, tally: ShardTally):
    """FSDP2's all-gather, routed through this module: counted, and staged on the host for gloo on CUDA tensors.

    FSDP2 packs a block's sharded parameters into one flat buffer (as ``uint8`` bytes when the block mixes dtypes,
    so float8 weights travel as their own bytes) and calls this once per block. Under NCCL it runs asynchronously
    on FSDP2's all-gather stream; under gloo with CUDA tensors it copies through host memory and blocks.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    stage = ctx.backend == "gloo" and ctx.device.type == "cuda"

    class _Gather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.dtype in _FLOAT8:
                # a block whose parameters are all float8 is gathered in that dtype, which gloo refuses ("Invalid
                # scalar type"): the same bytes travel as uint8
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            tally.calls += 1
            tally.gathered += output_tensor.numel() * output_tensor.element_size()
            tally.received += (output_tensor.numel() - input_tensor.numel()) * output_tensor.element_size()
            if stage:
                host = torch.empty(output_tensor.shape, dtype=output_tensor.dtype, device="cpu")
                _gather_single(host, input_tensor.cpu(), group=group)
                output_tensor.copy_(host)
                return None
            return _gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    return _Gather()


def _gather_single(out, inp, **kw):
    # torch 2.13 names the flat all-gather all_gather_single (all_gather_into_tensor is its deprecated alias)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, **kw)


_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))

_meshes: Dict[tuple, object] = {}


def _mesh(ctx: ParallelContext):
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(ctx.group), ctx.global_ranks, ctx.device.type)
    mesh = _meshes.get(key)
    if mesh is None:
        mesh = _meshes[key] = DeviceMesh.from_group(ctx.group, ctx.device.type)
    return mesh


def kept_whole(param: torch.Tensor) -> bool:
    """Whether :func:`fully_shard` leaves ``param`` whole on every rank instead of sharding it: a 0-d (scalar)
    parameter, which has no dim 0 to shard (ComfyUI's scaled-fp8 ``scale_weight`` / ``scale_input``)."""
    return param.dim() == 0


def fully_shard(module: torch.nn.Module, ctx: ParallelContext, tally: ShardTally, *, offload: bool = False) -> torch.nn.Module:
    """Shard ``module``'s parameters over ``ctx``'s ranks with FSDP2 (dim-0 shards; gathered before its forward and
    freed after it); ``offload`` keeps the shards in host memory (FSDP2's ``CPUOffloadPolicy``), pinned on CUDA ranks.
    Scalar parameters (:func:`kept_whole`) are FSDP2's ``ignored_params``: each rank keeps them whole, where they are.

    No dtype cast is asked for (no ``MixedPrecisionPolicy`` dtype): every parameter keeps its own dtype in memory
    and on the wire. Returns ``module`` (its class becomes FSDP2's subclass of the original; see :func:`base_class`).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as _fully_shard

    # pinned pages make FSDP2's per-block host -> device copy (non_blocking) asynchronous at the full PCIe rate; torch
    # pins only with a CUDA host allocator, so CPU ranks (whose copy is a no-op) keep ordinary pages
    policy = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if offload else OffloadPolicy()
    whole = {p for p in module.parameters() if kept_whole(p)}
    _fully_shard(module, mesh=_mesh(ctx), reshard_after_forward=True, offload_policy=policy, ignored_params=whole or None)
    module.set_custom_all_gather(_gather_comm(ctx, tally))
    return module


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module (its parameters sharded by :func:`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def base_class(module: torch.nn.Module) -> type:
    """``module``'s own class: the original one under FSDP2's subclass (``FSDPDoubleStreamBlock`` -> ``DoubleStreamBlock``)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        return next(c for c in cls.__mro__[1:] if c is not FSDPModule and not issubclass(c, FSDPModule))
    return cls


def set_forward_prefetch(order: Sequence[torch.nn.Module], depth: int = 1) -> None:
    """Each sharded module of ``order`` (the forward order) starts the all-gather of the next ``depth`` ones when its
    own forward begins, so their weights arrive while it computes (FSDP2's explicit forward prefetch)."""
    for m in order:
        # Each unit is its own FSDP2 root (the model around them stays unwrapped, so hosts still see its class).
        # A root is set up at its first forward; the one a prefetch targets runs later, so set every unit up now.
        m._get_fsdp_state()._lazy_init()
    for i, m in enumerate(order if depth else ()):
        nxt = list(order[i + 1 : i + 1 + depth])
        if nxt:
            m.set_modules_to_forward_prefetch(nxt)


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded parameter (the ``DTensor``'s local tensor); the tensor itself otherwise."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def is_sharded_tensor(t) -> bool:
    """Whether ``t`` is a shard of a tensor laid over the ranks (a ``DTensor``: a weight-sharded block's parameter
    between its forwards)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
