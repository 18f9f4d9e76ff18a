"""The token shard table of sequence parallelism: which image/video tokens each rank owns, and how a sequence is
cut to a rank's tokens and put back in exact global order.

A rank owns a band of token rows (rows of the latent after patchify) in every frame, so a video's rank-local tokens
are not a contiguous piece of the frame-major sequence: :class:`TokenShards` holds each rank's token **index**, and
sharding, gathering and positional embeddings all go through that one index. Bands come from
:func:`~.bands.row_bands` (or explicit row sizes), the same table as the VAE's and the UNet's row bands. See
``sequence.py`` for the whole design.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Tuple

import torch

from ..comm import all_gather_padded
from ..context import ParallelContext
from .bands import bounds_of, row_bands

__all__ = ["TokenShards", "shard_tokens", "gather_tokens", "shard_positions", "split_replicated"]


# --------------------------------------------------------------------------------------------------
# the token shard table


@dataclasses.dataclass(frozen=True)
class TokenShards:
    """Which image/video tokens each rank owns: a band of token rows in every frame.

    Args:
        frames, rows, cols: the token grid after patchify (``frames = 1`` for images).
        row_sizes: token rows per rank (sums to ``rows``); every rank derives the same table.

    Use :meth:`split` to build one. Tokens are numbered frame-major, ``t * rows * cols + row * cols + col``.

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
    #: index tensors per (rank or "order", device), built once: every attention call of a step reuses them
    _cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        if min(self.frames, self.rows, self.cols) < 1:
            raise ValueError(f"token grid must be positive (got frames={self.frames}, rows={self.rows}, cols={self.cols})")
        if sum(self.row_sizes) != self.rows or min(self.row_sizes) < 1:
            raise ValueError(f"row_sizes {self.row_sizes} must be positive and sum to rows={self.rows}")

    @classmethod
    def split(cls, frames: int, rows: int, cols: int, world_size: int, row_sizes: Optional[Sequence[int]] = None,
              weights: Optional[Sequence[float]] = None) -> "TokenShards":
        """The shard table for ``world_size`` ranks: equal bands (:func:`~.bands.row_bands`), bands proportional to
        ``weights`` (the group's band weights), or ``row_sizes``.

        Raises:
            ValueError: fewer token rows than ranks (names the largest rank count that fits).
        """
        if row_sizes is None:
            row_sizes = tuple(b - a for a, b in row_bands(rows, world_size, weights=weights))
        elif len(row_sizes) != world_size:
            raise ValueError(f"row_sizes needs one entry per rank (got {len(row_sizes)} for world_size {world_size})")
        return cls(frames, rows, cols, tuple(int(r) for r in row_sizes))

    @property
    def world_size(self) -> int:
        return len(self.row_sizes)

    @property
    def total(self) -> int:
        """Image/video tokens in all."""
        return self.frames * self.rows * self.cols

    @property
    def counts(self) -> Tuple[int, ...]:
        """Tokens per rank."""
        return tuple(self.frames * r * self.cols for r in self.row_sizes)

    @property
    def row_bounds(self) -> Tuple[int, ...]:
        return bounds_of(self.row_sizes)

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


def split_replicated(x: torch.Tensor, dim: int, before: int, after: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[dim] - before - after
    if n < 0:
        raise ValueError(f"{before} + {after} replicated tokens exceed the sequence of {x.shape[dim]} along dim {dim}")
    return x.narrow(dim, 0, before), x.narrow(dim, before, n), x.narrow(dim, before + n, after)


def shard_tokens(x_full: torch.Tensor, shards: TokenShards, rank: int, *, dim: int = 1, before: int = 0, after: int = 0) -> torch.Tensor:
    """This rank's tokens of a full sequence: ``before`` leading and ``after`` trailing replicated tokens kept whole,
    the image/video tokens between them selected by the rank's index (global order kept)."""
    dim = dim % x_full.dim()
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


def shard_positions(freqs: Any, shards: TokenShards, rank: int, *, dim: int = 0, before: int = 0, after: int = 0) -> Any:
    """The positional embedding of this rank's tokens: :func:`shard_tokens` on a tensor (real or complex: RoPE
    cos, sin or complex frequencies) or on each tensor of a tuple/list, along ``dim`` (the sequence dimension of
    that layout, e.g. 0 for ``[L, D]``, 1 for ``[B, L, D]`` or ``[1, L, 1, D]``)."""
    if isinstance(freqs, torch.Tensor):
        return shard_tokens(freqs, shards, rank, dim=dim, before=before, after=after)
    if isinstance(freqs, (tuple, list)):
        return type(freqs)(shard_positions(f, shards, rank, dim=dim, before=before, after=after) for f in freqs)
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
