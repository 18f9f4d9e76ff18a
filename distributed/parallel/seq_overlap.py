"""Gathered K/V with the exchange in flight behind the local part of the attention (``overlapped`` mode).

A query's attention over all keys is the log-sum-exp merge of its attention over disjoint key sets (the identity
that FlashAttention's blockwise softmax and ring attention rest on): with ``o_s`` and ``l_s`` the output and the
log-sum-exp of the scores over key set ``s``, ``l = logsumexp_s l_s`` and ``o = sum_s exp(l_s - l) o_s``. So a
rank starts the all-gather of its K/V, computes its queries over its own keys (its text tokens included) while the
peers' K/V travel, then over each peer's share, and merges. It moves the same bytes as gathered mode in the same
one collective; on NCCL the gather runs on its own stream behind the local part, so a K/V gather that takes no
longer than the local part costs no time. Exact up to floating-point order (the merge runs in fp32).

``ring`` mode sends the same K/V point to point instead, one peer per stage (stage ``s``: to rank ``+s``, from rank
``-s``), every stage posted at once: the rank attends to its own keys while the first peer's K/V travel, then to each
peer's as the next one travels (the pipelining of ring attention, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"), so at N > 2 more than the own keys' part hides the transfers. The same bytes per rank, in
N - 1 messages.

The attention itself is PyTorch's fused attention with its log-sum-exp (cuDNN's or flash attention on CUDA for
fp16/bf16, memory-efficient attention for fp32 and on cards without flash attention, the fused CPU kernel on CPU; the
plain softmax product in bounded query chunks elsewhere), not the
model's own attention function, which returns no log-sum-exp: a model whose attention is not softmax(QK^T/sqrt(d))V
over its keys (a mask, another scale) is not routed here (:class:`~.seq_attention.SequenceAttention` keeps gathered
mode for such a call).
"""

from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence, Tuple

import torch

from ..comm import all_gather_start, ring_start
from ..context import ParallelContext

__all__ = ["attention_lse", "merge_parts", "overlapped_attention", "ring_attention"]


#: a bound on the fp32 score block the unfused fallback materialises at once (the queries go in chunks under it)
_MATH_BLOCK_BYTES = 256 * 2**20


def _math_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The unfused attention and log-sum-exp, in query chunks whose fp32 scores stay under ``_MATH_BLOCK_BYTES``
    (a whole ``[B, H, Lq, Lk]`` score matrix of a video model would not fit a card)."""
    b, h, lq, _ = q.shape
    per_query = max(1, b * h * k.shape[-2] * 4 * 2)  # the scores and their exponentials
    step = max(1, min(lq, _MATH_BLOCK_BYTES // per_query))
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for i in range(0, lq, step):
        s = torch.matmul(q[:, :, i:i + step].float(), kf.transpose(-1, -2)) * scale
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), vf).to(q.dtype))
        lses.append(lse)
        del s
    return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, dim=2), torch.cat(lses, dim=2))


def _cudnn(q, k, v, scale, lq):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return r[0], r[1].reshape(r[1].shape[0], r[1].shape[1], -1)[..., :lq].float()


def _flash(q, k, v, scale, lq):
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return r[0], r[1][..., :lq].float()


def _efficient(q, k, v, scale, lq):
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
    return r[0], r[1][..., :lq].float()  # memory-efficient attention pads the log-sum-exp's query dim


def _cpu(q, k, v, scale, lq):
    r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return r[0], r[1][..., :lq].float()


def _candidates(q: torch.Tensor, d: int) -> list:
    """The fused kernels to try for these inputs, fastest first (what PyTorch's SDPA would pick)."""
    if q.device.type == "cpu":
        return [_cpu]
    if q.device.type != "cuda":
        return []
    half = q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0
    kernels = []
    if half and d <= 128 and torch.backends.cuda.cudnn_sdp_enabled():
        kernels.append(_cudnn)  # cuDNN's fused attention: SDPA's pick on Hopper for these shapes (faster than FA2)
    if half and d <= 256:
        kernels.append(_flash)  # Ampere and newer
    kernels.append(_efficient)  # every CUDA card PyTorch supports, fp32 too
    return kernels


#: per (device, dtype, head dim), where in :func:`_candidates` to start: the first kernel that ever worked there, so a
#: kernel the card lacks (flash attention before Ampere) fails once, not at every call
_FIRST: dict = {}

_FATAL = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None)) if t)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` and the scores' log-sum-exp per query, for ``[B, H, L, D]`` tensors.

    Returns ``(out [B, H, Lq, D] in q's dtype, lse [B, H, Lq] fp32)``; ``scale`` defaults to ``1/sqrt(D)``. The
    fused kernels are tried fastest first, each in turn when the one before raises for these inputs (a kernel this
    build or card lacks is skipped from then on for the same device, dtype and head size), down to the unfused maths
    in bounded query chunks. Out-of-memory and device errors are raised, not retried on a larger path.
    """
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lq = q.shape[-2]
    key = (q.device.type, q.device.index, q.dtype, d)
    kernels = _candidates(q, d)
    for i in range(_FIRST.get(key, 0), len(kernels)):
        try:
            out = kernels[i](q, k, v, scale, lq)
        except _FATAL:
            raise
        except (RuntimeError, NotImplementedError):  # not for these inputs on this build or card: the next one
            continue
        _FIRST.setdefault(key, i)
        return out
    _FIRST.setdefault(key, len(kernels))  # none ever worked here: the unfused maths directly from now on
    return _math_lse(q, k, v, scale)


def _merge(outs: List[torch.Tensor], lses: List[torch.Tensor]) -> torch.Tensor:
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    acc = outs[0].float() * torch.exp(lses[0] - lse).unsqueeze(-1)
    for o, l in zip(outs[1:], lses[1:]):
        acc = acc + o.float() * torch.exp(l - lse).unsqueeze(-1)
    return acc.to(outs[0].dtype)


def compile_merge(backend: str = "inductor", dynamic: Optional[bool] = None):
    """The merge compiled: first for the shapes it meets (a sampling run keeps one), and, when a second size comes,
    once more with the changed dimensions symbolic (PyTorch's automatic dynamic shapes), which then serves every
    size: no recompile at each new resolution, and never the recompile limit (with ``fullgraph``, an error after
    eight static graphs). Compiling with every dimension symbolic from the start (``dynamic=True``) made the fused
    kernel about three times slower on an H200 (FLUX.1 at 1024x1024: 1.8 ms per step for the merges at 2 ranks,
    against 0.6 ms static; ``results/h200/dit/modulation``)."""
    if dynamic is None and os.environ.get("PATCHRAY_MERGE_DYNAMIC") == "1":  # the former setting, for comparisons
        dynamic = True
    return torch.compile(_merge, dynamic=dynamic, fullgraph=True, backend=backend)


#: the merge compiled per CUDA device (one fused kernel instead of 2N + 1 passes over the outputs); ``False`` after a
#: compile failure (the eager merge from then on)
_FUSED: dict = {}


def merge_parts(outs: List[torch.Tensor], lses: List[torch.Tensor]) -> torch.Tensor:
    """The attention over the union of the key sets from each set's ``(out [B, H, L, D], lse [B, H, L])``, in the
    outputs' dtype (weights and sums in fp32). On CUDA the merge is compiled (Inductor fuses it into one pass);
    elsewhere, or when compiling fails, it runs eagerly (the same arithmetic)."""
    if len(outs) == 1:
        return outs[0]
    dev = outs[0].device
    if dev.type == "cuda" and _FUSED.get(dev.index) is not False:
        try:
            fused = _FUSED.get(dev.index)
            if fused is None:
                fused = _FUSED[dev.index] = compile_merge()
            return fused(outs, lses)
        except Exception:  # noqa: BLE001 - any compiler failure: the eager merge is the same arithmetic
            _FUSED[dev.index] = False
    return _merge(outs, lses)


def overlapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared: torch.Tensor, ctx: ParallelContext,
                         sizes: Sequence[int], scale: Optional[float] = None) -> torch.Tensor:
    """The local queries' attention over every rank's keys, the K/V gather overlapped with the local part.

    Args:
        q, k, v: this rank's queries, keys and values, ``[B, L, H, D]`` (keys and values: every token of the
            rank's local sequence, replicated text included).
        shared: the part of the rank's K and V its peers need, packed ``[B, n_me, 2, H, D]`` (its image band, and
            its text slice when the text is sharded), ``n_me == sizes[rank]``.
        ctx: the sequence group.
        sizes: every rank's shared token count (the shard table's, known to all ranks).
        scale: the score scale (``None``: ``1/sqrt(D)``).

    Returns the output ``[B, L, H, D]`` in q's dtype.
    """
    me = ctx.rank
    biggest = max(sizes)
    if shared.shape[1] < biggest:  # equal extents for transport; the padding is never read
        pad = shared.new_zeros((shared.shape[0], biggest - shared.shape[1]) + tuple(shared.shape[2:]))
        shared = torch.cat([shared, pad], dim=1)
    gathered, work = all_gather_start(shared, ctx)  # [N, B, n_max, 2, H, D]
    qt = q.transpose(1, 2)
    o, l = attention_lse(qt, k.transpose(1, 2), v.transpose(1, 2), scale)  # the local keys, while the gather runs
    outs, lses = [o], [l]
    if work is not None:
        work.wait()
    for s, n in enumerate(sizes):
        if s == me or n == 0:
            continue
        piece = gathered[s, :, :n]
        o, l = attention_lse(qt, piece[:, :, 0].transpose(1, 2), piece[:, :, 1].transpose(1, 2), scale)
        outs.append(o)
        lses.append(l)
    return merge_parts(outs, lses).transpose(1, 2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared: torch.Tensor, ctx: ParallelContext,
                   sizes: Sequence[int], scale: Optional[float] = None) -> torch.Tensor:
    """:func:`overlapped_attention` with the K/V sent point to point, one peer per stage, each peer's part attended
    to while the next peer's K/V travel (same arguments and result)."""
    biggest = max(sizes)
    if shared.shape[1] < biggest:
        pad = shared.new_zeros((shared.shape[0], biggest - shared.shape[1]) + tuple(shared.shape[2:]))
        shared = torch.cat([shared, pad], dim=1)
    stages = ring_start(shared, ctx)  # [(source rank, get)], posted at once
    qt = q.transpose(1, 2)
    o, l = attention_lse(qt, k.transpose(1, 2), v.transpose(1, 2), scale)  # the local keys, while stage 1 travels
    outs, lses = [o], [l]
    for src, get in stages:
        piece = get()[:, : sizes[src]]
        if sizes[src] == 0:
            continue
        o, l = attention_lse(qt, piece[:, :, 0].transpose(1, 2), piece[:, :, 1].transpose(1, 2), scale)
        outs.append(o)
        lses.append(l)
    return merge_parts(outs, lses).transpose(1, 2)
