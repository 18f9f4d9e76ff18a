"""Sequence (token) parallelism for diffusion transformers: token shards by latent rows, and exact attention.

Each rank owns a band of the image/video tokens: a contiguous band of token rows (rows of the latent after
patchify), in every frame, and, for joint-attention models (FLUX.1, Qwen-Image, HunyuanVideo), a contiguous slice of
the text tokens. Everything per-token (projections, MLPs, norms, modulation, of the image and the text stream) then
runs on the rank's share only; attention is the one place that needs the other ranks, and
:class:`SequenceAttention` computes it exactly.

Design decisions:

* **Bands of rows, shared with the rest of PatchRay.** The split is :func:`~patchray.distributed.bands.row_bands` over token rows
  (uneven bands allowed: the first ``rows % N`` ranks one row taller; explicit ``row_sizes`` for speed-weighted
  bands). A video's tokens are frame-major (``t * rows * cols + row * cols + col``), so a rank's band is *not* a
  contiguous piece of the flattened sequence: :class:`TokenShards` holds each rank's token **index**, and
  sharding, gathering and the positional embedding (RoPE cos/sin, complex frequencies, any layout) all go through
  that one index (:func:`shard_tokens`, :func:`gather_tokens`, :func:`shard_positions`). A band of the latent
  rows and a token shard are then the same table, as for the VAE and the UNet.
* **Text is a sharded 1-D segment of the same table, not a second code path.** Replicating the text caps the speed-
  up (FLUX.1 at 1024x1024: 4,096 image + 512 text tokens, an ideal 1.8x on 2 ranks and 3.0x on 4 by token count), so
  a table may carry ``text_sizes`` (:func:`text_split`: contiguous slices, the first ``T % N`` ranks one more, empty
  slices allowed) and a ``text_side``. A sequence is then a *part* of the table: ``"image"`` (the row bands),
  ``"text"`` (the slices) or ``"joint"`` (both, in the model's order: a rank's local joint sequence is ``[its text
  slice, its band]`` or ``[band, slice]``), each with its index, so text streams, joint RoPE tables and the
  attention's key order all go through the same machinery (``part=`` of :func:`shard_tokens` /
  :func:`shard_positions`, :meth:`TokenShards.part_order`). The attentions exchange the whole joint shard
  (:attr:`TokenShards.seq_counts` tokens per rank), and the exchange strategies' band table is ``seq_counts``, so
  stale/displaced/compressed K/V carry the text slices like the bands. Models drop the text stream before their
  output projection, so only image tokens are ever gathered. A text padding mask is laid over every rank's keys: the
  caller hands the whole text's validity to the state (:meth:`SequenceState.set_text_valid`, read from the inputs,
  the same on every rank) and the attentions replace the model's mask, which covers the rank's own text slice only.
  Without ``text_sizes`` the text is replicated: ``before``/``after`` tokens kept whole on every rank.
* **Gathered order is rank-major; the index restores the exact order.** :func:`gather_tokens` all-gathers the
  bands (one collective, padded to the largest band, no sizes travel) and scatters them back with the index, so
  the result equals the unsharded sequence element for element.
* **One attention style, two exact modes, strategies for the K/V exchange.** :class:`SequenceAttention` is bound to a
  :class:`SequenceState` (the context, the shard table, the step flags and the stale memory) and is called with
  the local ``q, k, v`` and the model's own attention function:

  - ``gathered``: the sharded part of K and V (the image band, and the text slice when the text is sharded;
    packed in one tensor) is completed through a
    :class:`~.exchange.PeerExchange` strategy (:data:`~.exchange.EXACT`: one all-gather; ``STALE``/``DISPLACED``:
    the peers' K/V of an earlier step from the stale memory, DistriFusion-style), and the local queries attend to
    every key. **Key order does not matter** for softmax attention without a mask, or with a mask permuted the
    same way: ``softmax(q K^T) V`` is a sum over keys, so permuting the rows of K and V together leaves it
    unchanged up to floating-point summation order. The gathered keys are therefore used in rank-major order
    and never reordered (a key mask given over the global order is permuted instead).
  - ``ulysses`` (DeepSpeed-Ulysses): one all-to-all turns "my tokens, all heads" into "all tokens, heads/N" for
    q, k and v together, each rank attends for its heads, and a second all-to-all turns the output back. Only
    where the heads divide by N; uneven bands are padded to the largest for transport and the padding is cut off
    before attention (it never enters a softmax). Sharded text travels with the band. Replicated tokens are not
    exchanged: each rank takes its heads' slice of them, and their outputs are all-gathered over heads (one small
    all-gather).
  - ``auto``: per call, from shapes every rank shares (:func:`choose_mode`).

  The low-traffic modes (displaced K/V, OTIL, compressed residuals) are further ``PeerExchange`` strategies in
  ``exchange.py``: this class never branches on them.
* **Cross-attention exchanges nothing**: the queries are the band's, keys and values come from replicated text.
* **Host integration is thin.** ComfyUI's ``optimized_attention_override`` hands the local q, k, v and its attention
  function straight to :meth:`SequenceAttention.__call__`; diffusers' attention processors end in
  ``dispatch_attention_fn`` (or ``F.scaled_dot_product_attention``), a name :class:`SequenceAttentionStyle` rebinds
  for the adapted processors only (:mod:`.seq_route`: a copy of the processor's ``__call__`` with that global
  rerouted; no library global patched, no cost on the processor's other torch calls).

Accepted layouts (``layout=``): ``"BHLD"`` (``[batch, heads, tokens, head_dim]``, SDPA's), ``"BLHD"``
(``[batch, tokens, heads, head_dim]``, diffusers' processors and flash-attn), ``"BLC"`` (``[batch, tokens,
heads * head_dim]``, ComfyUI's ``optimized_attention`` without ``skip_reshape``; needs ``heads=``). The
attention function is called as ``attn_fn(q, k, v, mask, heads)`` with tensors in the caller's layout, ``heads``
being the number of heads in those tensors (``H`` gathered, ``H/N`` Ulysses), and returns the output in the
same layout as ``q``.

* **The per-call modulation is computed once across the ranks.** The blocks' adaLN layers read one embedding every
  rank holds whole; :mod:`.seq_modulation` gives each rank ``1/N`` of every such layer's output features and one
  all-gather per call, instead of every rank computing all of them.

Modules: :mod:`.tokens` (the shard table, shard/gather), :mod:`.seq_attention` (the state and the attention),
:mod:`.seq_masks` (key masks re-expressed for a rank's keys), :mod:`.seq_styles` (the styles a host model's plan
uses), :mod:`.seq_route` (the route from a host processor's attention call to the attention). This module gathers
their public names.
"""

from __future__ import annotations

from .seq_attention import (
    LAYOUTS,
    AttentionCost,
    AttentionFn,
    SeqMode,
    SequenceAttention,
    SequenceState,
    _key_mask,
    attention_cost,
    choose_mode,
)
from .seq_modulation import ModulationGroup, ShareModulation
from .seq_styles import GatherTokens, SequenceAttentionStyle, ShardGridRows, ShardTokens
from .tokens import PARTS, TokenShards, gather_tokens, shard_positions, shard_tokens, split_replicated, text_split

__all__ = [
    "TokenShards",
    "SequenceState",
    "SeqMode",
    "SequenceAttention",
    "SequenceAttentionStyle",
    "ShardTokens",
    "ShardGridRows",
    "GatherTokens",
    "ShareModulation",
    "ModulationGroup",
    "shard_tokens",
    "text_split",
    "PARTS",
    "gather_tokens",
    "shard_positions",
    "split_replicated",
    "choose_mode",
    "attention_cost",
    "AttentionCost",
    "AttentionFn",
    "LAYOUTS",
]
