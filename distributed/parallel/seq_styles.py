"""Styles that make a host model's DiT sequence-parallel: shard its token sequence and positional embedding, route
its attention to :class:`~.seq_attention.SequenceAttention`, and gather its output tokens. Plans of these styles are
data (``sampling/dit.py``'s family table); ``parallel.plan.apply_plan`` applies them and every one comes off again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .exchange import EXACT, PeerExchange
from .plan import Applied, Style, replace_forward
from .seq_attention import SequenceAttention
from .seq_route import DISPATCH_NAME, reroute_processor
from .tokens import gather_tokens, shard_tokens

__all__ = ["ShardTokens", "ShardGridRows", "GatherTokens", "SequenceAttentionStyle"]


# --------------------------------------------------------------------------------------------------
# styles for a host model (diffusers' DiT classes): shard inputs, shard positions, gather outputs, attention


def _map_items(out: Any, items: Optional[Tuple[int, ...]], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(fn(o) if (items is None or i in items) and isinstance(o, torch.Tensor) else o for i, o in enumerate(out))
    raise TypeError(f"expected a tensor or a tuple of tensors, got {type(out).__name__}")


def _chosen_kernel(call: dict) -> bool:
    """Whether a diffusers attention call names a kernel the user chose (the processor's ``backend`` other than
    PyTorch's native one, e.g. after ``set_attention_backend("flash")``) or passes the kernel arguments of its own
    (``attention_kwargs``): ``auto`` then keeps that call's kernel (gathered) instead of overlapping with PyTorch's."""
    backend = call.get("backend")
    name = str(getattr(backend, "value", backend) or "native")
    return bool(call.get("attention_kwargs")) or name != "native"


def _replicated(extent: int, total: int, text: Optional[str], path: str) -> Tuple[int, int]:
    extra = extent - total
    if extra < 0 or (extra and text not in ("before", "after")):
        raise ValueError(f"{path}: {extent} tokens for {total} image tokens (replicated tokens: {text})")
    return (extra, 0) if text == "before" else (0, extra)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardTokens(Style):
    """The module's output (a token sequence, or a positional embedding) is cut to this rank's tokens.

    Args:
        dim: the sequence dimension of the output.
        items: for a tuple output, which elements (``None``: every tensor element).
        text: where the text tokens sit in that sequence (``"before"``/``"after"``; ``None``: image tokens only).
            Replicated text (their count is the extent minus the image tokens of the shard table) is kept whole;
            with a shard table whose text is sharded the whole joint sequence is cut (``part="joint"``).
        part: ``"text"``: the output is a text-only stream (FLUX.1's ``context_embedder``, Qwen-Image's ``txt_in``,
            HunyuanVideo's token refiner): cut to this rank's text slice when the table shards the text, else
            left whole.
        text_items: for a tuple output, elements that are text-only (cut like ``part="text"``; Qwen-Image's
            ``pos_embed`` returns ``(image freqs, text freqs)``).
        text_length_arg: the module takes the text length as this keyword argument, which the model computes from
            its (now sharded) text stream: the whole text's length is passed instead when the table shards the
            text, so what the module makes for the text (Qwen-Image's text RoPE, ``max_txt_seq_len``) covers every
            rank's slice before ``text_items`` cuts this rank's.
    """

    dim: int = 1
    items: Optional[Tuple[int, ...]] = None
    text: Optional[str] = None
    part: str = "image"
    text_items: Tuple[int, ...] = ()
    text_length_arg: Optional[str] = None

    def _apply(self, module, path, state):
        def pre(mod, args, kwargs):
            shards = state.require_shards()
            if state.ctx.world_size == 1 or not shards.text_sharded:
                return None
            if self.text_length_arg not in kwargs:
                raise ValueError(f"{path}: expected the text length as keyword argument {self.text_length_arg!r}")
            return args, dict(kwargs, **{self.text_length_arg: shards.text})

        def hook(mod, args, out):
            shards = state.require_shards()
            if state.ctx.world_size == 1:
                return out
            rank = state.ctx.rank

            def cut_text(t):
                if not shards.text_sharded:
                    return t
                return shard_tokens(t, shards, rank, dim=self.dim, part="text")

            if self.part == "text":
                return _map_items(out, self.items, cut_text)

            def cut(t):
                if shards.text_sharded and self.text is not None and t.shape[self.dim] != shards.total:
                    return shard_tokens(t, shards, rank, dim=self.dim, part="joint")
                before, after = _replicated(t.shape[self.dim], shards.total, self.text, path)
                return shard_tokens(t, shards, rank, dim=self.dim, before=before, after=after)

            if self.text_items and isinstance(out, (tuple, list)):
                out = type(out)(cut_text(o) if i in self.text_items else o for i, o in enumerate(out))
            return _map_items(out, self.items, cut)

        handles = [module.register_forward_hook(hook)]
        if self.text_length_arg:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        return Applied(lambda: [h.remove() for h in handles])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardGridRows(Style):
    """The module's output is a ``[..., rows, cols]`` grid (a patch embedding before flattening): keep this rank's
    band of token rows along ``row_dim`` (flattened frame-major afterwards, it is exactly the rank's token index)."""

    row_dim: int = -2

    def _apply(self, module, path, state):
        def hook(mod, args, out):
            shards = state.require_shards()
            if state.ctx.world_size == 1:
                return out
            if out.shape[self.row_dim] != shards.rows:
                raise ValueError(f"{path}: {out.shape[self.row_dim]} token rows, the shard table has {shards.rows}")
            lo, hi = shards.row_bounds[state.ctx.rank], shards.row_bounds[state.ctx.rank + 1]
            return out.narrow(self.row_dim, lo, hi - lo)

        return Applied(module.register_forward_hook(hook).remove)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherTokens(Style):
    """The module's output (this rank's tokens) is completed to the full sequence in global order (one
    all-gather): put it on the last per-token layer (the output projection), where tokens are narrowest.

    Inside a step of a state with an ``output_exchange`` (OTIL's block exchange, ``sampling/dit.py``) an output
    of image tokens only is completed by it instead."""

    dim: int = 1
    text: Optional[str] = None

    def _apply(self, module, path, state):
        def hook(mod, args, out):
            shards = state.require_shards()
            if state.ctx.world_size == 1:
                return out

            def full(t):
                extra = t.shape[self.dim] - shards.counts[state.ctx.rank]
                before, after = _replicated(shards.total + extra, shards.total, self.text, path)
                if state.output_exchange is not None and state.active and not before and not after:
                    return state.output_exchange(t, self.dim % t.dim())
                res = gather_tokens(t, shards, state.ctx, dim=self.dim, before=before, after=after)
                state.traffic.add("output", t.numel() * t.element_size() * (state.ctx.world_size - 1), collectives=1)
                return res

            return _map_items(out, None, full)

        return Applied(module.register_forward_hook(hook).remove)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceAttentionStyle(Style):
    """A host model's attention module whose processor ends in diffusers' ``dispatch_attention_fn`` (every diffusers
    DiT processor since 0.35, on any attention backend) or in ``F.scaled_dot_product_attention``: that one call is
    routed to a :class:`SequenceAttention`, with the processor's own attention function (and backend) as the
    function it calls.

    Args:
        text: where the text tokens sit in the module's joint sequence (``"before"``: FLUX, Qwen-Image;
            ``"after"``: HunyuanVideo; ``None``: image tokens only, as Wan's and LTX-Video's self-attention).
            Replicated text: its count is derived per call (local length minus this rank's image tokens); sharded
            text (the shard table says): the local sequence is the rank's joint shard, nothing replicated.
        mode: :class:`SeqMode` name.
        kv: the gathered mode's K/V strategy.
        link: the link profile the ``auto`` rule models.

    The processor's call of that function is rerouted by :func:`~.seq_route.reroute_processor` (the name rebound
    in a copy of its ``__call__``'s globals: no library global patched, no cost on the processor's other torch
    calls); the module's forward sets the route for its own length and refuses a call in which the processor did
    not take it. A processor that names neither function is refused when the plan is applied.
    """

    text: Optional[str] = None
    mode: str = "auto"
    kv: PeerExchange = EXACT
    link: Optional[str] = None

    def _apply(self, module, path, state):
        attn = SequenceAttention(state, self.mode, self.kv, self.link)
        text = self.text
        rank = state.ctx.rank

        def route(call, layout, dispatch):
            if call.get("is_causal") or call.get("dropout_p") or call.get("enable_gqa"):
                raise NotImplementedError(f"{path}: causal, dropout or GQA attention is not supported in sequence-parallel mode")
            if call.get("parallel_config") is not None:
                raise NotImplementedError(f"{path}: diffusers' own context parallelism is enabled on this model; sequence "
                                          f"parallelism replaces it: disable it (no parallel_config) first")
            q, k, v = call["query"], call["key"], call["value"]
            mask = call.get("attn_mask")
            seq = 1 if layout == "BLHD" else 2
            lq = q.shape[seq]
            if dispatch is not None:
                if mask is not None and mask.dim() == 2 and mask.shape[0] == q.shape[0] and mask.shape[1] == k.shape[1]:
                    mask = mask[:, None, None, :]  # how diffusers' native backend reads a 2-D mask: [batch, keys]
                rest = {name: call[name] for name in ("scale", "attention_kwargs", "backend") if name in call}

                def attn_fn(q, k, v, m, heads):
                    return dispatch(q, k, v, attn_mask=m, **rest)
            else:
                scale = call.get("scale")

                def attn_fn(q, k, v, m, heads):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)

            shards = state.require_shards()
            cross = k.shape[seq] != lq
            before = after = 0
            if not cross and shards.text_sharded:
                if text is None:  # backstop: a table shards text only for a family whose attentions are joint
                    raise ValueError(f"{path}: an image-only self-attention in a model whose text is sharded")
            elif not cross:
                before, after = _replicated(lq - shards.counts[rank] + shards.total, shards.total, text, path)
            return attn(q, k, v, attn_fn, layout=layout, before=before, after=after, cross=cross, mask=mask, key=path,
                        scale=call.get("scale"), custom=_chosen_kernel(call))

        slot, unroute = reroute_processor(module, path)

        def build(prior):
            def forward(*args, **kwargs):
                if state.ctx.world_size == 1:
                    return prior(*args, **kwargs)
                previous = slot.route
                slot.route, slot.calls = route, 0
                try:
                    out = prior(*args, **kwargs)
                finally:
                    slot.route = previous
                if not slot.calls:
                    # its tokens would have attended to this rank's keys only: a wrong result, not a slow one
                    raise NotImplementedError(
                        f"{path}: {type(module).__name__} computed attention without diffusers' {DISPATCH_NAME} or "
                        f"F.scaled_dot_product_attention (another attention implementation, e.g. a processor set after "
                        f"the plan was applied); sequence parallelism needs its processor on diffusers' attention "
                        f"dispatch (the native backend or another registered one)"
                    )
                return out

            return forward

        try:
            undo_forward = replace_forward(module, path, build)
        except BaseException:
            unroute()
            raise

        def undo():
            undo_forward()
            unroute()

        return Applied(undo)
