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
* **Compressed slots** (``bits`` > 0 at registration: the compressed-residual K/V and halo exchange) live in pools
  of their own, one per ``(dtype, bits)``, each slot padded to whole groups of :data:`GROUP` elements. When a chunk
  is full its residual against this rank's row of the memory (what the peers hold of it) is quantised per group
  (``parallel/quantize.py``), this rank's row becomes ``base + dequantize(codes)`` at once, and the packed codes
  and scales travel in one asynchronous all-gather of bytes; :meth:`CommManager.wait` adds every peer's decoded
  residual to that peer's row. Sender and receivers run the same arithmetic on the same bytes, so every peer's copy
  equals the sender's reference bit for bit and quantisation error does not accumulate (error feedback). The
  accounting counts the packed bytes that travel.
* **The codec runs fused on GPU ranks** (:func:`encode_residual` / :func:`apply_residual`, ``codec``): op by op
  it makes a dozen passes over float32 temporaries (measured on an H200: 27.5 ms per GB of bf16 stream to encode,
  9.6 to apply); ``torch.compile`` fuses each side into a few kernels (5.0 / 2.6 ms per GB), and two hand-written
  Triton kernels (:mod:`.codec_triton`) read and write each byte once (1.3 / 0.7 ms per GB). Every rank of the group lists the codecs it
  can run when the layout is built (CUDA with Triton for the fused ones; ``PATCHRAY_CODEC`` caps the choice) and the
  group takes the fastest all of them can, in the one all-gather of that step, so senders and receivers always run
  the same code. The sender moves its reference by applying its own payload with the receivers' function.
* The byte accounting (:class:`Traffic`) is plain Python arithmetic on shapes: it costs no synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..comm import all_gather_into, all_gather_object
from ..context import ParallelContext
from ..parallel.quantize import code_bytes, dequantize, quantize

__all__ = ["KINDS", "GROUP", "Traffic", "CommManager", "async_all_gather_into", "packed_bytes", "encode_residual",
           "apply_residual", "CODECS", "codec_kinds", "agree_codec"]

#: elements per quantisation group (one float32 scale each) of a compressed slot
GROUP = 256


def packed_bytes(numel: int, bits: int, group: Optional[int] = None) -> int:
    """Bytes one rank sends for a compressed slot of ``numel`` elements (padded to whole groups): codes + scales."""
    group = GROUP if group is None else group
    rows = math.ceil(numel / group)
    return rows * (code_bytes(group, bits) + 4)

def _residual_codes(fresh: torch.Tensor, ref: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``fresh - ref`` per group of :data:`GROUP` elements (both flat, whole groups)."""
    return quantize(fresh.float().view(-1, GROUP) - ref.float().view(-1, GROUP), bits)


def _rebase(row: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bits: int) -> None:
    """``row <- row + dequantize(codes)`` in place."""
    row.copy_((row.float().view(-1, GROUP) + dequantize(codes, scale, bits, GROUP)).reshape(-1).to(row.dtype))


# One pair of functions per code width, each passing its width as a literal: ``torch.compile`` caches by code object,
# and a width passed in as a value would become a symbolic integer once a second width runs (which PyTorch 2.11's
# tracing of ``1 << bits`` fails on); a literal stays a constant.
def _codes1(fresh, ref):
    return _residual_codes(fresh, ref, 1)


def _codes2(fresh, ref):
    return _residual_codes(fresh, ref, 2)


def _codes4(fresh, ref):
    return _residual_codes(fresh, ref, 4)


def _codes8(fresh, ref):
    return _residual_codes(fresh, ref, 8)


def _rebase1(row, codes, scale):
    _rebase(row, codes, scale, 1)


def _rebase2(row, codes, scale):
    _rebase(row, codes, scale, 2)


def _rebase4(row, codes, scale):
    _rebase(row, codes, scale, 4)


def _rebase8(row, codes, scale):
    _rebase(row, codes, scale, 8)


_EAGER = {1: (_codes1, _rebase1), 2: (_codes2, _rebase2), 4: (_codes4, _rebase4), 8: (_codes8, _rebase8)}
_COMPILED: Dict[int, tuple] = {}

#: the codec implementations, fastest first: ``triton`` (two fused kernels, ``codec_triton``), ``compiled`` (the
#: op-by-op functions through ``torch.compile``), ``eager`` (op by op; every rank can run it)
CODECS = ("triton", "compiled", "eager")


def _codec(bits: int, codec: str) -> tuple:
    """The two op-by-op codec functions for ``bits``, eager or each compiled once by ``torch.compile`` into fused
    kernels (sizes dynamic, so every chunk size shares one compilation)."""
    if bits not in _EAGER:
        raise ValueError(f"compressed exchange widths are {sorted(_EAGER)} bits (got {bits})")
    if codec == "eager":
        return _EAGER[bits]
    if bits not in _COMPILED:
        _COMPILED[bits] = tuple(torch.compile(f, dynamic=True, fullgraph=True) for f in _EAGER[bits])
    return _COMPILED[bits]


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)} (got {codec!r})")


def encode_residual(fresh: torch.Tensor, ref: torch.Tensor, bits: int, codec: str = "eager") -> torch.Tensor:
    """Quantise ``fresh - ref`` per group of :data:`GROUP` elements (both flat, a whole number of groups), return the
    packed bytes to send (per group its codes, then its float32 scale), and move ``ref`` (this rank's reference: what
    every peer holds of it) on by the decoded residual, through :func:`apply_residual` itself: the sender and every
    receiver run the same function on the same bytes, so their copies stay equal bit for bit (error feedback).
    ``codec``: one of :data:`CODECS`; every rank of a group must use the same one."""
    _check_codec(codec)
    if codec == "triton":
        from . import codec_triton

        payload = codec_triton.encode(fresh, ref, bits, GROUP)
    else:
        c, scale = _codec(bits, codec)[0](fresh, ref)
        payload = torch.cat([c, scale.view(torch.uint8).reshape(-1, 4)], dim=1).reshape(-1)
    apply_residual(ref, payload, bits, codec)
    return payload


def apply_residual(row: torch.Tensor, payload: torch.Tensor, bits: int, codec: str = "eager") -> None:
    """Add the residual that ``payload`` (from :func:`encode_residual`) packs to ``row`` in place: a receiver's copy
    of the sender's reference, or the sender's reference itself."""
    _check_codec(codec)
    if codec == "triton":
        from . import codec_triton

        codec_triton.apply(row, payload, bits, GROUP)
        return
    ncode = code_bytes(GROUP, bits)
    rows = payload.view(-1, ncode + 4)
    scale = rows[:, ncode:].contiguous().view(torch.float32).reshape(-1)
    _codec(bits, codec)[1](row, rows[:, :ncode], scale)


def codec_kinds(device: torch.device, widths: Sequence[int] = (1, 2, 4, 8)) -> List[str]:
    """The codecs (:data:`CODECS` order) this process offers on ``device``: ``eager`` always, and before it the first
    fused one that runs here: ``triton``, else ``compiled`` (CUDA with Triton; ``PATCHRAY_CODEC=compiled`` starts at
    ``compiled``, ``=eager`` offers only ``eager``), each tried on a small chunk of each of ``widths`` (``compiled``
    compiles once per width and process, a few seconds); a failure drops that codec, it is not an error."""
    import importlib.util
    import os

    wanted = os.environ.get("PATCHRAY_CODEC", "triton")
    if wanted not in CODECS:
        raise ValueError(f"PATCHRAY_CODEC must be one of {', '.join(CODECS)} (got {wanted!r})")
    # Triton's interpreter (TRITON_INTERPRET=1, how CI runs the kernels) executes them on CPU tensors
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if (device.type != "cuda" and not interpreted) or wanted == "eager" or importlib.util.find_spec("triton") is None:
        return ["eager"]  # Triton is absent on many Windows installs
    kinds = []
    # under the interpreter only the Triton kernels: torch.compile's CPU kernels are C++, not Triton
    for kind in (("triton",) if interpreted else CODECS[CODECS.index(wanted):-1]):
        try:
            for bits in widths:
                x = torch.randn(4 * GROUP, device=device, dtype=torch.float16)
                ref, peer = torch.zeros_like(x), torch.zeros_like(x)
                apply_residual(peer, encode_residual(x, ref, bits, kind), bits, kind)
                if not torch.equal(ref, peer) or not torch.isfinite(ref).all():
                    raise RuntimeError("the sender's and the receiver's copies differ")
            kinds.append(kind)
            break  # the fastest that runs; the slower fused one is not compiled for nothing
        except Exception:  # noqa: BLE001 - a codec that cannot run here is left out
            continue
    return kinds + ["eager"]


def agree_codec(kinds_by_rank: Sequence[Sequence[str]]) -> str:
    """The fastest codec every rank can run (``eager`` at worst)."""
    for kind in CODECS:
        if all(kind in k for k in kinds_by_rank):
            return kind
    return "eager"


#: byte-accounting kinds, in report order
KINDS = ("halo", "kv", "groupnorm", "latent_blocks", "output", "cfg", "modulation")


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
    bits: int = 0
    offset: int = -1
    temp: Optional[torch.Tensor] = None  # (world, max numel) until the layout is built

    @property
    def pool(self) -> Tuple[torch.dtype, int]:
        return (self.dtype, self.bits)

    @property
    def max_numel(self) -> int:
        return max(math.prod(s) for s in self.shapes)

    @property
    def stored_numel(self) -> int:
        """Elements the slot occupies in its pool (a compressed slot is padded to whole groups)."""
        n = self.max_numel
        return n if not self.bits else math.ceil(n / GROUP) * GROUP


Pool = Tuple[torch.dtype, int]


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
        self._mem: Dict[Pool, torch.Tensor] = {}
        self._send: Dict[Pool, torch.Tensor] = {}
        # per pool: list of chunks (lo, hi, slot ids); per slot: (pool, chunk index)
        self._chunks: Dict[Pool, List[Tuple[int, int, List[int]]]] = {}
        self._slot_chunk: Dict[int, Tuple[Pool, int]] = {}
        self._pending: Dict[Tuple[Pool, int], int] = {}
        self._handles: list = []
        # compressed pools: per chunk, the gathered packed bytes (world, nbytes); chunks whose residuals await decoding
        self._recv: Dict[Tuple[Pool, int], torch.Tensor] = {}
        self._to_decode: List[Tuple[Pool, int]] = []
        #: the compressed pools' codec (:data:`CODECS`), decided by every rank together when the layout is built
        self.codec = "eager"
        #: packed bytes this rank sent per compressed chunk in the last step (for tests and reports)
        self.last_packed: Dict[Tuple[Pool, int], int] = {}

    # ---------------------------------------------------------------- registration (the dry pass)

    def register(
        self, key: str, kind: str, shape: Sequence[int], like: torch.Tensor, scale_dim: Optional[int], streamed: bool,
        bits: int = 0,
    ) -> int:
        """Register (once) or look up the slot ``key`` holding ``shape``-shaped tensors (``like``'s dtype/device).

        ``scale_dim`` is the dimension whose extent is proportional to the rank's band (None: same on every rank).
        ``bits`` > 0 makes a streamed slot compressed: its refreshes travel as ``bits``-bit residuals with error
        feedback (see the module docstring).
        """
        sid = self._index.get(key)
        if sid is not None:
            return sid
        if self._laid_out:
            # backstop, not the guard: the handle builds a new manager whenever the latent shape changes
            raise RuntimeError(f"slot {key!r} registered after the layout was built; the model's call graph changed")
        if bits and not streamed:
            raise ValueError(f"slot {key!r}: compressed slots (bits={bits}) must be streamed")
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
        slot = _Slot(key, kind, like.dtype, tuple(shapes), streamed, int(bits))
        slot.temp = torch.zeros(self.ctx.world_size, slot.max_numel, dtype=like.dtype, device=like.device)
        self._slots.append(slot)
        self._index[key] = len(self._slots) - 1
        return len(self._slots) - 1

    def build_layout(self) -> None:
        """Allocate the flat memories (streamed slots first) and move the dry pass's values in."""
        if self._laid_out:
            return
        by_pool: Dict[Pool, List[int]] = {}
        for sid, s in enumerate(self._slots):
            by_pool.setdefault(s.pool, []).append(sid)
        for pool, sids in by_pool.items():
            dtype, bits = pool
            ordered = [i for i in sids if self._slots[i].streamed] + [i for i in sids if not self._slots[i].streamed]
            offset = 0
            for i in ordered:
                self._slots[i].offset = offset
                offset += self._slots[i].stored_numel
            device = self._slots[ordered[0]].temp.device
            mem = torch.zeros(self.ctx.world_size, offset, dtype=dtype, device=device)
            streamed = [i for i in ordered if self._slots[i].streamed]
            chunks = []
            for c in range(0, len(streamed), self.checkpoint):
                ids = streamed[c : c + self.checkpoint]
                lo = self._slots[ids[0]].offset
                hi = self._slots[ids[-1]].offset + self._slots[ids[-1]].stored_numel
                for i in ids:
                    self._slot_chunk[i] = (pool, len(chunks))
                if bits:
                    nbytes = packed_bytes(hi - lo, bits)
                    self._recv[(pool, len(chunks))] = torch.zeros(self.ctx.world_size, nbytes, dtype=torch.uint8, device=device)
                chunks.append((lo, hi, ids))
            for i in ordered:
                s = self._slots[i]
                mem[:, s.offset : s.offset + s.max_numel].copy_(s.temp)
                s.temp = None
            self._mem[pool] = mem
            self._send[pool] = torch.zeros(chunks[-1][1] if chunks else 0, dtype=dtype, device=device)
            self._chunks[pool] = chunks
        widths = sorted({bits for _, bits in self._chunks if bits})
        if widths:
            # the compiled codec where every rank of the group can run it, else the eager one on all: a sender and
            # its receivers must run the same arithmetic for their copies to stay equal bit for bit
            device = next(iter(self._mem.values())).device
            self.codec = agree_codec(all_gather_object(codec_kinds(device, widths), self.ctx))
        self._laid_out = True
        self._reset_pending()

    def _reset_pending(self):
        self._pending = {(p, c): len(ids) for p, chunks in self._chunks.items() for c, (_, _, ids) in enumerate(chunks)}

    # ---------------------------------------------------------------- access

    def view(self, sid: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s stored value of slot ``sid`` (a writable view of the memory). For a compressed slot, this
        rank's own row is the reference: what every peer holds of this rank's value."""
        s = self._slots[sid]
        shape = s.shapes[rank]
        n = math.prod(shape)
        if s.temp is not None:
            return s.temp[rank, :n].view(shape)
        return self._mem[s.pool][rank, s.offset : s.offset + n].view(shape)

    def enqueue(self, sid: int, fresh: torch.Tensor) -> None:
        """Copy this rank's fresh value of slot ``sid`` into the send buffer; start its chunk's all-gather when full."""
        s = self._slots[sid]
        if not (self._laid_out and s.streamed):
            # backstop, not the guard: adapters only enqueue streamed slots after the first synchronous step
            raise RuntimeError(f"slot {s.key!r} enqueued before the layout was built or without streamed=True")
        n = fresh.numel()
        self._send[s.pool][s.offset : s.offset + n].copy_(fresh.reshape(-1))
        if not s.bits:
            self.traffic.add(s.kind, n * fresh.element_size() * (self.ctx.world_size - 1), asynchronous=True)
        pool, c = self._slot_chunk[sid]
        self._pending[(pool, c)] -= 1
        if self._pending[(pool, c)] == 0:
            self._issue(pool, c)

    def _issue(self, pool, c):
        lo, hi, ids = self._chunks[pool][c]
        mem = self._mem[pool]
        dtype, bits = pool
        if bits:
            send = self._encode(pool, lo, hi, bits, ids)
            outputs = [self._recv[(pool, c)][r] for r in range(self.ctx.world_size)]
            self._to_decode.append((pool, c))
        else:
            send = self._send[pool][lo:hi]
            outputs = [mem[r, lo:hi] for r in range(self.ctx.world_size)]
        handle = async_all_gather_into(outputs, send, self.ctx)
        self.traffic.add(self._slots[ids[0]].kind, 0, collectives=1)
        if handle is not None:
            self._handles.append(handle)

    def _encode(self, pool, lo: int, hi: int, bits: int, ids: List[int]) -> torch.Tensor:
        """Quantise this chunk's residual against this rank's reference row, update the reference (error feedback),
        count the packed bytes by kind, and return the bytes to all-gather."""
        payload = encode_residual(self._send[pool][lo:hi], self._mem[pool][self.ctx.rank, lo:hi], bits, self.codec)
        per_group = code_bytes(GROUP, bits) + 4
        peers = self.ctx.world_size - 1
        for i in ids:
            s = self._slots[i]
            self.traffic.add(s.kind, (s.stored_numel // GROUP) * per_group * peers, asynchronous=True)
        self.last_packed[(pool, self._slot_chunk[ids[0]][1])] = payload.numel()
        return payload

    def _decode(self) -> None:
        """Add every peer's received residuals to that peer's row (the same arithmetic the sender ran).

        A host that samples under ``torch.inference_mode`` (ComfyUI) made the memory an inference tensor; the last
        wait may come after it left that mode, so the update runs in the memory's own mode."""
        inference = any(m.is_inference() for m in self._mem.values())
        with torch.inference_mode(inference):
            self._decode_all()

    def _decode_all(self) -> None:
        me = self.ctx.rank
        for pool, c in self._to_decode:
            lo, hi, _ = self._chunks[pool][c]
            bits = pool[1]
            recv = self._recv[(pool, c)]
            mem = self._mem[pool]
            for r in range(self.ctx.world_size):
                if r != me:
                    apply_residual(mem[r, lo:hi], recv[r], bits, self.codec)
        self._to_decode.clear()

    def flush(self) -> None:
        """Issue every chunk that was partly enqueued (a step that skipped some layers); called at step end."""
        for (pool, c), left in list(self._pending.items()):
            _, _, ids = self._chunks[pool][c]
            if 0 < left < len(ids):
                self._issue(pool, c)
        self._reset_pending()

    def wait(self) -> None:
        """Wait for every in-flight all-gather and decode what arrived: the one place this manager blocks."""
        for h in self._handles:
            h.wait()
        self._handles.clear()
        if self._to_decode:
            self._decode()

    @property
    def laid_out(self) -> bool:
        return self._laid_out

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def slot(self, key: str) -> Optional[int]:
        """The id of slot ``key`` (``None`` if not registered)."""
        return self._index.get(key)

    @property
    def slots(self) -> Tuple[Tuple[str, str, int, int], ...]:
        """Every slot as ``(key, kind, bits, elements stored)``, in registration order (reports and tests)."""
        return tuple((s.key, s.kind, s.bits, s.stored_numel) for s in self._slots)
