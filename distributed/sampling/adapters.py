"""Compatibility alias: the UNet adapters live in ``distributed/parallel`` (one library for every model).

``split_rows`` is the band table's :func:`~patchray.distributed.parallel.bands.band_heights`; import it from
there. This module only keeps the old import path working until its last user moves.
"""

from __future__ import annotations

from ..parallel.bands import band_heights as split_rows

__all__ = ["split_rows"]
