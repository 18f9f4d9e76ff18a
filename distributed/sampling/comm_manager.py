"""One owner of a parallelized model's stale-context memory and its asynchronous all-gathers.

Design decisions (after distrifuser's ``PatchParallelismCommManager``, without its globals):

* **Slots are registered during the first synchronous step** (the dry pass): each adapter says what it keeps
  (a key, a kind for the byte accounting, its local shape and which dimension scales with the rank's band). Every
  rank registers the same keys in the same order because it runs the same model, so the layout is identical on
  all ranks and needs no metadata collective: a peer's extent is this rank's extent times the ratio of the two
  latent bands, which every rank knows.
* **One flat memory per dtype**, ``(world_size, total)``: row ``r`` holds rank ``r``'s last value of every slot.
  Synchronous steps write what they gathered into it; stale modes read from it. Slots that stream every step
  (displaced halos and K/V, stale GroupNorm statistics) are laid out first, so an asynchronous all-gather of a
  contiguous chunk of them writes straight into the memory.
* **No double buffering is needed**: an adapter reads a slot's stale value before it enqueues the slot's fresh
  value, and a chunk's all-gather is issued only after all of its slots were enqueued, so the collective never
  overwrites a value still to be read in this step (on CUDA, the collective's stream waits for the compute
  stream at issue time).
* **Waiting happens in one place**: :meth:`CommManager.wait` at the start of the next step.
* The byte accounting (:class:`Traffic`) is plain Python arithmetic on shapes: it costs no synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..comm import all_gather_into
from ..context import ParallelContext

__all__ = ["KINDS", "Traffic", "CommManager", "async_all_gather_into"]

#: byte-accounting kinds, in report order
KINDS = ("halo", "kv", "groupnorm", "latent_blocks", "output", "cfg")


@dataclass
class Traffic:
    """Bytes this rank must deliver to its peers, and collectives it issued, by kind (per step and in total).

    An all-gather of ``b`` bytes per rank over ``n`` ranks counts ``b * (n - 1)`` (every peer needs a copy: the
    ``(p - 1) M`` of DistriFusion's and OTIL's cost model); a point-to-point send counts its bytes.
    """

    bytes: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    collectives: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    #: the part of ``bytes`` sent by asynchronous collectives (overlappable with compute)
    async_bytes: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})

    def add(self, kind: str, nbytes: int, collectives: int = 0, asynchronous: bool = False) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.collectives[kind] = self.collectives.get(kind, 0) + int(collectives)
        if asynchronous:
            self.async_bytes[kind] = self.async_bytes.get(kind, 0) + int(nbytes)

    def snapshot(self) -> dict:
        return {"bytes": dict(self.bytes), "collectives": dict(self.collectives), "async_bytes": dict(self.async_bytes)}

    @staticmethod
    def diff(after: dict, before: dict) -> dict:
        return {
            part: {k: after[part].get(k, 0) - before[part].get(k, 0) for k in after[part]}
            for part in ("bytes", "collectives", "async_bytes")
        }


def async_all_gather_into(outputs: List[torch.Tensor], send: torch.Tensor, ctx: ParallelContext):
    """Start an all-gather of ``send`` into ``outputs`` (one per rank) and return its work handle (``None`` when
    the call was blocking: gloo stages a CUDA tensor through the host).

    The asynchronous sibling of :func:`patchray.distributed.comm.all_gather_padded` (which is blocking).
    """
    return all_gather_into(outputs, send, ctx, async_op=True)


@dataclass
class _Slot:
    key: str
    kind: str
    dtype: torch.dtype
    shapes: Tuple[Tuple[int, ...], ...]  # per rank
    streamed: bool
    offset: int = -1
    temp: Optional[torch.Tensor] = None  # (world, max numel) until the layout is built

    @property
    def max_numel(self) -> int:
        return max(math.prod(s) for s in self.shapes)


class CommManager:
    """Owns the stale memory of one parallelized model and the asynchronous all-gathers that refresh it.

    Args:
        ctx: the patch group's context.
        rows: every rank's latent band height (rows), the same tuple on every rank.
        traffic: where bytes are counted.
        checkpoint: streamed slots per asynchronous all-gather.
    """

    def __init__(self, ctx: ParallelContext, rows: Sequence[int], traffic: Traffic, checkpoint: int = 60):
        self.ctx = ctx
        self.rows = tuple(rows)
        self.traffic = traffic
        self.checkpoint = checkpoint
        self._slots: List[_Slot] = []
        self._index: Dict[str, int] = {}
        self._laid_out = False
        self._mem: Dict[torch.dtype, torch.Tensor] = {}
        self._send: Dict[torch.dtype, torch.Tensor] = {}
        # per dtype: list of chunks (lo, hi, slot ids); per slot: (dtype, chunk index)
        self._chunks: Dict[torch.dtype, List[Tuple[int, int, List[int]]]] = {}
        self._slot_chunk: Dict[int, Tuple[torch.dtype, int]] = {}
        self._pending: Dict[Tuple[torch.dtype, int], int] = {}
        self._handles: list = []

    # ---------------------------------------------------------------- registration (the dry pass)

    def register(
        self, key: str, kind: str, shape: Sequence[int], like: torch.Tensor, scale_dim: Optional[int], streamed: bool
    ) -> int:
        """Register (once) or look up the slot ``key`` holding ``shape``-shaped tensors (``like``'s dtype/device).

        ``scale_dim`` is the dimension whose extent is proportional to the rank's band (None: same on every rank).
        """
        sid = self._index.get(key)
        if sid is not None:
            return sid
        if self._laid_out:
            # backstop, not the guard: the handle builds a new manager whenever the latent shape changes
            raise RuntimeError(f"slot {key!r} registered after the layout was built; the model's call graph changed")
        me = self.ctx.rank
        shapes = []
        for r in range(self.ctx.world_size):
            shape_r = list(shape)
            if scale_dim is not None:
                extent = shape_r[scale_dim] * self.rows[r]
                if extent % self.rows[me]:
                    raise ValueError(f"slot {key!r}: extent {shape_r[scale_dim]} is not proportional to the band table {self.rows}")
                shape_r[scale_dim] = extent // self.rows[me]
            shapes.append(tuple(shape_r))
        slot = _Slot(key, kind, like.dtype, tuple(shapes), streamed)
        slot.temp = torch.zeros(self.ctx.world_size, slot.max_numel, dtype=like.dtype, device=like.device)
        self._slots.append(slot)
        self._index[key] = len(self._slots) - 1
        return len(self._slots) - 1

    def build_layout(self) -> None:
        """Allocate the flat memories (streamed slots first) and move the dry pass's values in."""
        if self._laid_out:
            return
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for sid, s in enumerate(self._slots):
            by_dtype.setdefault(s.dtype, []).append(sid)
        for dtype, sids in by_dtype.items():
            ordered = [i for i in sids if self._slots[i].streamed] + [i for i in sids if not self._slots[i].streamed]
            offset = 0
            for i in ordered:
                self._slots[i].offset = offset
                offset += self._slots[i].max_numel
            device = self._slots[ordered[0]].temp.device
            mem = torch.zeros(self.ctx.world_size, offset, dtype=dtype, device=device)
            streamed = [i for i in ordered if self._slots[i].streamed]
            chunks = []
            for c in range(0, len(streamed), self.checkpoint):
                ids = streamed[c : c + self.checkpoint]
                lo = self._slots[ids[0]].offset
                hi = self._slots[ids[-1]].offset + self._slots[ids[-1]].max_numel
                for i in ids:
                    self._slot_chunk[i] = (dtype, len(chunks))
                chunks.append((lo, hi, ids))
            for i in ordered:
                s = self._slots[i]
                mem[:, s.offset : s.offset + s.max_numel].copy_(s.temp)
                s.temp = None
            self._mem[dtype] = mem
            self._send[dtype] = torch.zeros(chunks[-1][1] if chunks else 0, dtype=dtype, device=device)
            self._chunks[dtype] = chunks
        self._laid_out = True
        self._reset_pending()

    def _reset_pending(self):
        self._pending = {(dt, c): len(ids) for dt, chunks in self._chunks.items() for c, (_, _, ids) in enumerate(chunks)}

    # ---------------------------------------------------------------- access

    def view(self, sid: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s stored value of slot ``sid`` (a writable view of the memory)."""
        s = self._slots[sid]
        shape = s.shapes[rank]
        n = math.prod(shape)
        if s.temp is not None:
            return s.temp[rank, :n].view(shape)
        return self._mem[s.dtype][rank, s.offset : s.offset + n].view(shape)

    def enqueue(self, sid: int, fresh: torch.Tensor) -> None:
        """Copy this rank's fresh value of slot ``sid`` into the send buffer; start its chunk's all-gather when full."""
        s = self._slots[sid]
        if not (self._laid_out and s.streamed):
            # backstop, not the guard: adapters only enqueue streamed slots after the first synchronous step
            raise RuntimeError(f"slot {s.key!r} enqueued before the layout was built or without streamed=True")
        n = fresh.numel()
        self._send[s.dtype][s.offset : s.offset + n].copy_(fresh.reshape(-1))
        self.traffic.add(s.kind, n * fresh.element_size() * (self.ctx.world_size - 1), asynchronous=True)
        dtype, c = self._slot_chunk[sid]
        self._pending[(dtype, c)] -= 1
        if self._pending[(dtype, c)] == 0:
            self._issue(dtype, c)

    def _issue(self, dtype, c):
        lo, hi, ids = self._chunks[dtype][c]
        mem = self._mem[dtype]
        outputs = [mem[r, lo:hi] for r in range(self.ctx.world_size)]
        handle = async_all_gather_into(outputs, self._send[dtype][lo:hi], self.ctx)
        self.traffic.add(self._slots[ids[0]].kind, 0, collectives=1)
        if handle is not None:
            self._handles.append(handle)

    def flush(self) -> None:
        """Issue every chunk that was partly enqueued (a step that skipped some layers); called at step end."""
        for (dtype, c), left in list(self._pending.items()):
            _, _, ids = self._chunks[dtype][c]
            if 0 < left < len(ids):
                self._issue(dtype, c)
        self._reset_pending()

    def wait(self) -> None:
        """Wait for every in-flight all-gather: the one place this manager blocks."""
        for h in self._handles:
            h.wait()
        self._handles.clear()

    @property
    def laid_out(self) -> bool:
        return self._laid_out

    @property
    def num_slots(self) -> int:
        return len(self._slots)
