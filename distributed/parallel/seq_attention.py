"""Exact sequence-parallel attention over token shards: the shared state and :class:`SequenceAttention`.

:class:`SequenceState` is the step state of one sequence-parallel model (context, shard table, step flags, stale
memory, and an optional completion of the output tokens); :class:`SequenceAttention` computes the local queries'
attention over every rank's keys in gathered mode (K/V completed through a :class:`~.exchange.PeerExchange`
strategy: exact, stale, displaced or compressed residuals), overlapped mode (the exact gather in flight behind the
local part of the attention, :mod:`.seq_overlap`) or Ulysses mode (all-to-all over heads). See ``sequence.py`` for
the design.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch

from ..comm import all_gather_padded, all_to_all_equal
from ..context import ParallelContext
from .exchange import EXACT, ExactExchange, PeerExchange, StepState
from .seq_cost import AttentionCost, SeqMode, attention_cost, choose_mode
from .seq_masks import _key_mask, _valid_mask
from .seq_overlap import overlapped_attention, ring_attention
from .tokens import TokenShards, split_replicated

__all__ = [
    "SequenceState",
    "SeqMode",
    "SequenceAttention",
    "choose_mode",
    "attention_cost",
    "AttentionCost",
    "LAYOUTS",
    "AttentionFn",
]

#: the q/k/v layouts :class:`SequenceAttention` accepts
LAYOUTS = ("BHLD", "BLHD", "BLC")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], int], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# the shared state


class SequenceState(StepState):
    """What the sequence-parallel adapters of one model share: context, shard table, step flags, stale memory.

    A :class:`~.exchange.StepState` whose band table (``rows``) is the number of tokens each rank contributes to a
    self/joint attention's K/V (:attr:`TokenShards.seq_counts`: its image band, plus its text slice when the text
    is sharded): the exchange strategies (``EXACT``/``STALE``/``DISPLACED``/compressed) and the stale memory work on
    it unchanged (a rank's K/V extent is proportional to that entry: equal to it).

    Args:
        ctx: the sequence group.
        traffic: the byte accounting (``sampling.comm_manager.Traffic``).
        memory: ``memory(ctx, row_sizes, traffic)`` builds the stale memory (``sampling.comm_manager.CommManager``)
            when the shard table changes; needed only for the stale/displaced strategies.

    Outside :meth:`begin_step`/:meth:`end_step` (``active`` False) the adapters still shard and gather exactly:
    ``active`` only tells the stale strategies that a step's bookkeeping runs.
    """

    def __init__(self, ctx: ParallelContext, traffic, memory: Optional[Callable] = None):
        super().__init__(ctx, align=1, traffic=traffic)
        self.shards: Optional[TokenShards] = None
        self._memory = memory
        self.steps_in_memory = 0
        #: whether the current synchronous step refills the stale memory (see :meth:`begin_step`)
        self.refill = True
        #: the last local key mask verified to treat image keys alike (shared by every attention of the model)
        self.checked_masks: dict = {}
        #: the current stream (a caller that evaluates cond and uncond in separate calls keeps a memory per stream)
        self.stream: Any = None
        self._held: Dict[Any, tuple] = {}
        #: the text validity of the current call's padding mask over the whole joint sequence in global order
        #: (``[B, seq_total]`` bool; ``None``: no padding), for a table that shards the text (:meth:`set_text_valid`)
        self.key_valid: Optional[torch.Tensor] = None
        #: ``fn(local_tokens, dim) -> full tokens`` used by ``GatherTokens`` inside a step (e.g. OTIL's block
        #: exchange of the output, set by ``sampling/dit.py``); ``None``: the exact all-gather
        self.output_exchange: Optional[Callable] = None
        #: attention calls per mode that ran (after ``auto`` and fallbacks resolved), for reports and tests
        self.mode_calls: Dict[str, int] = {}
        #: the model's modulation layers computed in shares (a ``seq_modulation.ModulationGroup``; ``None``: none)
        self.modulation = None

    def begin_call(self) -> None:
        """A new model call starts (the host's entry calls this before the model runs): per-call results of the
        previous call (the shared modulation's outputs) no longer apply."""
        if self.modulation is not None:
            self.modulation.begin_call()

    def set_shards(self, shards: TokenShards) -> bool:
        """Use ``shards`` from now on; True (and a fresh, empty stale memory for the current stream) when the table
        changed.

        A stale memory belongs to one table and one stream: another stream's memory (held by :meth:`select_stream`)
        keeps its own table, so a cond and an uncond prompt of different lengths with their text sharded, evaluated
        in turn, each keep their memory (the first call of a stream after its table changed must be synchronous)."""
        if shards.world_size != self.ctx.world_size:
            raise ValueError(f"shard table for {shards.world_size} ranks used in a group of {self.ctx.world_size}")
        if shards == self.shards:
            return False
        if self.cm is not None:
            self.cm.wait()
        self._use_table(shards)
        self.cm = self._memory(self.ctx, self.rows, self.traffic) if self._memory is not None else None
        self.steps_in_memory = 0
        return True

    def _use_table(self, shards: Optional[TokenShards]) -> None:
        self.shards = shards
        if shards is None:
            return
        self.rows = shards.seq_counts  # the K/V extents of the exchanges and the stale memory
        self.bounds = self.latent_bounds = shards.row_bounds
        self.height, self.width = shards.rows, shards.cols

    def set_text_valid(self, valid: Optional[torch.Tensor]) -> None:
        """The current call's text padding mask as ``[B, T]`` validity (``None``: every text token is attended to),
        for a table that shards the text: every joint attention of the call then masks the invalid text keys of
        every rank (a model's own mask covers its rank's text slice only and is replaced). The same on every rank
        (read from the call's inputs)."""
        if valid is None:
            self.key_valid = None
            return
        shards = self.require_shards()
        if not shards.text_sharded or valid.dim() != 2 or valid.shape[1] != shards.text:
            raise ValueError(f"text validity {tuple(valid.shape)} for a table with {shards.text} sharded text tokens")
        image = valid.new_ones((valid.shape[0], shards.total))
        self.key_valid = torch.cat([valid, image] if shards.text_side == "before" else [image, valid], dim=1)

    def select_stream(self, stream: Any) -> None:
        """Use ``stream``'s stale memory and shard table from now on (each stream has its own, built on its first
        step; call before the stream's call sets its grid)."""
        if stream == self.stream:
            return
        if self.cm is not None:
            self.cm.wait()
        self._held[self.stream] = (self.cm, self.steps_in_memory, self.shards)
        self.stream = stream
        held = self._held.pop(stream, None)
        if held is not None and held[2] is not None:
            self.cm, self.steps_in_memory = held[0], held[1]
            self._use_table(held[2])
            return
        self.cm, self.steps_in_memory = None, 0
        if self.shards is not None and self._memory is not None:
            self.cm = self._memory(self.ctx, self.shards.seq_counts, self.traffic)

    def set_grid(self, frames: int, rows: int, cols: int, row_sizes: Optional[Sequence[int]] = None, *, text: int = 0,
                 text_side: str = "before") -> bool:
        """:meth:`set_shards` for a token grid with equal bands (or ``row_sizes``); ``text > 0``: the joint
        sequence's ``text`` tokens are sharded too (on ``text_side`` of the image tokens)."""
        return self.set_shards(TokenShards.split(frames, rows, cols, self.ctx.world_size, row_sizes, weights=self.ctx.band_weights,
                                                 text=text, text_side=text_side))

    def require_shards(self) -> TokenShards:
        if self.shards is None:
            # backstop, not the guard: the plan's root hook sets the grid before any adapter runs
            raise RuntimeError("sequence-parallel model ran without a token grid; call set_grid() first")
        return self.shards

    def begin_step(self, step: int, sync: bool, refill: bool = True) -> None:
        """Start logical step ``step`` (``sync``: exchange exactly).

        ``refill`` (synchronous steps only): the step leaves the stale memory filled for the next step. A synchronous
        step followed by another synchronous one (every warm-up step but the last) need not: its attention is exact
        by the cheapest exact mode (:class:`SequenceAttention`: Ulysses where the heads divide and the link favours
        it) and the memory is left alone; the last warm-up step and every refresh step refill it."""
        if self.cm is None and not sync:
            raise RuntimeError("a non-synchronous step needs a stale memory: build the SequenceState with memory=")
        if self.steps_in_memory == 0 and not sync:
            raise RuntimeError("the first step after a new token grid must be synchronous and refill the stale memory: "
                               "the stale memory is empty")
        if self.cm is not None:
            self.cm.wait()
        self.step, self.sync, self.active = step, sync, True
        self.refill = bool(refill) or not sync

    def end_step(self) -> None:
        filled = self.refill
        self.active = False
        self.sync = True
        self.refill = True
        if self.cm is not None and self.cm.num_slots:
            if not self.cm.laid_out:
                self.cm.build_layout()
            else:
                self.cm.flush()
        if filled:
            self.steps_in_memory += 1

    def finish(self) -> None:
        """Wait for every in-flight exchange (before reading results or releasing the group)."""
        if self.cm is not None:
            self.cm.wait()
        for cm, _, _ in self._held.values():
            if cm is not None:
                cm.wait()


# --------------------------------------------------------------------------------------------------
# attention


def _to_blhd(t: torch.Tensor, layout: str, heads: Optional[int]) -> torch.Tensor:
    if layout == "BLHD":
        return t
    if layout == "BHLD":
        return t.transpose(1, 2)
    return t.unflatten(-1, (heads, -1))


def _from_blhd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BLHD":
        return t
    if layout == "BHLD":
        return t.transpose(1, 2)
    return t.flatten(-2)


class SequenceAttention:
    """Exact sequence-parallel attention of one rank's tokens, bound to a :class:`SequenceState`.

    Args:
        state: the shared state (context, shard table, step flags, stale memory).
        mode: :class:`SeqMode` or its name: ``gathered``, ``overlapped``, ``ulysses`` or ``auto``.
        kv: the K/V exchange strategy of gathered mode (``exchange.EXACT``, ``STALE``, ``DISPLACED``, or any
            further :class:`~.exchange.PeerExchange`). Ulysses needs the exact one.
        link: link profile (name) the ``auto`` rule models (default ``pcie4_x16_p2p``).

    ``overlapped`` computes the local keys' part while the exact K/V gather is in flight and merges the parts by
    their log-sum-exp; ``ring`` sends the same K/V point to point, one peer per stage, and attends to each peer's
    part while the next one travels (:mod:`.seq_overlap`: PyTorch's fused attention instead of the model's
    function); a call they cannot take (a mask, stale K/V) runs gathered. Where ``auto`` picks gathered on an NCCL
    group (whose exchanges run on their own stream) it takes ``overlapped`` at 2 ranks (the own keys, half the
    attention, hide the gather) and ``ring`` from 3 (the own keys alone, a quarter at 4 ranks, hid 2 of FLUX.1's 7 ms
    of gather per step on NVLink while splitting the attention cost 2 ms: measured on an H200, each rank's kernels
    alone), unless the caller's function is a kernel the user chose (``custom``).

    Call it with the local q, k, v as the model would pass them to its attention function; the output is what that
    function would return for the local queries over the whole sequence.

    Example:
        >>> state = SequenceState(ctx, Traffic())                       # doctest: +SKIP
        >>> state.set_grid(frames=1, rows=64, cols=64)                  # doctest: +SKIP
        >>> attn = SequenceAttention(state, mode="auto")                # doctest: +SKIP
        >>> sdpa = lambda q, k, v, mask, heads: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        >>> out = attn(q, k, v, sdpa, layout="BHLD", before=512, key="blocks.0.attn")  # doctest: +SKIP
    """

    def __init__(self, state: SequenceState, mode: Union[str, SeqMode] = SeqMode.AUTO, kv: PeerExchange = EXACT, link=None):
        self.state = state
        self.mode = SeqMode(mode)
        self.kv = kv
        self.link = link
        if self.mode is SeqMode.ULYSSES and not isinstance(kv, ExactExchange):
            raise ValueError(f"Ulysses attention exchanges this step's q/k/v; it cannot use the {type(kv).__name__} "
                             f"K/V strategy: use mode='gathered' for stale or displaced K/V")
        #: the mode of the last call (after ``auto`` resolved), for reports and tests
        self.last_mode: Optional[SeqMode] = None
        self._checked = state.checked_masks
        #: ``auto``'s choice per shapes (:func:`choose_mode` reads only them)
        self._auto: Dict[tuple, SeqMode] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_fn: AttentionFn, *, layout: str = "BHLD",
                 heads: Optional[int] = None, before: int = 0, after: int = 0, cross: bool = False,
                 mask: Optional[torch.Tensor] = None, key: str = "attn", scale: Optional[float] = None,
                 custom: bool = False) -> torch.Tensor:
        """Attention of the local queries over every rank's keys.

        Args:
            q, k, v: this rank's tensors in ``layout`` (see the module docstring). For self-attention the sequence
                is ``[before replicated tokens, this rank's image tokens, after replicated tokens]``; with a shard
                table whose text is sharded it is the rank's joint sequence (text slice and image band in the
                model's order, :attr:`TokenShards.seq_counts`) and ``before``/``after`` are 0.
            attn_fn: ``attn_fn(q, k, v, mask, heads)``, the model's own attention, same layout.
            layout: ``"BHLD"``, ``"BLHD"`` or ``"BLC"`` (``"BLC"`` needs ``heads``).
            heads: heads of the call (read from the tensors except in ``"BLC"``).
            before, after: replicated (text) tokens before and after the image tokens (joint attention: FLUX and
                Qwen-Image put text first, HunyuanVideo last).
            cross: keys and values are replicated (cross-attention to text): nothing is exchanged.
            mask: the caller's attention mask (broadcastable to ``[B, H, Lq, Lk]``): over the local keys or over the
                full key sequence in global order; see :func:`_key_mask`.
            key: a name unique per attention layer (the stale memory's slot).
            scale: the score scale ``attn_fn`` applies (``None``: ``1/sqrt(head_dim)``), for overlapped mode.
            custom: ``attn_fn`` is an attention kernel the user chose (another node's override): ``auto`` keeps it
                (gathered) instead of overlapping with PyTorch's kernel; an explicit ``overlapped`` still overlaps.
        """
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} (got {layout!r})")
        if layout == "BLC" and not heads:
            raise ValueError("layout 'BLC' needs heads=")
        st = self.state
        ctx = st.ctx
        if cross or ctx.world_size == 1:
            return attn_fn(q, k, v, mask, heads or q.shape[1 if layout == "BHLD" else 2])
        shards = st.require_shards()
        if layout == "BLHD":
            q4, k4, v4 = q, k, v
        else:
            q4, k4, v4 = _to_blhd(q, layout, heads), _to_blhd(k, layout, heads), _to_blhd(v, layout, heads)
        b, lq, h, d = q4.shape
        if before or after:
            if shards.text_sharded:
                raise ValueError(f"{key}: the shard table shards the text; a joint sequence has no replicated tokens "
                                 f"(got before={before}, after={after})")
        n_me = shards.seq_counts[ctx.rank]
        if lq - before - after != n_me or k4.shape[1] != lq:
            raise ValueError(
                f"{key}: {lq} local tokens ({k4.shape[1]} keys) do not match {before} + {n_me} sharded tokens of rank "
                f"{ctx.rank} + {after}; check the shard table and the replicated counts"
            )
        mode, kv = self.mode, self.kv
        if st.active and st.sync and not st.refill and not isinstance(kv, ExactExchange):
            # a synchronous step that need not refill the stale memory (a warm-up step before the last): exact K/V, by
            # the cheapest exact mode (``auto``: Ulysses where the heads divide and the link favours it)
            kv = EXACT
        if mode is SeqMode.AUTO:
            # decided from shapes every rank shares (and the K/V strategy of this call: a warm-up step runs exact
            # K/V); the same shapes recur in every layer and step: decided once
            choice = (shards.seq_counts, h, d, q4.element_size(), b, before + after, id(kv))
            mode = self._auto.get(choice)
            if mode is None:
                mode = self._auto[choice] = choose_mode(shards.seq_counts, h, d, choice[3], batch=b,
                                                        replicated=before + after, kv=kv, link=self.link)
        if mode is SeqMode.ULYSSES and h % ctx.world_size:
            raise ValueError(f"{key}: Ulysses needs the heads ({h}) to divide by the ranks ({ctx.world_size}); use mode='gathered' or 'auto'")
        self.last_mode = mode
        lk_full = before + shards.seq_total + after
        if mask is not None and shards.text_sharded and st.key_valid is not None:
            mask = _valid_mask(st.key_valid, mask, key)
        if self.mode is SeqMode.AUTO and mode is SeqMode.GATHERED and ctx.backend == "nccl" and not custom:
            # NCCL runs the exchange on its own stream: hide it behind the attention (one peer's part per stage from
            # 3 ranks, where the own keys alone are too small a part to hide a whole gather)
            mode = SeqMode.OVERLAPPED if ctx.world_size == 2 else SeqMode.RING
        if mode in (SeqMode.OVERLAPPED, SeqMode.RING) and (mask is not None or not isinstance(kv, ExactExchange)):
            mode = SeqMode.GATHERED  # a mask or stale K/V: the model's own function over the gathered keys
        self.last_mode = mode
        st.mode_calls[mode.value] = st.mode_calls.get(mode.value, 0) + 1
        if mode in (SeqMode.OVERLAPPED, SeqMode.RING):
            ki, vi = (split_replicated(t, 1, before, after)[1] for t in (k4, v4)) if before or after else (k4, v4)
            packed = torch.stack([ki, vi], dim=2)  # [B, n, 2, H, D]: what the peers need
            n = ctx.world_size
            st.traffic.add("kv", packed.numel() * packed.element_size() * (n - 1),
                           collectives=1 if mode is SeqMode.OVERLAPPED else n - 1)
            fn = overlapped_attention if mode is SeqMode.OVERLAPPED else ring_attention
            out = fn(q4, k4, v4, packed, ctx, st.scaled(packed.shape[1]), scale)
        elif mode is SeqMode.GATHERED:
            out = self._gathered(q4, k4, v4, attn_fn, layout, before, after, mask, key, lq, lk_full, kv)
        else:
            out = self._ulysses(q4, k4, v4, attn_fn, layout, before, after, mask, key, lq, lk_full)
        return out if layout == "BLHD" else _from_blhd(out, layout)

    # ---------------------------------------------------------------- gathered K/V

    def _gathered(self, q, k, v, attn_fn, layout, before, after, mask, key, lq, lk_full, kv):
        st, shards = self.state, self.state.shards
        replicated = before or after
        if replicated:
            kb, ki, ka = split_replicated(k, 1, before, after)
            vb, vi, va = split_replicated(v, 1, before, after)
        else:
            ki, vi = k, v
        packed = torch.stack([ki, vi], dim=2)  # [B, n, 2, H, D] (a new contiguous tensor): one exchange for K and V
        full = kv.full_kv(packed, f"{key}.kv", st)  # [B, n_total, 2, H, D], rank-major
        if replicated:
            k_all = torch.cat([kb, full[:, :, 0], ka], dim=1)
            v_all = torch.cat([vb, full[:, :, 1], va], dim=1)
        else:  # views: attention reads K and V with their strides (the head dim stays contiguous), no copies
            k_all, v_all = full.unbind(2)
        m = None
        if mask is not None:
            m = _key_mask(mask, lq, lk_full, before, after, shards.seq_total, shards.part_order("joint", mask.device),
                          key, self._checked)
        h = q.shape[2]
        if layout == "BLHD":
            return attn_fn(q, k_all, v_all, m, h)
        return _to_blhd(attn_fn(_from_blhd(q, layout), _from_blhd(k_all, layout), _from_blhd(v_all, layout), m, h), layout, h)

    # ---------------------------------------------------------------- Ulysses

    def _ulysses(self, q, k, v, attn_fn, layout, before, after, mask, key, lq, lk_full):
        st, shards = self.state, self.state.shards
        ctx = st.ctx
        n, me = ctx.world_size, ctx.rank
        b, _, h, d = q.shape
        hn = h // n
        counts = shards.seq_counts
        n_max = max(counts)
        replicated = before or after
        if replicated:
            parts = [split_replicated(t, 1, before, after) for t in (q, k, v)]
            img = torch.stack([p[1] for p in parts], dim=0)  # [3, B, n_me, H, D]
        else:
            img = torch.stack([q, k, v], dim=0)
        if img.shape[2] < n_max:
            img = torch.cat([img, img.new_zeros(3, b, n_max - img.shape[2], h, d)], dim=2)
        send = img.unflatten(3, (n, hn)).permute(3, 0, 1, 2, 4, 5)  # [N, 3, B, n_max, H/N, D]
        recv = all_to_all_equal(send, ctx)  # recv[s]: rank s's tokens, my heads
        es = q.element_size()
        st.traffic.add("kv", send.numel() * es * (n - 1) // n, collectives=1)
        img_all = torch.cat([recv[s, :, :, : counts[s]] for s in range(n)], dim=2)  # [3, B, n_total, H/N, D]
        heads_me = slice(me * hn, (me + 1) * hn)
        if replicated:
            seqs = []
            for i, (pb, _, pa) in enumerate(parts):
                seqs.append(torch.cat([pb[:, :, heads_me], img_all[i], pa[:, :, heads_me]], dim=1))
            qa, ka, va = seqs
        else:
            qa, ka, va = img_all.unbind(0)
        m = None
        if mask is not None:
            m = _key_mask(mask, lq, lk_full, before, after, shards.seq_total, shards.part_order("joint", mask.device),
                          key, self._checked)
        if m is not None and m.dim() >= 2 and m.shape[-2] not in (1,):
            raise NotImplementedError(f"{key}: Ulysses supports key masks only (a mask that varies per query needs mode='gathered')")
        if m is not None and m.dim() == 4 and m.shape[1] not in (1,):
            m = m[:, heads_me]
        if layout == "BLHD":
            out = attn_fn(qa, ka, va, m, hn)
        else:
            out = _to_blhd(attn_fn(_from_blhd(qa, layout), _from_blhd(ka, layout), _from_blhd(va, layout), m, hn), layout, hn)
        if replicated:
            ob, oi, oa = split_replicated(out, 1, before, after)  # oi: [B, n_total, H/N, D] rank-major
        else:
            oi = out
        back = []
        for s, piece in enumerate(oi.split(list(counts), dim=1)):
            if piece.shape[1] < n_max:
                piece = torch.cat([piece, piece.new_zeros(b, n_max - piece.shape[1], hn, d)], dim=1)
            back.append(piece)
        back = torch.stack(back, dim=0)
        mine = all_to_all_equal(back, ctx)  # mine[s]: my tokens, heads of rank s
        st.traffic.add("kv", back.numel() * es * (n - 1) // n, collectives=1)
        mine = mine[:, :, : counts[me]].permute(1, 2, 0, 3, 4).reshape(b, counts[me], h, d)
        if not before and not after:
            return mine
        rep = torch.cat([ob, oa], dim=1).contiguous()
        st.traffic.add("kv", rep.numel() * es * (n - 1), collectives=1)
        rep = all_gather_padded(rep, ctx, dim=2, sizes=[hn] * n)  # heads in rank order = head order
        return torch.cat([rep.narrow(1, 0, before), mine, rep.narrow(1, before, after)], dim=1)
