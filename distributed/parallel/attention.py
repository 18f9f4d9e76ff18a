"""Gathered attention: each rank's queries attend to the keys and values of the whole image.

Design decisions:

* **Local queries, gathered K/V.** Each rank projects only its own tokens; keys and values are gathered with one
  ``all_gather`` each (``comm.all_gather_padded``, extents from the band table) and the rank's queries attend to
  all of them. Softmax over keys does not depend on the keys' order, so the gathered order (rank by rank) needs
  no reordering; frame-causal video attention puts the gathered keys in frame order once and lets each
  frame's queries attend to the frames up to their own (no ``[L_q, L_k]`` mask is built).
* **One adapter class per attention layer type**: diffusers ``Attention`` (KL/Flux.2 mid-block, HunyuanVideo's
  frame-causal mid-block, and the UNet's self-attention, whose ComfyUI counterpart ``CrossAttention`` has the same
  projections), Wan/Qwen-Image's per-frame ``*AttentionBlock`` and HunyuanVideo-1.5's frame-causal
  ``AttnBlock``. Each reuses the module's projections by reference and refuses configurations it does not
  reproduce exactly (cross-attention, spatial norm, q/k norms, a non-default processor).
* **The K/V mode is a strategy.** :class:`GatheredAttention` with ``kv=None`` (row mode) recomputes the
  processor's math with chunked queries (the VAE memory target). With a :class:`~.exchange.PeerExchange`
  (stepwise sampling: exact, stale or displaced K/V) the module's own attention code runs, whatever kernel or
  patches a host application gives it: output hooks on ``to_k``/``to_v`` replace the band's K/V by the
  strategy's full K/V during self-attention calls (a call without a context), so it becomes local-query
  attention over the whole image. Token (sequence) shards of a DiT use the same strategies through
  ``sequence.SequenceAttention`` (a DiT's attention applies RoPE and q/k norms after the projections, so the K/V are
  completed at the attention call, not at ``to_k``/``to_v``); compressed residuals will be further strategies, not
  further adapters.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_gather_padded
from .exchange import PeerExchange, StepState
from .plan import Applied, RowState, Style, replace_forward

__all__ = [
    "GatheredAttention",
    "RecordVideoLayout",
    "GatheredFrameAttention",
    "GatheredCausalAttnBlock",
    "GatheredAttnBlock",
    "GatheredCosmosAttention",
    "frame_causal_attention",
    "chunked_attention",
]


def _token_sizes(state: RowState, local_rows: int, per_row: int, frames: int = 1) -> list:
    b = state.bounds_at(local_rows)
    return [frames * (b[i + 1] - b[i]) * per_row for i in range(len(b) - 1)]


def _gather_kv(key: torch.Tensor, value: torch.Tensor, ctx, dim: int, sizes: Sequence[int]):
    """Every rank's keys and values along ``dim`` in ONE all-gather: K and V travel side by side in the last dim.

    One collective instead of two (half the messages); the bytes are the same. On one rank: ``(key, value)``.
    """
    if ctx.world_size == 1:
        return key, value
    width = key.shape[-1]
    both = all_gather_padded(torch.cat([key, value], dim=-1), ctx, dim, sizes)
    return both[..., :width], both[..., width:]


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``scaled_dot_product_attention`` runs a fused CUDA kernel (flash or memory-efficient) on these
    inputs, i.e. holds no score matrix. Decided from the inputs' shapes and dtypes (the same on every rank)."""
    if query.device.type != "cuda":
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        try:
            params = SDPAParams(query, key, value, None, 0.0, False, False)
        except TypeError:  # builds before grouped-query attention took one argument fewer
            params = SDPAParams(query, key, value, None, 0.0, False)
        return bool(can_use_flash_attention(params, False) or can_use_efficient_attention(params, False))
    except Exception:  # an API this build lacks: chunk, the choice that is safe for memory
        return False


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: int) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the queries in ``chunks`` pieces (each query row is independent).

    With K/V gathered from N ranks, one call would hold an ``L_local x N * L_local`` score matrix where a kernel
    falls back to the math path (head dims above the fused kernels' limit, as in the VAEs' single-head
    attention): N times what a band decode holds. N query chunks keep it at the band's ``L_local^2``. A fused
    kernel holds no score matrix, so there the band's queries go in one call: a fused kernel's grid is one block
    per query tile, and ``L / N^2`` queries per call would leave most of a GPU idle (64 blocks on an H200's 132
    multiprocessors for the kl mid-block at 2048x2048 and N = 4).
    """
    if chunks <= 1 or query.shape[-2] < 2 * chunks or _fused_attention(query, key, value):
        return F.scaled_dot_product_attention(query, key, value)
    step = -(-query.shape[-2] // chunks)
    return torch.cat([F.scaled_dot_product_attention(q, key, value) for q in query.split(step, dim=-2)], dim=-2)


def frame_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, frames: int, token_sizes: Sequence[int]
) -> torch.Tensor:
    """Frame-causal attention of local queries over gathered keys: a query of frame t sees keys of frames <= t.

    Args:
        query: ``[B, heads, T * n_local, d]``, this rank's tokens in ``(frame, row, column)`` order.
        key, value: ``[B, heads, sum(token_sizes), d]``, every rank's tokens rank after rank, each in that order.
        frames: ``T``.
        token_sizes: tokens per rank (``T * rows_r * W``).

    Rather than a ``[L_q, L_k]`` mask (as large as the band's activations at video sizes), keys are put in frame
    order once and each frame's queries attend to the prefix of frames ``<= t``: the same softmax, no mask.
    """
    b, h, _, d = key.shape

    def frame_major(t):
        parts = [p.unflatten(2, (frames, -1)) for p in t.split(list(token_sizes), dim=2)]
        return torch.cat(parts, dim=3)  # [B, heads, T, H*W, d]

    key, value = frame_major(key), frame_major(value)
    query = query.unflatten(2, (frames, -1))
    out = []
    for t in range(frames):
        seen = slice(0, t + 1)
        keys, values = key[:, :, seen].flatten(2, 3), value[:, :, seen].flatten(2, 3)
        out.append(F.scaled_dot_product_attention(query[:, :, t], keys, values))
    return torch.stack(out, dim=2).flatten(2, 3)


@dataclasses.dataclass(frozen=True)
class RecordVideoLayout(Style):
    """A container that flattens ``[B, C, T, h, W]`` into tokens before its attention: record ``(T, h, W)``.

    Registered as a named forward pre-hook (the math does not change); the frame-causal attention reads it.
    """

    def _apply(self, module, path, state):
        def hook(mod, args):
            x = args[0]
            if x.dim() == 5:
                state.video_layout = tuple(x.shape[2:])

        handle = module.register_forward_pre_hook(hook)
        return Applied(handle.remove)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatheredAttention(Style):
    """Self-attention of a band's (or token shard's) queries over the keys and values of every rank.

    Args:
        kv: ``None`` (row mode): diffusers ``Attention`` as its ``AttnProcessor2_0`` computes it, K/V gathered
            from every rank in one all-gather each, queries chunked. A :class:`~.exchange.PeerExchange`
            (stepwise sampling): any module with ``to_q``/``to_k``/``to_v``/``to_out`` (diffusers ``Attention``,
            ComfyUI ``CrossAttention``) keeps its own forward; its K/V come from the strategy on
            self-attention calls, cross-attention calls run unchanged.
        frame_causal: (row mode) the caller passes HunyuanVideo's frame-causal mask over ``(T, h, W)`` tokens;
            the adapter rebuilds it for local queries and gathered keys (layout from :class:`RecordVideoLayout`).
    """

    kv: Optional[PeerExchange] = None
    frame_causal: bool = False

    def _apply(self, module, path, state):
        if self.kv is not None:
            return _apply_kv_hooks(module, path, state, self.kv)
        return self._apply_row(module, path, state)

    def _apply_row(self, module, path, state):
        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

        processor = getattr(module, "processor", None)
        if not isinstance(processor, (AttnProcessor, AttnProcessor2_0)):
            name = type(processor).__name__
            raise NotImplementedError(f"{path}: attention processor {name} is not supported in row mode")
        for attr in ("spatial_norm", "norm_q", "norm_k", "norm_cross"):
            if getattr(module, attr, None):
                raise NotImplementedError(f"{path}: Attention with {attr} is not supported in row mode")
        attn, frame_causal, ctx = module, self.frame_causal, state.ctx

        def forward(hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
            if encoder_hidden_states is not None:
                raise NotImplementedError(f"{path}: cross-attention is not supported in row mode")
            residual = hidden_states
            if hidden_states.dim() == 4:
                batch, channel, height, width = hidden_states.shape
                frames, rows, per_row = 1, height, width
                hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
            else:
                if not frame_causal or state.video_layout is None:
                    raise NotImplementedError(f"{path}: token-shaped input without a recorded video layout")
                frames, rows, per_row = state.video_layout
                batch = hidden_states.shape[0]
                if frames * rows * per_row != hidden_states.shape[1]:
                    # backstop, not the guard: the layout hook saw this very tensor
                    raise RuntimeError(f"{path}: {hidden_states.shape[1]} tokens do not match {state.video_layout}")
            if attention_mask is not None and not frame_causal:
                raise NotImplementedError(f"{path}: an attention mask is only supported for frame-causal attention")
            if attn.group_norm is not None:
                hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
            query = attn.to_q(hidden_states)
            sizes = _token_sizes(state, rows, per_row, frames)
            key, value = _gather_kv(attn.to_k(hidden_states), attn.to_v(hidden_states), ctx, 1, sizes)
            head_dim = key.shape[-1] // attn.heads
            query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
            key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
            value = value.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
            if frame_causal and attention_mask is not None:
                out = frame_causal_attention(query, key, value, frames, sizes)
            else:
                out = chunked_attention(query, key, value, ctx.world_size)
            out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
            out = attn.to_out[1](attn.to_out[0](out))
            if residual.dim() == 4:
                out = out.transpose(-1, -2).reshape(residual.shape)
            if attn.residual_connection:
                out = out + residual
            return out / attn.rescale_output_factor

        return Applied(replace_forward(module, path, lambda prior: forward))


@dataclasses.dataclass(frozen=True)
class GatheredFrameAttention(Style):
    """Wan / Qwen-Image ``*AttentionBlock``: single-head attention within each frame, K/V gathered over rows."""

    def _apply(self, module, path, state):
        ctx = state.ctx

        def forward(x):
            identity = x
            batch, channels, time, height, width = x.size()
            x = x.permute(0, 2, 1, 3, 4).reshape(batch * time, channels, height, width)
            x = module.norm(x)
            qkv = module.to_qkv(x)
            qkv = qkv.reshape(batch * time, 1, channels * 3, -1).permute(0, 1, 3, 2).contiguous()
            q, k, v = qkv.chunk(3, dim=-1)
            sizes = _token_sizes(state, height, width)
            k, v = _gather_kv(k, v, ctx, 2, sizes)
            x = chunked_attention(q, k, v, ctx.world_size)
            x = x.squeeze(1).permute(0, 2, 1).reshape(batch * time, channels, height, width)
            x = module.proj(x)
            x = x.view(batch, time, channels, height, width).permute(0, 2, 1, 3, 4)
            return x + identity

        return Applied(replace_forward(module, path, lambda prior: forward))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatheredAttnBlock(Style):
    """A single-head attention block with 1x1-conv projections (``norm``, ``to_q``/``to_k``/``to_v``, then ``proj``
    or ``proj_out``, plus the residual): every token of the band attends to the tokens of the whole image, K/V
    gathered. Covers HunyuanImage's ``AttentionBlock`` (2-D), HunyuanImage-refiner's ``AttnBlock`` (3-D, over all
    ``(T, h, W)`` tokens) and, with ``frame_causal``, HunyuanVideo-1.5's ``AttnBlock``.

    Args:
        frame_causal: a query of frame ``t`` attends to the keys of frames ``<= t`` only (5-D inputs).
    """

    frame_causal: bool = False

    def _apply(self, module, path, state):
        proj = getattr(module, "proj_out", None) or getattr(module, "proj", None)
        for part, layer in (("to_q", module.to_q), ("to_k", module.to_k), ("to_v", module.to_v), ("proj", proj)):
            if not isinstance(layer, (nn.Conv2d, nn.Conv3d)) or any(k != 1 for k in layer.kernel_size):
                raise NotImplementedError(f"{path}.{part}: row mode expects a 1x1 convolution projection")
        ctx, frame_causal = state.ctx, self.frame_causal

        def tokens(t):
            b, c = t.shape[:2]
            return t.reshape(b, c, -1).permute(0, 2, 1).unsqueeze(1).contiguous()

        def forward(x):
            identity = x
            x = module.norm(x)
            query, key, value = module.to_q(x), module.to_k(x), module.to_v(x)
            batch, channels = query.shape[:2]
            frames = query.shape[2] if query.dim() == 5 else 1
            height, width = query.shape[-2:]
            sizes = _token_sizes(state, height, width, frames)
            key, value = _gather_kv(tokens(key), tokens(value), ctx, 2, sizes)
            if frame_causal and query.dim() == 5:
                out = frame_causal_attention(tokens(query), key, value, frames, sizes)
            else:  # softmax over keys does not depend on their (gathered, rank-by-rank) order
                out = chunked_attention(tokens(query), key, value, ctx.world_size)
            out = out.squeeze(1).reshape(batch, *query.shape[2:], channels).movedim(-1, 1)
            return proj(out) + identity

        return Applied(replace_forward(module, path, lambda prior: forward))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatheredCausalAttnBlock(GatheredAttnBlock):
    """HunyuanVideo-1.5 ``AttnBlock``: frame-causal attention over all ``(T, h, W)`` tokens, K/V gathered."""

    frame_causal: bool = True


_ATTENTION_PARTS = ("to_q", "to_k", "to_v", "to_out")
_CONTEXT_KWARGS = ("encoder_hidden_states", "context")


def _apply_kv_hooks(module: nn.Module, path: str, state: StepState, kv: PeerExchange) -> Applied:
    """:class:`GatheredAttention` in stepwise sampling: hooks on ``to_k``/``to_v``, armed during self-attention."""
    for part in _ATTENTION_PARTS:
        if not isinstance(getattr(module, part, None), nn.Module):
            raise NotImplementedError(f"{path}: {type(module).__name__} has no {part} module; not a supported attention")
    armed = [False]

    def full(local: torch.Tensor, which: str) -> Optional[torch.Tensor]:
        if not armed[0]:
            return None
        if local.dim() != 3:
            # backstop, not the guard: both attention families project (B, L, C) token tensors
            raise NotImplementedError(f"{path}.to_{which}: expected (batch, tokens, dim), got {tuple(local.shape)}")
        return kv.full_kv(local, f"{path}.{which}", state)

    def build(prior):
        def forward(*args, **kwargs):
            context = args[1] if len(args) > 1 else None
            for name in _CONTEXT_KWARGS:
                if kwargs.get(name) is not None:
                    context = kwargs[name]
            armed[0] = context is None and kwargs.get("value") is None and state.exchanging
            try:
                return prior(*args, **kwargs)
            finally:
                armed[0] = False

        return forward

    handles = [
        module.to_k.register_forward_hook(lambda m, i, o: full(o, "k")),
        module.to_v.register_forward_hook(lambda m, i, o: full(o, "v")),
    ]
    try:
        undo_forward = replace_forward(module, path, build)
    except BaseException:
        for h in handles:
            h.remove()
        raise

    def undo():
        for h in handles:
            h.remove()
        undo_forward()

    return Applied(undo)


@dataclasses.dataclass(frozen=True)
class GatheredCosmosAttention(Style):
    """``CosmosCausalAttention``: with the spatial processor, multi-head attention within each frame over all of its
    rows (K/V gathered); with the temporal processor, attention over the frames of one pixel, which is row-local
    (the module is left as it is). Any other processor is refused by name."""

    def _apply(self, module, path, state):
        kind = type(module.processor).__name__
        if kind == "CosmosTemporalAttentionProcessor2_0":
            return Applied()
        if kind != "CosmosSpatialAttentionProcessor2_0":
            raise NotImplementedError(f"{path}: CosmosCausalAttention with processor {kind} is not supported in row mode")
        ctx = state.ctx

        def forward(hidden_states, attention_mask=None):
            if attention_mask is not None:
                raise NotImplementedError(f"{path}: a spatial attention mask is not supported in row mode")
            batch, _, frames, height, width = hidden_states.shape
            residual = hidden_states
            hidden_states = module.norm(hidden_states)
            heads = module.num_attention_heads

            def tokens(t):  # [B, C, T, h, W] -> [B * T, heads, h * W, C // heads]
                t = t.permute(0, 2, 3, 4, 1).flatten(2, 3).flatten(0, 1)
                return t.unflatten(2, (heads, -1)).transpose(1, 2)

            query = tokens(module.to_q(hidden_states))
            key, value = tokens(module.to_k(hidden_states)), tokens(module.to_v(hidden_states))
            key, value = _gather_kv(key.contiguous(), value.contiguous(), ctx, 2, _token_sizes(state, height, width))
            out = chunked_attention(query, key, value, ctx.world_size)
            out = out.transpose(1, 2).flatten(2, 3).type_as(query)
            out = out.unflatten(1, (height, width)).unflatten(0, (batch, frames)).permute(0, 4, 1, 2, 3)
            out = module.to_out[1](module.to_out[0](out))
            return out + residual

        return Applied(replace_forward(module, path, lambda prior: forward))
