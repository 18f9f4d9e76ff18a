"""Communication: the few collectives PatchRay uses and the process-group plumbing; the door to the comm modules.

Design decisions:

* **One place talks to torch.distributed.** Adapters, the runtime and the benchmark call the helpers here
  (``all_reduce``, ``all_gather_padded``, ``exchange_halo``, ``gather_to``, ``barrier``, ...), never ``dist.*``
  directly, so the gloo host-staging rule, padding for transport and one-rank short cuts live in one place. That
  place is four modules with one job each, and every other module imports them through this one (it re-exports
  their names): this file (collectives, process groups, stores, barriers), :mod:`.comm_p2p` (point-to-point: halos,
  pieces, ring stages), :mod:`.comm_intercept` (the one interception layer: count / throttle / time) and
  :mod:`.comm_fsdp` (weight sharding's FSDP2 wrappers). A structure test (tests/distributed/test_structure.py) keeps
  every other module off ``torch.distributed`` and off the siblings.
* **Halo sizes come from shared data, never from a metadata collective.** Every caller passes the
  per-rank sizes it derived from global shapes, so a halo exchange is one ``batch_isend_irecv``.
* **gloo cannot send CUDA tensors point-to-point** ('writev: Bad address', measured on an H200), so under
  gloo a CUDA tensor is staged through host memory for send/recv; collectives run on CUDA tensors as is.
* **One interception layer** (:func:`intercept`, :func:`log_comm`): see :mod:`.comm_intercept`. The records
  (:class:`CommLog`, :class:`CommCall`) are plain data in :mod:`.accounting`; the counting rules are written down
  in ``docs/benchmark.md``.
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .accounting import COUNTED_OPS, CommCall, CommHook, CommLog, tensor_bytes
from .comm_fsdp import (ShardTally, base_class, fully_shard, is_sharded, is_sharded_tensor, kept_whole, local_shard,
                        set_forward_prefetch)
from .comm_intercept import intercept, log_comm, unwrapped
from .comm_p2p import Halo, exchange_halo, exchange_pieces, ring_start
from .context import ParallelContext

__all__ = [
    # collectives (this file)
    "all_reduce", "REDUCE_OPS", "all_gather_into", "all_gather_start", "broadcast", "all_gather_padded", "gather_to", "all_to_all_equal",
    # point-to-point exchanges (comm_p2p)
    "Halo", "exchange_halo", "exchange_pieces", "ring_start",
    # process groups, stores and barriers (this file)
    "init_process_group", "file_store", "tcp_store", "context_for_group", "nccl_available", "is_initialized",
    "destroy_process_group", "barrier", "bounded_barrier", "uncounted_barrier", "new_group", "all_gather_object",
    "comm_error_types",
    # the interception layer (comm_intercept) and its records (accounting)
    "intercept", "log_comm", "COUNTED_OPS", "CommLog", "CommCall", "CommHook", "tensor_bytes",
    # weight sharding's FSDP2 wrappers (comm_fsdp)
    "ShardTally", "fully_shard", "kept_whole", "is_sharded", "is_sharded_tensor", "base_class", "set_forward_prefetch",
    "local_shard",
]

# --------------------------------------------------------------------------------------------------
# primitives


#: reduction names :func:`all_reduce` accepts (callers need not import ``torch.distributed`` for ``ReduceOp``)
REDUCE_OPS = ("sum", "product", "min", "max", "avg")


def _reduce_op(op: Union[str, None, "dist.ReduceOp"]):
    if op is None:
        return dist.ReduceOp.SUM
    if isinstance(op, str):
        if op.lower() not in REDUCE_OPS:
            raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)} (got {op!r})")
        return getattr(dist.ReduceOp, op.upper())
    return op


def all_reduce(t: torch.Tensor, ctx: ParallelContext, op=None) -> torch.Tensor:
    """In-place sum (or ``op``: a name of :data:`REDUCE_OPS` or a ``ReduceOp``) over the group; a no-op on one
    rank. Returns ``t``."""
    if ctx.world_size == 1:
        return t
    dist.all_reduce(t, op=_reduce_op(op), group=ctx.group)
    return t


def all_gather_into(outputs: List[torch.Tensor], send: torch.Tensor, ctx: ParallelContext, async_op: bool = False):
    """All-gather ``send`` into ``outputs`` (one tensor per rank, written in place); returns the work handle of
    an asynchronous call, else ``None``.

    Under gloo a CUDA tensor is staged through the host, which makes the call blocking (``None`` is returned
    then, too); NCCL runs an asynchronous one on its own stream.
    """
    if ctx.world_size == 1:
        outputs[0].copy_(send)
        return None
    if ctx.stages_p2p_through_host:
        host_out = [torch.empty_like(o, device="cpu") for o in outputs]
        dist.all_gather(host_out, send.cpu(), group=ctx.group)
        for o, h in zip(outputs, host_out):
            o.copy_(h)
        return None
    work = dist.all_gather(outputs, send, group=ctx.group, async_op=async_op)
    return work if async_op else None


def all_gather_start(send: torch.Tensor, ctx: ParallelContext):
    """Start an all-gather of ``send`` (the same shape on every rank) into a new ``[N, *send.shape]`` tensor; returns it
    and the work handle to ``wait()`` on before reading the peers' entries (``None``: complete; gloo's collective on
    CUDA tensors copies them through the host inside the call). One flat collective where the backend has it."""
    n = ctx.world_size
    out = send.new_empty((n,) + tuple(send.shape))
    send = send.contiguous()
    if n == 1:
        out[0].copy_(send)
        return out, None
    async_op = not ctx.stages_p2p_through_host  # gloo copies CUDA tensors through the host inside the call
    if _into_tensor_ok(ctx):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # see _gather_into
            try:
                return out, dist.all_gather_into_tensor(out.view((n * send.shape[0],) + tuple(send.shape[1:])) if send.dim()
                                                        else out, send, group=ctx.group, async_op=async_op)
            except RuntimeError as exc:
                if "support" not in str(exc).lower() and "not implemented" not in str(exc).lower():
                    raise
                _NO_INTO_TENSOR.add(id(ctx.group))
    return out, dist.all_gather(list(out.unbind(0)), send, group=ctx.group, async_op=async_op)


def broadcast(t: torch.Tensor, ctx: ParallelContext, src: int = 0) -> torch.Tensor:
    """Broadcast ``t`` from group rank ``src`` in place; a no-op on one rank."""
    if ctx.world_size == 1:
        return t
    dist.broadcast(t, src=ctx.global_ranks[src] if ctx.global_ranks else src, group=ctx.group)
    return t


def _pad_along(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def all_gather_padded(t: torch.Tensor, ctx: ParallelContext, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim``; ``sizes[r]`` is rank r's extent (known to all).

    Uneven extents are padded to the largest for transport and cut back afterwards, so this is one
    ``all_gather`` and no metadata collective.
    """
    if ctx.world_size == 1:
        return t
    if len(sizes) != ctx.world_size:
        raise ValueError(f"sizes must have one entry per rank (got {len(sizes)}, world_size {ctx.world_size})")
    if t.shape[dim] != sizes[ctx.rank]:
        raise ValueError(f"this rank's extent {t.shape[dim]} along dim {dim} differs from sizes[{ctx.rank}]={sizes[ctx.rank]}")
    biggest = max(sizes)
    send = _pad_along(t, dim, biggest)
    if min(sizes) == biggest and math.prod(t.shape[:dim]) == 1 and _into_tensor_ok(ctx):
        # equal extents and nothing but unit dims before ``dim``: the concatenation along ``dim`` is the ranks' tensors
        # one after another in memory, so gather straight into the result (no per-rank buffers, no concatenation)
        send = send.contiguous()
        # the result is a tensor of its own (not a view: callers may split it and write into the pieces); the
        # collective writes through a flat view of it
        result = send.new_empty(tuple(t.shape[:dim]) + (ctx.world_size * biggest,) + tuple(t.shape[dim + 1:]))
        if _gather_into(result.view((ctx.world_size * send.shape[0],) + tuple(send.shape[1:])), send, ctx):
            return result
    bufs = [torch.empty_like(send) for _ in range(ctx.world_size)]
    dist.all_gather(bufs, send, group=ctx.group)
    if min(sizes) == biggest:  # nothing padded: no pieces to cut (one call per layer and step)
        return torch.cat(bufs, dim=dim)
    return torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)], dim=dim)


#: process groups whose backend refused a flat all-gather (the list form is used for them from then on)
_NO_INTO_TENSOR: set = set()


def _into_tensor_ok(ctx: ParallelContext) -> bool:
    return id(ctx.group) not in _NO_INTO_TENSOR


def _gather_into(out: torch.Tensor, send: torch.Tensor, ctx: ParallelContext) -> bool:
    """One flat all-gather into ``out``; False (and remembered per group) where the backend lacks it for this device.

    Every rank of a group has the same backend and device type, so all of them take the same branch."""
    try:
        with warnings.catch_warnings():
            # torch 2.13 renames it all_gather_single; the old name is the one the interception layer counts
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(out, send, group=ctx.group)
        return True
    except RuntimeError as exc:
        if "support" not in str(exc).lower() and "not implemented" not in str(exc).lower():
            raise
        _NO_INTO_TENSOR.add(id(ctx.group))
        return False


def gather_to(t: torch.Tensor, ctx: ParallelContext, dim: int, sizes: Sequence[int], dst: int = 0) -> Optional[torch.Tensor]:
    """Concatenate every rank's ``t`` along ``dim`` on group rank ``dst`` only (``None`` elsewhere).

    The output travels once, to the caller: no all-gather to every rank.
    """
    if ctx.world_size == 1:
        return t
    biggest = max(sizes)
    send = _pad_along(t, dim, biggest)
    # gloo's gather on CUDA tensors is not among the collectives measured to work: stage it on the host, in
    # page-locked memory (pageable copies of a band ran at about 1 GB/s on an H200 host)
    stage = ctx.stages_p2p_through_host
    if stage:
        send = torch.empty(send.shape, dtype=send.dtype, pin_memory=True).copy_(send)
    if ctx.rank == dst:
        bufs = [torch.empty(send.shape, dtype=send.dtype, device=send.device, pin_memory=stage)
                for _ in range(ctx.world_size)]
    else:
        bufs = None
    dst_global = ctx.global_ranks[dst] if ctx.global_ranks else dst
    dist.gather(send, gather_list=bufs, dst=dst_global, group=ctx.group)
    if ctx.rank != dst:
        return None
    if not stage:
        return torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)], dim=dim)
    shape = list(t.shape)
    shape[dim] = sum(sizes)
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    offset = 0
    for b, s in zip(bufs, sizes):  # each band straight from its page-locked buffer into place
        out.narrow(dim, offset, s).copy_(b.narrow(dim, 0, s))
        offset += s
    return out


def all_to_all_equal(send: torch.Tensor, ctx: ParallelContext, stage_on_host: Optional[bool] = None) -> torch.Tensor:
    """Every rank sends ``send[j]`` to rank j and receives rank j's piece in ``out[j]`` (one ``all_to_all_single``).

    ``send`` is ``[world_size, ...]`` with equal pieces (callers pad uneven ones to the largest extent, which every
    rank derives from shared shapes, and cut the padding off after): no sizes travel. Under gloo a CUDA tensor is
    staged through the host (``stage_on_host=False`` hands it to gloo's own CUDA all-to-all instead, which copies
    inside the call: the benchmark uses it so a rank's compute measured between collectives holds no transport
    copies). Returns ``send`` itself on one rank.
    """
    if ctx.world_size == 1:
        return send
    if send.shape[0] != ctx.world_size:
        raise ValueError(f"all_to_all_equal needs one piece per rank along dim 0 (got {send.shape[0]}, world_size {ctx.world_size})")
    send = send.contiguous()
    if ctx.backend == "gloo" and send.device.type == "cuda" and stage_on_host is not False:
        out = torch.empty_like(send, device="cpu")
        dist.all_to_all_single(out, send.cpu(), group=ctx.group)
        return out.to(send.device)
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=ctx.group)
    return out


# --------------------------------------------------------------------------------------------------
# process groups: set-up, tear-down and the small collectives the runtime needs outside the adapters


def init_process_group(backend: str, *, store=None, rank: int, world_size: int, timeout) -> None:
    """Join the WORLD group (``timeout`` is a ``datetime.timedelta``; without ``store``, torchrun's environment
    variables say where to meet)."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def file_store(path: str, world_size: int):
    """A ``FileStore`` at ``path`` for ``world_size`` ranks: a rendezvous without ports (no free-port race)."""
    return dist.FileStore(path, world_size)


def tcp_store(host: str, port: int, world_size: int, *, is_master: bool, timeout, wait_for_workers: bool = True):
    """A ``TCPStore`` (several machines). The master passes ``port=0`` to let the OS pick one (read ``.port``),
    so no free-port race; ``timeout`` is a ``datetime.timedelta``."""
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, wait_for_workers=wait_for_workers)


def context_for_group(group=None, device: Optional[torch.device] = None) -> ParallelContext:
    """The :class:`ParallelContext` of ``group`` (default: WORLD) of an initialised ``torch.distributed``; a
    one-rank context when none is initialised."""
    if not is_initialized():
        return ParallelContext.single(device)
    group = group if group is not None else dist.group.WORLD
    return ParallelContext(
        group=group,
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
        global_ranks=tuple(dist.get_process_group_ranks(group)),
        device=torch.device(device or "cpu"),
        backend=str(dist.get_backend(group)),
    )


def nccl_available() -> bool:
    """Whether this PyTorch was built with NCCL (a process group on it can be created)."""
    return dist.is_available() and dist.is_nccl_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy_process_group() -> None:
    """Leave the WORLD group (and every group made from it); a no-op when none was joined."""
    if is_initialized():
        dist.destroy_process_group()


def barrier(ctx: ParallelContext) -> None:
    """Wait until every rank of ``ctx.group`` arrives; a no-op on one rank."""
    if ctx.world_size == 1:
        return
    if ctx.backend == "nccl" and ctx.device.type == "cuda":
        dist.barrier(group=ctx.group, device_ids=[ctx.device.index or 0])
    else:
        dist.barrier(group=ctx.group)


def bounded_barrier(ctx: ParallelContext, timeout_s: float) -> None:
    """A barrier that waits at most ``timeout_s`` seconds (then raises); a no-op on one rank.

    gloo: ``monitored_barrier``, whose error names the ranks that did not arrive. Other backends have no per-call
    bound: their barrier is bounded by the group's own timeout. Not counted by the interception layer (it is
    synchronisation around the measured work, e.g. ranks waiting while one rank runs a reference alone).
    """
    if ctx.world_size == 1:
        return
    if ctx.backend == "gloo":
        import datetime

        dist.monitored_barrier(group=ctx.group, timeout=datetime.timedelta(seconds=float(timeout_s)))
    else:
        barrier(ctx)


def new_group(ranks: Sequence[int]):
    """A subgroup of the WORLD ranks ``ranks`` (only its members need to call this)."""
    return dist.new_group(ranks=list(ranks), use_local_synchronization=True)


def all_gather_object(obj, ctx: ParallelContext) -> list:
    """Every rank's picklable ``obj``, in group-rank order; ``[obj]`` on one rank."""
    if ctx.world_size == 1:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def comm_error_types() -> tuple:
    """The exception types torch.distributed raises when a peer times out or the connection drops."""
    return tuple(t for t in (getattr(dist, "DistError", None),) if t is not None)


def uncounted_barrier(ctx: ParallelContext) -> None:
    """A barrier that bypasses the interception layer: no hook counts, throttles or times it.

    For the synchronisation a hook itself needs (the benchmark's turn-taking baton, which makes ranks compute
    one at a time between collectives): it is not the measured work's communication. A no-op on one rank.
    """
    if ctx.world_size == 1:
        return
    fn = unwrapped(dist.barrier)
    if ctx.backend == "nccl" and ctx.device.type == "cuda":
        fn(group=ctx.group, device_ids=[ctx.device.index or 0])
    else:
        fn(group=ctx.group)
