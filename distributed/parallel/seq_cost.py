"""The modes of sequence-parallel attention and their modelled traffic: :class:`SeqMode`, :func:`attention_cost` and
the ``auto`` rule :func:`choose_mode` (shapes and a link profile in, a mode out; the same on every rank)."""

from __future__ import annotations

import enum
from typing import Dict, NamedTuple, Sequence, Union

from .exchange import EXACT, ExactExchange, PeerExchange

__all__ = ["SeqMode", "AttentionCost", "attention_cost", "choose_mode"]

class SeqMode(str, enum.Enum):
    """How :class:`SequenceAttention` reaches the other ranks' tokens (both exact with the exact K/V strategy)."""

    GATHERED = "gathered"  # all-gather the sharded part of K and V; local queries
    OVERLAPPED = "overlapped"  # gathered, the gather in flight behind the local keys' part (log-sum-exp merge)
    RING = "ring"  # the same K/V point to point, one peer per stage, each peer's part attended behind the next's transfer
    ULYSSES = "ulysses"  # all-to-all: my tokens x all heads <-> all tokens x heads/N
    AUTO = "auto"  # per call, by the modelled cost (choose_mode)


class AttentionCost(NamedTuple):
    """Modelled traffic of one self-attention call for one rank (the slowest: the largest band).

    ``wire_bytes``: bytes the rank sends; ``messages``: collective calls; ``counted``: the bytes comm's accounting
    (``log_comm``) counts per operation, so ``bench/linkmodel.wire_bytes(counted, N) == wire_bytes``.
    """

    wire_bytes: int
    messages: int
    counted: Dict[str, int]


def attention_cost(mode: Union[str, SeqMode], counts: Sequence[int], heads: int, head_dim: int, itemsize: int, *,
                   batch: int = 1, replicated: int = 0) -> AttentionCost:
    """The modelled cost of one exact self-attention call (per rank), from shapes.

    Args:
        mode: ``gathered`` or ``ulysses``.
        counts: sharded tokens per rank (:attr:`TokenShards.seq_counts`: the image band, plus the text slice when
            the text is sharded).
        heads, head_dim, itemsize: of q/k/v.
        batch: batch size of the call.
        replicated: replicated (text) tokens in the joint sequence (0 when the text is sharded).

    Gathered: one all-gather of K and V packed, padded to the largest band: each rank sends ``2 * n_max * H * D``
    to N-1 peers. Ulysses: an all-to-all of q, k and v packed (``3 * n_max * H * D``, N-1 of N pieces leave) and one
    of the output (``n_max * H * D``), plus an all-gather of the replicated tokens' output over heads.
    """
    mode = SeqMode(mode)
    if mode is SeqMode.OVERLAPPED:  # the same one gather; it hides behind compute, which a byte count does not see
        mode = SeqMode.GATHERED
    n = len(counts)
    if n <= 1:
        return AttentionCost(0, 0, {})
    if mode is SeqMode.RING:  # gathered's piece to each of N-1 peers, one send (and one receive) per stage
        piece = 2 * max(counts) * batch * heads * head_dim * itemsize
        return AttentionCost(piece * (n - 1), n - 1, {"batch_isend_irecv": 0, "isend": piece * (n - 1), "irecv": piece * (n - 1)})
    n_max = max(counts)
    row = batch * heads * head_dim * itemsize
    if mode is SeqMode.GATHERED:
        piece = 2 * n_max * row
        counted = {"all_gather": piece * (n + 1)}  # N outputs + the input
        return AttentionCost(piece * (n - 1), 1, counted)
    if mode is SeqMode.ULYSSES:
        qkv = 3 * n_max * row  # this rank's whole send buffer (N pieces of heads/N)
        out = n_max * row
        counted = {"all_to_all_single": 2 * (qkv + out)}  # input + output buffers of both calls
        wire = (qkv + out) * (n - 1) // n
        messages = 2
        if replicated:
            piece = replicated * row // n
            counted["all_gather"] = piece * (n + 1)
            wire += piece * (n - 1)
            messages += 1
        return AttentionCost(wire, messages, counted)
    raise ValueError("attention_cost needs a concrete mode (gathered or ulysses), not auto")


def choose_mode(counts: Sequence[int], heads: int, head_dim: int, itemsize: int, *, batch: int = 1, replicated: int = 0,
                kv: PeerExchange = EXACT, link=None) -> SeqMode:
    """The ``auto`` rule: Ulysses where it is possible and modelled faster on ``link``, else gathered.

    * Gathered when there is one rank, when the heads do not divide by N, or when the K/V strategy is not the exact
      one (stale/displaced K/V live in the gathered memory).
    * Otherwise the two modes' modelled times on the link profile ``link`` (a ``topology.links`` profile or its
      name; default ``pcie4_x16_p2p``), ``messages * latency + wire_bytes / bandwidth``, decide; ties go to
      gathered (fewer messages). Per layer, gathered sends ``2(N-1) n H D`` and Ulysses ``4(N-1)/N n H D`` (plus the
      replicated tokens' output), so at N = 2 they move the same bytes and gathered wins on messages; from N = 3
      Ulysses moves fewer bytes (``N/2`` times fewer) and wins once the band is long enough to hide its extra
      messages.

    Every input is shared by all ranks (shapes, config, the link profile name), so every rank picks the same mode.
    """
    n = len(counts)
    if n <= 1 or heads % n or not isinstance(kv, ExactExchange):
        return SeqMode.GATHERED
    from ..topology.links import get_profile, model_latency_ms

    profile = get_profile(link or "pcie4_x16_p2p")
    costs = {}
    for mode in (SeqMode.GATHERED, SeqMode.ULYSSES):
        c = attention_cost(mode, counts, heads, head_dim, itemsize, batch=batch, replicated=replicated)
        costs[mode] = model_latency_ms(0.0, c.wire_bytes, c.messages, profile)
    return SeqMode.ULYSSES if costs[SeqMode.ULYSSES] < costs[SeqMode.GATHERED] else SeqMode.GATHERED
