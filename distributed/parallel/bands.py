"""The band table: how one dimension (latent rows, or a token sequence) is split across the ranks of a group.

Design decisions:

* **One splitter for every shard kind.** A VAE's latent rows, a UNet's latent rows (in units of its total
  downsampling, so every level's bands stay whole rows) and a DiT's token sequence are all split the same way:
  contiguous shards, the first ``units % world_size`` ranks one unit longer. :func:`split_extent` is that rule;
  :func:`row_bands` (rows, ``(start, stop)`` pairs), :func:`band_heights` (rows in units of ``align``) and
  :func:`token_shards` (a sequence, for sequence-parallel attention) are its named uses, so a row band and a
  token shard of the same extent are the same table.
* **Derived, never exchanged.** Every rank computes the same table from shared data (the extent and the world
  size), so no metadata collective is needed; a peer's extent of any tensor proportional to the band is this
  rank's extent times the ratio of the two bands (:func:`scaled_extents`).
* **Refusals name the fix** (fewer ranks, a taller image, a multiple of the alignment) and are raised
  identically on every rank, before any communication.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["split_extent", "row_bands", "band_heights", "token_shards", "bounds_of", "scaled_extents"]


def split_extent(units: int, world_size: int) -> Tuple[int, ...]:
    """``units`` split into ``world_size`` contiguous shards; the first ``units % world_size`` one unit longer.

    Example:
        >>> split_extent(7, 3)
        (3, 2, 2)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    base, extra = divmod(units, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def bounds_of(sizes: Sequence[int]) -> Tuple[int, ...]:
    """Offsets ``(0, s_0, s_0 + s_1, ..., total)`` of consecutive shards of ``sizes``."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def row_bands(latent_height: int, world_size: int, min_rows: int = 1) -> List[Tuple[int, int]]:
    """Split ``latent_height`` rows into ``world_size`` contiguous bands (the first ones one row taller if uneven).

    Raises:
        ValueError: when a band would hold fewer than ``min_rows`` rows; names the largest rank count that fits.

    Example:
        >>> row_bands(7, 3)
        [(0, 3), (3, 5), (5, 7)]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    if latent_height < world_size * min_rows:
        fits = max(1, latent_height // max(min_rows, 1))
        raise ValueError(
            f"a latent of {latent_height} rows cannot give each of {world_size} ranks {min_rows} row(s); "
            f"use at most {fits} ranks, or a taller image"
        )
    b = bounds_of(split_extent(latent_height, world_size))
    return [(b[r], b[r + 1]) for r in range(world_size)]


def band_heights(height: int, world_size: int, align: int) -> Tuple[int, ...]:
    """Row band heights for ``world_size`` ranks over ``height`` latent rows, each a multiple of ``align``.

    ``align`` is the model's total row downsampling (a UNet's), so every resolution level's bands are whole rows.
    Uneven by at most ``align`` rows. Raises ``ValueError`` naming the fix when the height cannot give every rank
    a band.

    Example:
        >>> band_heights(32, 3, 4)
        (12, 12, 8)
    """
    if height % align:
        raise ValueError(
            f"latent height {height} must be a multiple of {align} (the UNet downsamples rows by {align}); "
            f"use an image height that is a multiple of {align * 8} pixels"
        )
    units = height // align
    if units < world_size:
        raise ValueError(
            f"latent height {height} gives {units} row units of {align} for {world_size} ranks; every rank needs one: "
            f"use fewer ranks (<= {units}) or a taller image"
        )
    return tuple(u * align for u in split_extent(units, world_size))


def token_shards(length: int, world_size: int, align: int = 1) -> Tuple[int, ...]:
    """Token counts per rank for a sequence of ``length`` tokens (sequence parallelism), in units of ``align``.

    ``align`` keeps shards whole where the sequence has structure (e.g. the tokens of one latent row, or one
    patch row of a DiT), so a token shard that is a row band stays one. The same split as :func:`band_heights`.

    Example:
        >>> token_shards(10, 3)
        (4, 3, 3)
    """
    if length % align:
        raise ValueError(f"sequence length {length} must be a multiple of align={align}; pad the sequence or pick align")
    units = length // align
    if units < world_size:
        raise ValueError(f"{length} tokens give {units} shard units for {world_size} ranks; use fewer ranks (<= {units})")
    return tuple(u * align for u in split_extent(units, world_size))


def scaled_extents(sizes: Sequence[int], rank: int, local_extent: int) -> List[int]:
    """Every rank's extent of a dimension proportional to the shard, from ``rank``'s ``local_extent``."""
    return [local_extent * s // sizes[rank] for s in sizes]
