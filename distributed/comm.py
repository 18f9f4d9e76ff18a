"""Communication: the few collectives PatchRay uses, the process-group plumbing, and one interception layer.

Design decisions:

* **One place talks to torch.distributed.** Adapters, the runtime and the benchmark call the helpers here
  (``all_reduce``, ``all_gather_padded``, ``exchange_halo``, ``gather_to``, ``barrier``, ...), never ``dist.*``
  directly, so the gloo host-staging rule, padding for transport and one-rank short cuts live in one file. A
  structure test (tests/distributed/test_structure.py) keeps every other module off ``torch.distributed``.
* **Halo sizes come from shared data, never from a metadata collective.** Every caller passes the
  per-rank sizes it derived from global shapes, so a halo exchange is one ``batch_isend_irecv``.
* **gloo cannot send CUDA tensors point-to-point** ('writev: Bad address', measured on an H200), so under
  gloo a CUDA tensor is staged through host memory for send/recv; collectives run on CUDA tensors as is.
* **One interception layer.** Counting (:func:`log_comm`), the benchmark's link throttle and its timer of
  communication are *hooks* on one patcher (:func:`intercept`): while at least one hook is installed, the public
  ``torch.distributed`` operations in :data:`COUNTED_OPS` are replaced by one wrapper that hands each call, as a
  :class:`CommCall`, through the hooks (the first installed runs innermost, next to the real call); when none
  is installed nothing is wrapped, so interception costs nothing when off. A call made from inside PyTorch's
  ``distributed_c10d`` module (the sends inside ``batch_isend_irecv``, the tensor collectives inside
  ``all_gather_object``) is marked *batched*: counting adds its tensor bytes but not a call, and the throttle
  and the timer leave it to the top-level call that contains it. The records themselves (:class:`CommLog`,
  :class:`CommCall`) are plain data in :mod:`.accounting`; the counting rules are written down in
  ``docs/benchmark.md``.
* **Why not ``torch.distributed.tensor.debug.CommDebugMode``.** It was tried (torch 2.13, two gloo ranks): it
  is a ``TorchDispatchMode``, so it sees ``c10d.allreduce_``, ``c10d.allgather_`` and ``c10d.gather_`` at the
  dispatcher, but not ``batch_isend_irecv``'s sends and receives nor ``barrier``, and it cannot tell the user's
  ``all_gather`` from the ones ``all_gather_object`` makes inside (it counted three where the rules count one
  call and two batched). Every aten operation would also pass through Python while it is on, which would bill
  the timed compute for the dispatch. The counting rules need the public API call and its caller, so the
  layer wraps the public functions.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .accounting import _C10D_MODULE, COUNTED_OPS, CommCall, CommHook, CommLog, tensor_bytes
from .context import ParallelContext

__all__ = [
    "COUNTED_OPS",
    "CommLog",
    "CommCall",
    "CommHook",
    "intercept",
    "log_comm",
    "bounded_barrier",
    "all_gather_into",
    "context_for_group",
    "all_reduce",
    "all_gather_padded",
    "exchange_halo",
    "gather_to",
    "broadcast",
    "Halo",
    "tensor_bytes",
    "exchange_pieces",
    "all_to_all_equal",
    "REDUCE_OPS",
    "init_process_group",
    "file_store",
    "tcp_store",
    "is_initialized",
    "nccl_available",
    "destroy_process_group",
    "barrier",
    "new_group",
    "all_gather_object",
    "comm_error_types",
    "uncounted_barrier",
    "ShardTally",
    "fully_shard",
    "is_sharded",
    "base_class",
    "set_forward_prefetch",
    "local_shard",
]

_hooks: List[CommHook] = []
_patch_lock = threading.Lock()
_originals: Dict[str, object] = {}


def _make_wrapper(op: str, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        call = CommCall(op, args, kwargs, caller == _C10D_MODULE)
        proceed = functools.partial(original, *args, **kwargs)
        for hook in tuple(_hooks):  # the first installed is innermost
            proceed = functools.partial(hook, call, proceed)
        return proceed()

    wrapper.__patchray_wrapped__ = original
    return wrapper


def _install():
    import torch.distributed.distributed_c10d as c10d

    for op in COUNTED_OPS:
        original = getattr(c10d, op)
        _originals[op] = original
        wrapped = _make_wrapper(op, original)
        setattr(c10d, op, wrapped)
        setattr(dist, op, wrapped)


def _uninstall():
    import torch.distributed.distributed_c10d as c10d

    for op, original in _originals.items():
        setattr(c10d, op, original)
        setattr(dist, op, original)
    _originals.clear()


@contextlib.contextmanager
def intercept(hook: CommHook) -> Iterator[None]:
    """Pass every call of :data:`COUNTED_OPS` made in this process through ``hook`` while the block runs.

    Hooks nest: one installed inside another's block runs outside it (it sees the inner hook's effect, e.g. a
    timer installed after the throttle bills the throttle's sleep to communication).
    """
    with _patch_lock:
        if not _hooks:
            _install()
        _hooks.append(hook)
    try:
        yield
    finally:
        with _patch_lock:
            _hooks.remove(hook)
            if not _hooks:
                _uninstall()


@contextlib.contextmanager
def log_comm() -> Iterator[CommLog]:
    """Count ``torch.distributed`` calls and bytes made inside the block (this process only).

    Example:
        >>> with log_comm() as log:
        ...     pass  # run one decode
        >>> log.total_calls
        0
    """
    log = CommLog()

    def count(call: CommCall, proceed):
        log.record(call.op, call.nbytes, call.batched)
        return proceed()

    with intercept(count):
        yield log


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
    bufs = [torch.empty_like(send) for _ in range(ctx.world_size)]
    dist.all_gather(bufs, send, group=ctx.group)
    return torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)], dim=dim)


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


class Halo(NamedTuple):
    """Rows received from the previous (``before``) and next (``after``) rank; ``None`` at the image edge."""

    before: Optional[torch.Tensor]
    after: Optional[torch.Tensor]


def exchange_halo(
    x: torch.Tensor,
    ctx: ParallelContext,
    dim: int,
    halos: Sequence[Sequence[int]],
    buffers: Optional[Dict[tuple, torch.Tensor]] = None,
) -> Halo:
    """Swap boundary slices with the neighbouring ranks along ``dim`` in one batched point-to-point.

    Args:
        x: this rank's band.
        ctx: the parallel context.
        dim: the sharded dimension (rows).
        halos: ``halos[r] == (before_r, after_r)``: how many slices rank r needs from rank r-1 and r+1.
            Every rank passes the same table (derived from global shapes), so no sizes travel.
        buffers: a caller-owned dict in which receive buffers are kept and reused by
            ``(side, shape, dtype, device)``. Only for callers that consume the halo before their next
            exchange of the same shape (a row-sharded convolution does); callers that keep halos across
            calls (stale halos in displaced sampling) must leave it ``None``.

    Returns:
        :class:`Halo` with the received slices (``None`` where nothing is needed or at the edge).
    """
    if ctx.world_size == 1:
        return Halo(None, None)
    r, n = ctx.rank, ctx.world_size
    need_before, need_after = halos[r]
    # what my neighbours need from me
    give_prev = halos[r - 1][1] if r > 0 else 0  # rank r-1 needs `after` slices: my first ones
    give_next = halos[r + 1][0] if r < n - 1 else 0  # rank r+1 needs `before` slices: my last ones
    extent = x.shape[dim]
    if max(give_prev, give_next) > extent:
        # backstop, not the guard: callers refuse thin bands from shared shapes before any rank gets here
        raise ValueError(f"rank {r} holds {extent} slices along dim {dim} but a neighbour needs {max(give_prev, give_next)}")

    stage = ctx.stages_p2p_through_host
    host = torch.device("cpu")

    def _send_buf(t):
        if not stage:
            return t.contiguous()
        # page-locked staging (PyTorch's caching host allocator: reused after the first call): a copy into
        # freshly allocated pageable memory ran at about 1 GB/s on an H200 host and was billed to the rank's
        # compute, as was the copy back; pinned copies run at the link's speed
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t)
        return buf

    def _recv_buf(count, side):
        shape = list(x.shape)
        shape[dim] = count
        device = host if stage else x.device
        if buffers is None:
            return torch.empty(shape, dtype=x.dtype, device=device, pin_memory=stage)
        key = (side, tuple(shape), x.dtype, device)
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = torch.empty(shape, dtype=x.dtype, device=device, pin_memory=stage)
        return buf

    ops = []
    recv_before = recv_after = None
    g = ctx.global_ranks or tuple(range(n))
    if r > 0 and need_before:
        recv_before = _recv_buf(need_before, "before")
        ops.append(dist.P2POp(dist.irecv, recv_before, g[r - 1], ctx.group))
    if r < n - 1 and need_after:
        recv_after = _recv_buf(need_after, "after")
        ops.append(dist.P2POp(dist.irecv, recv_after, g[r + 1], ctx.group))
    if r > 0 and give_prev:
        ops.append(dist.P2POp(dist.isend, _send_buf(x.narrow(dim, 0, give_prev)), g[r - 1], ctx.group))
    if r < n - 1 and give_next:
        ops.append(dist.P2POp(dist.isend, _send_buf(x.narrow(dim, extent - give_next, give_next)), g[r + 1], ctx.group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if stage:
        recv_before = recv_before.to(x.device) if recv_before is not None else None
        recv_after = recv_after.to(x.device) if recv_after is not None else None
    return Halo(recv_before, recv_after)


def exchange_pieces(
    ctx: ParallelContext,
    sends: Dict[int, List[torch.Tensor]],
    recv_shapes: Dict[int, List[torch.Size]],
    dtype: torch.dtype,
    device: torch.device,
) -> Dict[int, List[torch.Tensor]]:
    """Send tensors to any peers and receive from any peers in one ``batch_isend_irecv``.

    The general sibling of :func:`exchange_halo` (which only talks to the previous and next rank): a
    tile's neighbour can belong to any rank. To each peer, its pieces travel flattened into one buffer;
    the receiver knows the shapes from shared geometry (``recv_shapes``), so no sizes travel.

    Args:
        ctx: the parallel context.
        sends: ``{peer: [tensor, ...]}`` (group ranks).
        recv_shapes: ``{peer: [shape, ...]}``: what each peer sends this rank, in order.
        dtype, device: of the received tensors.

    Returns:
        ``{peer: [tensor, ...]}`` with the received pieces in ``recv_shapes`` order.
    """
    stage = ctx.stages_p2p_through_host
    host = torch.device("cpu")
    g = ctx.global_ranks or tuple(range(ctx.world_size))
    ops, recv_bufs = [], {}
    for peer in sorted(recv_shapes):
        numel = sum(int(torch.Size(s).numel()) for s in recv_shapes[peer])
        buf = torch.empty(numel, dtype=dtype, device=host if stage else device)
        recv_bufs[peer] = buf
        ops.append(dist.P2POp(dist.irecv, buf, g[peer], ctx.group))
    for peer in sorted(sends):
        flat = torch.cat([p.reshape(-1) for p in sends[peer]])
        ops.append(dist.P2POp(dist.isend, flat.to(host) if stage else flat, g[peer], ctx.group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    received = {}
    for peer, buf in recv_bufs.items():
        buf = buf.to(device) if stage else buf
        pieces, offset = [], 0
        for shape in recv_shapes[peer]:
            n = int(torch.Size(shape).numel())
            pieces.append(buf[offset : offset + n].view(shape))
            offset += n
        received[peer] = pieces
    return received


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
    fn = getattr(dist.barrier, "__patchray_wrapped__", dist.barrier)
    if ctx.backend == "nccl" and ctx.device.type == "cuda":
        fn(group=ctx.group, device_ids=[ctx.device.index or 0])
    else:
        fn(group=ctx.group)


# --------------------------------------------------------------------------------------------------
# weight sharding: thin wrappers over PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``)


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


def fully_shard(module: torch.nn.Module, ctx: ParallelContext, tally: ShardTally, *, offload: bool = False) -> torch.nn.Module:
    """Shard ``module``'s parameters over ``ctx``'s ranks with FSDP2 (dim-0 shards; gathered before its forward and
    freed after it); ``offload`` keeps the shards in host memory (FSDP2's ``CPUOffloadPolicy``, unpinned).

    No dtype cast is asked for (no ``MixedPrecisionPolicy`` dtype): every parameter keeps its own dtype in memory
    and on the wire. Returns ``module`` (its class becomes FSDP2's subclass of the original; see :func:`base_class`).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as _fully_shard

    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    _fully_shard(module, mesh=_mesh(ctx), reshard_after_forward=True, offload_policy=policy)
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
