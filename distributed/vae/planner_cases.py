"""Benchmark case strings: how a measured decode mode (and, for tiled modes, its window) is written down.

Design decision: a *case* is the benchmark's vocabulary, not the planner's. The runtime decodes from a
:class:`~patchray.distributed.vae.planner_geometry.TilePlan`; the benchmark (and anyone reproducing one of its
records) names what it ran with a short string, ``unsharded``, ``row`` or ``MODE:WINDOW_HxW@OVERLAP_HxW`` with
``MODE`` one of ``local``, ``tile-runs``, ``row-tiled`` and window and overlap in output pixels, height first
(docs/benchmark.md, "Cases"). The format lives in this small module, which imports nothing from the planner or
the benchmark, so the benchmark can import it and the runtime never imports the benchmark.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional, Tuple

__all__ = ["MODES", "TILED_MODES", "CaseSpec", "parse_case", "format_case"]

MODES = ("unsharded", "row", "local", "tile-runs", "row-tiled")
"""Every decode mode a case can name."""

TILED_MODES = ("local", "tile-runs", "row-tiled")
"""The modes that decode whole tiles and so need a window and an overlap."""


def format_case(mode: str, window: Tuple[int, int], overlap: Tuple[int, int]) -> str:
    """The case string of a tiled mode, e.g. ``format_case("tile-runs", (480, 736), (64, 32))``.

    Example:
        >>> format_case("tile-runs", (480, 736), (64, 32))
        'tile-runs:480x736@64x32'
    """
    (wh, ww), (oh, ow) = window, overlap
    return f"{mode}:{wh}x{ww}@{oh}x{ow}"


class CaseSpec(NamedTuple):
    """A parsed ``--case``: ``mode`` plus, for tiled modes, window and overlap ``(h, w)`` in output pixels."""

    mode: str
    window: Optional[Tuple[int, int]]
    overlap: Optional[Tuple[int, int]]

    @property
    def label(self) -> str:
        if self.window is None:
            return self.mode
        return f"{self.mode}-{self.window[0]}x{self.window[1]}-ov{self.overlap[0]}x{self.overlap[1]}"

    @property
    def tiled(self) -> bool:
        return self.mode in TILED_MODES


_CASE_EXAMPLE = "e.g. 'unsharded', 'row' or 'tile-runs:480x736@64x32' (MODE:WINDOW_HxW@OVERLAP_HxW, output pixels)"
_PAIR = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_case(text: str) -> CaseSpec:
    """Parse a benchmark case string: ``unsharded``, ``row`` or ``MODE:WINDOW_HxW@OVERLAP_HxW``.

    ``MODE`` is ``local``, ``tile-runs`` or ``row-tiled``; window and overlap are output pixels. Whether
    the window fits an image is checked later, by :func:`exact_plan`, which knows the image.

    Raises:
        ValueError: the reason and an example of the valid form.

    Example:
        >>> parse_case("local:480x736@64x32")
        CaseSpec(mode='local', window=(480, 736), overlap=(64, 32))
    """
    if not isinstance(text, str):
        raise ValueError(f"a case must be a string ({_CASE_EXAMPLE}), got {text!r}")
    value = text.strip()
    if value in ("unsharded", "row"):
        return CaseSpec(value, None, None)
    if ":" not in value:
        if value in TILED_MODES:
            raise ValueError(f"case {text!r} needs a window and an overlap: {value}:480x736@64x32")
        raise ValueError(f"unknown case {text!r}; valid cases: {_CASE_EXAMPLE}")
    mode, _, rest = value.partition(":")
    mode = mode.strip()
    if mode not in TILED_MODES:
        raise ValueError(f"unknown tiled mode {mode!r} in case {text!r}; choose local, tile-runs or row-tiled, {_CASE_EXAMPLE}")
    if rest.count("@") != 1:
        raise ValueError(f"case {text!r} must have one '@' between window and overlap, {_CASE_EXAMPLE}")
    win_text, ov_text = rest.split("@")
    pairs = []
    for label, part in (("window", win_text), ("overlap", ov_text)):
        match = _PAIR.match(part)
        if not match:
            raise ValueError(f"case {text!r}: {label} {part!r} must be HEIGHTxWIDTH in whole pixels, {_CASE_EXAMPLE}")
        pairs.append((int(match.group(1)), int(match.group(2))))
    window, overlap = pairs
    if min(window) <= 0:
        raise ValueError(f"case {text!r}: window axes must be positive, {_CASE_EXAMPLE}")
    for axis, label in ((0, "height"), (1, "width")):
        if overlap[axis] and overlap[axis] >= window[axis]:
            raise ValueError(
                f"case {text!r}: overlap {label} {overlap[axis]} must be smaller than the window {window[axis]}, "
                f"{_CASE_EXAMPLE}"
            )
    return CaseSpec(mode, window, overlap)

