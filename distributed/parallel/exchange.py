"""Stepwise peer exchange: how a layer of a model sampled step by step gets what its peers hold.

Patch-parallel sampling (DistriFusion, and OTIL on top of it) runs the same model many times on slowly changing
inputs, so a layer may use its neighbours' values of an earlier step instead of waiting for this step's. The
choice is a strategy object, shared by every adapter that exchanges (halo convolution rows, attention K/V):

* :data:`EXACT` (:class:`ExactExchange`): every step, blocking: exact.
* :data:`STALE` (:class:`StaleExchange` without streaming): exchanged on synchronous steps (warm-up, refresh)
  and kept in the stale memory; the other steps read the memory ("no_sync").
* :data:`DISPLACED` (:class:`StaleExchange` with streaming): DistriFusion's displaced patch parallelism: the
  memory is refreshed every step by an asynchronous all-gather of this step's values, read one step later.
* :class:`CompressedExchange` (:func:`compressed`): displaced, but the refresh travels as ``bits``-bit residuals
  ``fresh - what_peers_hold`` (1, 2 or 4 bits, one absmax scale per group of elements, packed codes) with error
  feedback (CompactFusion): sender and receivers both store ``base + dequant(q)``, so quantisation error does not
  accumulate. Synchronous steps (warm-up, refresh) are exact and also reset the sender's reference. The codec and
  its buffers belong to the stale memory (``sampling/comm_manager.py``); the strategy only marks its slots.

The strategies do not branch on a mode inside the forward; each is its own small class. The K/V methods are the
seam for sequence-parallel attention (DiTs, ``sequence.py``): :class:`~.sequence.SequenceAttention` in gathered mode
completes a token shard's packed K and V through ``full_kv`` exactly like a row band's (the token table is the band
table, see ``bands.py``), so displaced K/V work for DiTs unchanged. The compressed-residual strategy plugs in at the same seam (no
second attention code path), for the UNet's halos and K/V and the DiTs' gathered K/V alike. Ulysses (all-to-all of q, k, v over heads) exchanges this step's
queries too, so it is a mode of :class:`~.sequence.SequenceAttention` rather than a K/V strategy; it only runs with
:data:`EXACT`.

:class:`StepState` is the state those adapters share: the band table of the current latent, the stale memory
(a ``CommManager``, owned by the sampling handle, one per stream), the byte accounting, and the per-step flags
the handle sets from the logical step index (so every rank takes the same branch).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from ..comm import all_gather_padded, exchange_halo
from ..context import ParallelContext
from ..bands import band_heights, bounds_of, scaled_extents
from .plan import RowState

__all__ = [
    "StepState",
    "PeerExchange",
    "ExactExchange",
    "StaleExchange",
    "CompressedExchange",
    "compressed",
    "EXACT",
    "STALE",
    "DISPLACED",
    "COMPRESSED_BITS",
]

#: the code widths :class:`CompressedExchange` accepts
COMPRESSED_BITS = (1, 2, 4)


class StepState(RowState):
    """What the adapters of one model parallelized for stepwise sampling share; owned by its handle (no globals).

    Set per latent shape by :meth:`set_bands`: ``rows`` (band heights), ``bounds`` (row offsets, also the
    :class:`RowState` band table), ``height``/``width``, ``cm`` (the stale memory). Set per step by the handle:
    ``active``, ``sync``, ``step``.

    Args:
        ctx: the patch group.
        align: the model's total row downsampling: band heights are multiples of it.
        traffic: the byte accounting (``add(kind, nbytes, collectives=...)``).
    """

    def __init__(self, ctx: ParallelContext, align: int, traffic):
        super().__init__(ctx)
        self.align = align
        self.traffic = traffic
        self.rows: Optional[Tuple[int, ...]] = None
        self.bounds: Optional[Tuple[int, ...]] = None
        self.height = self.width = None
        self.cm = None
        self.active = False
        self.sync = True
        self.step = -1

    def set_bands(self, height: int, width: int, cm) -> None:
        """Set the band table for a latent size and the stale memory (``cm``) the adapters use with it."""
        self.rows = band_heights(height, self.ctx.world_size, self.align, weights=self.ctx.band_weights)
        self.bounds = bounds_of(self.rows)
        self.latent_bounds = self.bounds
        self.height, self.width = height, width
        self.cm = cm

    @property
    def exchanging(self) -> bool:
        """Whether the adapters do anything this call (several ranks, inside a step)."""
        return self.active and self.ctx.world_size > 1

    def scaled(self, local_extent: int) -> List[int]:
        """Every rank's extent of a dimension proportional to the band, from this rank's ``local_extent``."""
        return scaled_extents(self.rows, self.ctx.rank, local_extent)


@dataclasses.dataclass(frozen=True)
class PeerExchange:
    """A strategy: how halo rows and K/V of the peers reach a layer at each step (see the module docstring)."""

    def halo(self, x: torch.Tensor, key: str, before: int, after: int, keep: int, state: StepState):
        """The ``before`` rows of the rank above and ``after`` rows of the rank below (``None`` at image edges)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def full_kv(self, local: torch.Tensor, key: str, state: StepState) -> torch.Tensor:
        """Keys or values ``(B, L_local, D)`` completed to the whole image/sequence ``(B, L, D)`` in rank order."""
        raise NotImplementedError  # pragma: no cover - abstract


def _exact_halo(x: torch.Tensor, before: int, after: int, state: StepState):
    ctx = state.ctx
    r, n = ctx.rank, ctx.world_size
    table = [(0 if q == 0 else before, 0 if q == n - 1 else after) for q in range(n)]
    halo = exchange_halo(x, ctx, dim=x.dim() - 2, halos=table)
    row_bytes = x[..., :1, :].numel() * x.element_size()
    sent = (table[r - 1][1] if r > 0 else 0) + (table[r + 1][0] if r < n - 1 else 0)
    state.traffic.add("halo", sent * row_bytes, collectives=1)
    return halo


def _exact_kv(local: torch.Tensor, state: StepState):
    ctx = state.ctx
    sizes = state.scaled(local.shape[1])
    full = all_gather_padded(local, ctx, dim=1, sizes=sizes)
    state.traffic.add("kv", local.numel() * local.element_size() * (ctx.world_size - 1), collectives=1)
    return full, sizes


@dataclasses.dataclass(frozen=True)
class ExactExchange(PeerExchange):
    """Every step, blocking: one point-to-point exchange per halo, one all-gather per K and V. Exact."""

    def halo(self, x, key, before, after, keep, state):
        h = _exact_halo(x, before, after, state)
        return h.before, h.after

    def full_kv(self, local, key, state):
        return _exact_kv(local, state)[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StaleExchange(PeerExchange):
    """Exact on synchronous steps, which also fill the stale memory; the other steps read the memory.

    Args:
        streams: refresh the memory every step with an asynchronous all-gather of this step's values (displaced
            patch parallelism); otherwise the memory holds the last synchronous step's values.
    """

    streams: bool = False

    #: bits of the streamed refresh (0: values as they are); see :class:`CompressedExchange`
    bits = 0

    def _edges(self, x, keep):
        return torch.cat([x[..., :keep, :], x[..., x.shape[-2] - keep :, :]], dim=-2)

    def halo(self, x, key, before, after, keep, state):
        cm, r, n = state.cm, state.ctx.rank, state.ctx.world_size
        if state.sync:
            h = _exact_halo(x, before, after, state)
            shape = list(x.shape)
            shape[-2] = 2 * keep  # each rank keeps `keep` rows of each of its edges
            sid = cm.register(key, "halo", shape, x, None, streamed=self.streams, bits=self.bits)
            if self.bits:  # the reference: what the neighbours now hold of this rank's edges (the rows they read)
                cm.view(sid, r).copy_(self._edges(x, keep))
            if h.before is not None:
                cm.view(sid, r - 1)[..., 2 * keep - before :, :].copy_(h.before)
            if h.after is not None:
                cm.view(sid, r + 1)[..., :after, :].copy_(h.after)
            return h.before, h.after
        sid = cm.register(key, "halo", (), x, None, streamed=False)  # lookup: registered on a sync step
        above = cm.view(sid, r - 1)[..., 2 * keep - before :, :].clone() if r > 0 and before else None
        below = cm.view(sid, r + 1)[..., :after, :].clone() if r < n - 1 and after else None
        if self.streams:
            cm.enqueue(sid, self._edges(x, keep))
        return above, below

    def full_kv(self, local, key, state):
        cm, me = state.cm, state.ctx.rank
        if state.sync:
            full, sizes = _exact_kv(local, state)
            sid = cm.register(key, "kv", local.shape, local, 1, streamed=self.streams, bits=self.bits)
            for r, part in enumerate(full.split(sizes, dim=1)):
                if r != me or self.bits:  # compressed: this rank's own row is the reference the residuals go against
                    cm.view(sid, r).copy_(part)
            return full
        sid = cm.register(key, "kv", local.shape, local, 1, streamed=False)  # lookup
        full = torch.cat([local if r == me else cm.view(sid, r) for r in range(state.ctx.world_size)], dim=1)
        if self.streams:
            cm.enqueue(sid, local)
        return full


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressedExchange(StaleExchange):
    """Displaced exchange whose per-step refresh travels as ``bits``-bit residuals with error feedback.

    Args:
        bits: 1, 2 or 4 (:data:`COMPRESSED_BITS`): sign codes with a mean-absolute scale, or symmetric absmax codes;
            one float32 scale per group of ``comm_manager.GROUP`` elements.

    Synchronous steps are exact (one blocking exchange, as :data:`EXACT`) and set both the peers' copies and this
    rank's reference; every other step reads the peers' previous-step values from the memory and enqueues this
    step's value, of which only the quantised change since the reference travels. Over the rows a peer reads, its
    copy equals the sender's reference bit for bit (the halo memory of a peer that is not a neighbour is never read).
    """

    streams: bool = True
    bits: int = 2

    def __post_init__(self):
        if self.bits not in COMPRESSED_BITS:
            raise ValueError(f"compressed exchange bits must be one of {COMPRESSED_BITS} (got {self.bits})")
        if not self.streams:
            raise ValueError("the compressed exchange refreshes every step: streams must be True")


def compressed(bits: int) -> CompressedExchange:
    """The compressed-residual strategy with ``bits``-bit codes (1, 2 or 4)."""
    return CompressedExchange(bits=int(bits))


EXACT = ExactExchange()
STALE = StaleExchange(streams=False)
DISPLACED = StaleExchange(streams=True)
