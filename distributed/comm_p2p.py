"""Point-to-point exchanges: a band's halo rows with its neighbours, any pieces with any peers, and the ring's
stages (each rank's tensor to every other rank one peer at a time, so a caller computes on one peer's part while the
next travels). A sibling of :mod:`.comm`, reached only through it (it re-exports these names).

gloo cannot send CUDA tensors point-to-point ('writev: Bad address', measured on an H200), so under gloo a CUDA
tensor is staged through host memory for send/recv.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .context import ParallelContext

__all__ = ["Halo", "exchange_halo", "exchange_pieces", "ring_start"]


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


def ring_start(send: torch.Tensor, ctx: ParallelContext) -> List[Tuple[int, Callable[[], torch.Tensor]]]:
    """Start the ``N - 1`` stages of a ring exchange of ``send`` (the same shape on every rank).

    At stage ``s`` (1 .. N-1) this rank sends ``send`` to rank ``(rank + s) % N`` and receives rank
    ``(rank - s) % N``'s. Returns ``[(source rank, get)]`` in stage order; ``get()`` waits for that stage and returns
    the received tensor. Every stage is posted at once, one ``batch_isend_irecv`` each: NCCL runs them in order on
    its own stream, so a caller that computes on stage ``s``'s tensor while stage ``s + 1`` travels hides the
    transfer; gloo runs CPU tensors' stages in the background. Under gloo a CUDA tensor is staged through the host,
    each stage blocking in its ``get()`` (every rank calls them in stage order, so the pairs match).
    """
    n, me = ctx.world_size, ctx.rank
    g = ctx.global_ranks or tuple(range(n))
    send = send.contiguous()
    stages = []
    if ctx.stages_p2p_through_host:
        host = send.cpu()

        def staged(src, dst):
            def get():
                buf = torch.empty_like(host)
                for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, g[src], ctx.group),
                                                   dist.P2POp(dist.isend, host, g[dst], ctx.group)]):
                    req.wait()
                return buf.to(send.device)
            return get

        return [((me - s) % n, staged((me - s) % n, (me + s) % n)) for s in range(1, n)]
    for s in range(1, n):
        src, dst = (me - s) % n, (me + s) % n
        buf = torch.empty_like(send)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, g[src], ctx.group),
                                       dist.P2POp(dist.isend, send, g[dst], ctx.group)])

        def get(buf=buf, reqs=reqs):
            for req in reqs:
                req.wait()
            return buf

        stages.append((src, get))
    return stages
