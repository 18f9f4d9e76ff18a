"""The token shard table of sequence parallelism: which tokens each rank owns, and how a sequence is cut to a
rank's tokens and put back in exact global order.

A rank owns a band of token rows (rows of the latent after patchify) in every frame, so a video's rank-local tokens
are not a contiguous piece of the frame-major sequence: :class:`TokenShards` holds each rank's token **index**, and
sharding, gathering and positional embeddings all go through that one index. Bands come from
:func:`~patchray.distributed.bands.row_bands` (or explicit row sizes), the same table as the VAE's and the UNet's row bands.

A joint-attention sequence may also carry a **sharded 1-D text segment** (``text_sizes``: contiguous slices of the
text tokens, the first ``T % N`` ranks one token more; a rank may hold none when ``T < N``). The table then has
three *parts*, each with its per-rank index: ``"image"`` (the row bands), ``"text"`` (the slices) and ``"joint"``
(the model's whole sequence, text before or after the image tokens: ``text_side``), and a rank's local joint
sequence is ``[its text slice, its image band]`` (or the other way round), in the model's own order. See
``sequence.py`` for the whole design.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence, Tuple

import torch

from ..comm import all_gather_padded
from ..context import ParallelContext
from ..bands import bounds_of, row_bands

__all__ = ["TokenShards", "shard_tokens", "gather_tokens", "shard_positions", "split_replicated", "text_split", "PARTS"]

#: the parts of a sequence a shard table indexes (see :meth:`TokenShards.part_index`)
PARTS = ("image", "text", "joint")


def text_split(total: int, world_size: int) -> Tuple[int, ...]:
    """Contiguous slices of ``total`` text tokens over ``world_size`` ranks: the first ``total % N`` one token more
    (512 over 3: 171, 171, 170; 2 over 3: 1, 1, 0).

    Example:
        >>> text_split(7, 3)
        (3, 2, 2)
    """
    if total < 0 or world_size < 1:
        raise ValueError(f"text_split needs total >= 0 and world_size >= 1 (got {total}, {world_size})")
    return tuple(total // world_size + (1 if r < total % world_size else 0) for r in range(world_size))


# --------------------------------------------------------------------------------------------------
# the token shard table


@dataclasses.dataclass(frozen=True)
class TokenShards:
    """Which tokens each rank owns: a band of image/video token rows in every frame, and a slice of the text.

    Args:
        frames, rows, cols: the token grid after patchify (``frames = 1`` for images).
        row_sizes: token rows per rank (sums to ``rows``); every rank derives the same table.
        text_sizes: text tokens per rank when the text of a joint sequence is sharded too (contiguous slices in
            rank order, :func:`text_split`); ``()``: the text (if any) is replicated on every rank.
        text_side: where the text sits in the model's joint sequence: ``"before"`` (FLUX.1, Qwen-Image) or
            ``"after"`` (HunyuanVideo) the image tokens.

    Use :meth:`split` to build one. Image tokens are numbered frame-major, ``t * rows * cols + row * cols + col``.

    Example:
        >>> s = TokenShards.split(frames=3, rows=5, cols=2, world_size=2)
        >>> s.row_sizes, s.counts
        ((3, 2), (18, 12))
        >>> s.index(1)[:4].tolist()   # frame 0: rows 3 and 4; then frame 1 ...
        [6, 7, 8, 9]
    """

    frames: int
    rows: int
    cols: int
    row_sizes: Tuple[int, ...]
    text_sizes: Tuple[int, ...] = ()
    text_side: str = "before"
    #: index tensors per (rank or "order", device), built once: every attention call of a step reuses them (the
    #: derived counts are ``functools.cached_property`` values, kept in the instance dict for the same reason)
    _cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        if min(self.frames, self.rows, self.cols) < 1:
            raise ValueError(f"token grid must be positive (got frames={self.frames}, rows={self.rows}, cols={self.cols})")
        if sum(self.row_sizes) != self.rows or min(self.row_sizes) < 1:
            raise ValueError(f"row_sizes {self.row_sizes} must be positive and sum to rows={self.rows}")
        if self.text_sizes and (len(self.text_sizes) != len(self.row_sizes) or min(self.text_sizes) < 0):
            raise ValueError(f"text_sizes {self.text_sizes} needs one count >= 0 per rank ({len(self.row_sizes)} ranks)")
        if self.text_side not in ("before", "after"):
            raise ValueError(f"text_side must be 'before' or 'after' (got {self.text_side!r})")

    @classmethod
    def split(cls, frames: int, rows: int, cols: int, world_size: int, row_sizes: Optional[Sequence[int]] = None,
              weights: Optional[Sequence[float]] = None, text: int = 0, text_side: str = "before") -> "TokenShards":
        """The shard table for ``world_size`` ranks: equal bands (:func:`~patchray.distributed.bands.row_bands`), bands proportional to
        ``weights`` (the group's band weights), or ``row_sizes``; with ``text > 0`` the joint sequence's ``text``
        tokens are sharded too (:func:`text_split`, on ``text_side`` of the image tokens).

        Raises:
            ValueError: fewer token rows than ranks (names the largest rank count that fits).
        """
        if row_sizes is None:
            row_sizes = tuple(b - a for a, b in row_bands(rows, world_size, weights=weights))
        elif len(row_sizes) != world_size:
            raise ValueError(f"row_sizes needs one entry per rank (got {len(row_sizes)} for world_size {world_size})")
        texts = text_split(int(text), world_size) if text else ()
        return cls(frames, rows, cols, tuple(int(r) for r in row_sizes), texts, text_side)

    @property
    def world_size(self) -> int:
        return len(self.row_sizes)

    @functools.cached_property
    def total(self) -> int:
        """Image/video tokens in all."""
        return self.frames * self.rows * self.cols

    @functools.cached_property
    def counts(self) -> Tuple[int, ...]:
        """Tokens per rank."""
        return tuple(self.frames * r * self.cols for r in self.row_sizes)

    @functools.cached_property
    def row_bounds(self) -> Tuple[int, ...]:
        return bounds_of(self.row_sizes)

    @functools.cached_property
    def text_sharded(self) -> bool:
        """Whether the text of a joint sequence is sharded (part of every rank's local sequence)."""
        return bool(self.text_sizes)

    @functools.cached_property
    def text(self) -> int:
        """Sharded text tokens in all (0: none, or the text is replicated)."""
        return sum(self.text_sizes)

    @functools.cached_property
    def text_counts(self) -> Tuple[int, ...]:
        """Sharded text tokens per rank (zeros when the text is not sharded)."""
        return self.text_sizes or (0,) * self.world_size

    @functools.cached_property
    def seq_counts(self) -> Tuple[int, ...]:
        """Sharded tokens per rank of the joint sequence: its text slice and its image band (the image band alone
        without sharded text). Every rank holds at least one (an image band is never empty)."""
        return tuple(t + i for t, i in zip(self.text_counts, self.counts))

    @functools.cached_property
    def seq_total(self) -> int:
        return self.text + self.total

    def part_counts(self, part: str) -> Tuple[int, ...]:
        """Tokens per rank of ``part`` (:data:`PARTS`)."""
        return {"image": self.counts, "text": self.text_counts, "joint": self.seq_counts}[_part(part)]

    def part_index(self, part: str, rank: int, device=None) -> torch.Tensor:
        """Rank ``rank``'s token positions in the whole sequence of ``part``, in the rank's local order:
        ``"image"`` (:meth:`index`), ``"text"`` (its slice of the text) or ``"joint"`` (its text slice and image
        band in the model's order, positions in the joint sequence)."""
        part = _part(part)
        if part == "image":
            return self.index(rank, device)
        key = (part, rank, str(device))
        if key not in self._cache:
            tb = bounds_of(self.text_counts)
            txt = torch.arange(tb[rank], tb[rank + 1], device=device)
            if part == "text":
                self._cache[key] = txt
            elif self.text_side == "before":
                self._cache[key] = torch.cat([txt, self.text + self.index(rank, device)])
            else:
                self._cache[key] = torch.cat([self.index(rank, device), self.total + txt])
        return self._cache[key]

    def part_order(self, part: str, device=None) -> torch.Tensor:
        """The global position of each token of ``part``'s rank-major gathered sequence."""
        part = _part(part)
        if part == "image":
            return self.order(device)
        key = (part, "order", str(device))
        if key not in self._cache:
            self._cache[key] = torch.cat([self.part_index(part, r, device) for r in range(self.world_size)])
        return self._cache[key]

    def index(self, rank: int, device=None) -> torch.Tensor:
        """Rank ``rank``'s token positions in the flattened sequence, ascending (a ``LongTensor``; do not modify)."""
        key = (rank, str(device))
        if key not in self._cache:
            self._cache[key] = self._index(rank, device)
        return self._cache[key]

    def _index(self, rank: int, device=None) -> torch.Tensor:
        lo, hi = self.row_bounds[rank], self.row_bounds[rank + 1]
        t = torch.arange(self.frames, device=device).view(-1, 1, 1) * (self.rows * self.cols)
        r = torch.arange(lo, hi, device=device).view(1, -1, 1) * self.cols
        c = torch.arange(self.cols, device=device).view(1, 1, -1)
        return (t + r + c).reshape(-1)

    def order(self, device=None) -> torch.Tensor:
        """The global position of each token of the rank-major gathered sequence (every rank's index in turn)."""
        key = ("order", str(device))
        if key not in self._cache:
            self._cache[key] = torch.cat([self.index(r, device) for r in range(self.world_size)])
        return self._cache[key]


def _part(part: str) -> str:
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS} (got {part!r})")
    return part


def split_replicated(x: torch.Tensor, dim: int, before: int, after: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[dim] - before - after
    if n < 0:
        raise ValueError(f"{before} + {after} replicated tokens exceed the sequence of {x.shape[dim]} along dim {dim}")
    return x.narrow(dim, 0, before), x.narrow(dim, before, n), x.narrow(dim, before + n, after)


def shard_tokens(x_full: torch.Tensor, shards: TokenShards, rank: int, *, dim: int = 1, before: int = 0, after: int = 0,
                 part: str = "image") -> torch.Tensor:
    """This rank's tokens of a full sequence: ``before`` leading and ``after`` trailing replicated tokens kept whole,
    the image/video tokens between them selected by the rank's index (global order kept).

    ``part="text"``: ``x_full`` is the whole text, cut to this rank's slice; ``part="joint"``: ``x_full`` is the
    model's whole joint sequence (text and image tokens, text on ``shards.text_side``), cut to this rank's
    ``[text slice, image band]`` in the model's order (both need a table with sharded text; no replicated tokens)."""
    dim = dim % x_full.dim()
    if _part(part) != "image":
        if before or after:
            raise ValueError("a sharded text or joint sequence has no replicated tokens (before/after must be 0)")
        want = shards.text if part == "text" else shards.seq_total
        if not shards.text_sharded or x_full.shape[dim] != want:
            raise ValueError(f"expected the {part} sequence of {want} tokens along dim {dim} (text sharded: "
                             f"{shards.text_sharded}), got {x_full.shape[dim]}")
        return x_full.index_select(dim, shards.part_index(part, rank, x_full.device))
    head, img, tail = split_replicated(x_full, dim, before, after)
    if img.shape[dim] != shards.total:
        raise ValueError(
            f"expected {shards.total} image tokens ({shards.frames}x{shards.rows}x{shards.cols}) along dim {dim}, "
            f"got {img.shape[dim]}"
        )
    local = img.index_select(dim, shards.index(rank, x_full.device))
    if not before and not after:
        return local
    return torch.cat([head, local, tail], dim=dim)


def shard_positions(freqs: Any, shards: TokenShards, rank: int, *, dim: int = 0, before: int = 0, after: int = 0,
                    part: str = "image") -> Any:
    """The positional embedding of this rank's tokens: :func:`shard_tokens` on a tensor (real or complex: RoPE
    cos, sin or complex frequencies) or on each tensor of a tuple/list, along ``dim`` (the sequence dimension of
    that layout, e.g. 0 for ``[L, D]``, 1 for ``[B, L, D]`` or ``[1, L, 1, D]``); ``part`` as there (a FLUX.1
    table over ``[text ids, image ids]`` with sharded text is ``part="joint"``)."""
    if isinstance(freqs, torch.Tensor):
        return shard_tokens(freqs, shards, rank, dim=dim, before=before, after=after, part=part)
    if isinstance(freqs, (tuple, list)):
        return type(freqs)(shard_positions(f, shards, rank, dim=dim, before=before, after=after, part=part) for f in freqs)
    raise TypeError(f"positional embedding must be a tensor or a tuple of tensors (got {type(freqs).__name__})")


def gather_tokens(x_local: torch.Tensor, shards: TokenShards, ctx: ParallelContext, *, dim: int = 1, before: int = 0, after: int = 0) -> torch.Tensor:
    """The full sequence in exact global order from every rank's :func:`shard_tokens` output (one all-gather).

    Replicated tokens are taken from this rank (they are the same on every rank)."""
    if ctx.world_size == 1:
        return x_local
    dim = dim % x_local.dim()
    head, img, tail = split_replicated(x_local, dim, before, after)
    gathered = all_gather_padded(img.contiguous(), ctx, dim=dim, sizes=list(shards.counts))
    full = torch.empty_like(gathered).index_copy_(dim, shards.order(gathered.device), gathered)
    if not before and not after:
        return full
    return torch.cat([head, full, tail], dim=dim)
