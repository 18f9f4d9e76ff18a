"""The band table: how one dimension (latent rows, or a token sequence) is split across the ranks of a group.

Design decisions:

* **Below every layer that splits.** The parallel context validates its band weights with it, and the adapters,
  the VAE planner and the sampling split all derive their tables from it; it needs nothing but arithmetic, so it
  sits beside the context at the bottom of the package, where every one of them may import it.
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
* **Speed-weighted bands are the same table with weights.** Mixed cards (a 4090 beside a 3090) finish equal bands
  at different times, and every layer waits for the slowest. ``weights`` (one positive figure per rank, e.g. each
  rank's measured throughput) give rank ``r`` about ``units * w_r / sum(w)`` units: the largest-remainder
  (Hamilton) apportionment, computed in integers from the weights quantised to parts per million of the largest,
  so every rank that holds the same figures derives the same table bit for bit (no float rounding can make two
  ranks disagree), ties going to the lower rank. Every band keeps at least ``min_units`` units; a request where a
  band would be empty (or below the minimum) is refused naming the fix, never silently re-shaped.
"""

from __future__ import annotations

import math

from typing import List, Optional, Sequence, Tuple

__all__ = [
    "split_extent", "weighted_split", "quantize_weights", "row_bands", "band_heights", "token_shards", "bounds_of",
    "scaled_extents",
]

#: weights are compared in integer parts of the largest one (see :func:`quantize_weights`)
_WEIGHT_SCALE = 1_000_000


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


def quantize_weights(weights: Sequence[float], world_size: int) -> Tuple[int, ...]:
    """``weights`` as integers in ``1.._WEIGHT_SCALE`` (parts per million of the largest); refuses bad weights.

    Raises:
        ValueError: not one weight per rank, or a weight that is not a positive finite number.

    Example:
        >>> quantize_weights([2.0, 1.0], 2)
        (1000000, 500000)
    """
    weights = tuple(weights)
    if len(weights) != world_size:
        raise ValueError(f"band weights need one figure per rank (got {len(weights)} for {world_size} ranks)")
    for r, w in enumerate(weights):
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"band weight of rank {r} must be a positive finite number (got {w!r})")
    top = max(weights)
    return tuple(max(1, int(round(w / top * _WEIGHT_SCALE))) for w in weights)


def weighted_split(units: int, weights: Optional[Sequence[float]], min_units: int = 1) -> Tuple[int, ...]:
    """``units`` split into contiguous shards proportional to ``weights``, each at least ``min_units``.

    The largest-remainder apportionment in integer arithmetic (see the module docstring): identical on every rank
    that holds the same weights. ``weights=None`` is :func:`split_extent`'s equal split (after the same minimum
    check).

    Raises:
        ValueError: bad weights, or fewer than ``len(weights) * min_units`` units (a band would be empty or below
            the minimum; the message names the fix).

    Example:
        >>> weighted_split(9, [2.0, 1.0])
        (6, 3)
        >>> weighted_split(10, [1.0, 1.0, 1.0])
        (4, 3, 3)
    """
    if weights is None:
        raise ValueError("weighted_split needs weights; use split_extent for equal shards")  # backstop
    world_size = len(weights)
    q = quantize_weights(weights, world_size)
    if min_units < 1:
        raise ValueError(f"min_units must be >= 1 (got {min_units})")
    if units < world_size * min_units:
        raise ValueError(
            f"{units} unit(s) cannot give each of {world_size} ranks {min_units}: a band would be empty; use at most "
            f"{max(1, units // min_units)} ranks, or a larger input"
        )
    total = sum(q)
    # the minimum first, then the rest in proportion (largest remainders first; ties to the lower rank)
    spare = units - world_size * min_units
    # each rank's ideal share of ALL units, minus what the minimum already gave it, never below zero
    ideal = [units * w for w in q]  # in units of 1/total
    want = [max(0, i - min_units * total) for i in ideal]
    want_total = sum(want)
    if want_total == 0:
        extra = list(split_extent(spare, world_size))
    else:
        exact = [spare * w for w in want]  # in units of 1/want_total
        extra = [e // want_total for e in exact]
        left = spare - sum(extra)
        order = sorted(range(world_size), key=lambda r: (-(exact[r] - extra[r] * want_total), r))
        for r in order[:left]:
            extra[r] += 1
    return tuple(min_units + e for e in extra)


def _split(units: int, world_size: int, weights: Optional[Sequence[float]], min_units: int = 1) -> Tuple[int, ...]:
    if weights is None:
        return split_extent(units, world_size)
    if len(weights) != world_size:
        raise ValueError(f"band weights need one figure per rank (got {len(weights)} for {world_size} ranks)")
    return weighted_split(units, weights, min_units)


def bounds_of(sizes: Sequence[int]) -> Tuple[int, ...]:
    """Offsets ``(0, s_0, s_0 + s_1, ..., total)`` of consecutive shards of ``sizes``."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def row_bands(latent_height: int, world_size: int, min_rows: int = 1, weights: Optional[Sequence[float]] = None) -> List[Tuple[int, int]]:
    """Split ``latent_height`` rows into ``world_size`` contiguous bands (the first ones one row taller if uneven).

    ``weights`` (one positive figure per rank, e.g. measured throughput) make the bands proportional to them
    (:func:`weighted_split`), each still at least ``min_rows`` rows.

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
    b = bounds_of(_split(latent_height, world_size, weights, max(1, min_rows)))
    return [(b[r], b[r + 1]) for r in range(world_size)]


def band_heights(height: int, world_size: int, align: int, weights: Optional[Sequence[float]] = None) -> Tuple[int, ...]:
    """Row band heights for ``world_size`` ranks over ``height`` latent rows, each a multiple of ``align``.

    ``align`` is the model's total row downsampling (a UNet's), so every resolution level's bands are whole rows.
    Uneven by at most ``align`` rows; with ``weights``, proportional to them in whole units of ``align`` rows
    (:func:`weighted_split`). Raises ``ValueError`` naming the fix when the height cannot give every rank a band.

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
    return tuple(u * align for u in _split(units, world_size, weights))


def token_shards(length: int, world_size: int, align: int = 1, weights: Optional[Sequence[float]] = None) -> Tuple[int, ...]:
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
    return tuple(u * align for u in _split(units, world_size, weights))


def scaled_extents(sizes: Sequence[int], rank: int, local_extent: int) -> List[int]:
    """Every rank's extent of a dimension proportional to the shard, from ``rank``'s ``local_extent``."""
    return [local_extent * s // sizes[rank] for s in sizes]
