"""The tile planner's refusals, reworded for the node that shows them.

The planner (``distributed/vae/planner_search.py``) words its refusals for its command line: sizes as height x
width and the nearest request that plans as flags (``nearest valid request: --height 176 --width 256 at --ranks 2``).
A node shows sizes as width x height (ComfyUI's widget order) and names its own widgets: the Tile Planner's
``width``/``height``/``ranks``, the decode's ``mode`` and the PatchRay Cluster node's ``num_ranks``. This module
reads the planner's suggestions out of its message (the format is the planner's; a CI test runs the real planner
through it, so a change of wording there fails the test instead of leaking flags to users) and writes the node's
sentence.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional, Tuple

__all__ = ["Nearest", "nearest", "for_tile_planner", "for_decode"]

_RANKS = re.compile(r"--ranks (\d+)")
_SIZE = re.compile(r"--height (\d+) --width (\d+) at --ranks (\d+)")
_FLAG = re.compile(r"--[a-z]")
_NOT_MULTIPLE = re.compile(r"(width|height) (\d+) is not a multiple of the family's spatial ratio (\d+); nearest valid: (.+)$")


class Nearest(NamedTuple):
    """The planner's nearest requests that plan: fewer ranks, and/or a larger (width, height) at the same ranks."""

    ranks: Optional[int]
    size: Optional[Tuple[int, int]]


def nearest(message: str) -> Nearest:
    """The suggestions in one of the planner's refusals (``None`` where it has none)."""
    text = message.split("nearest valid request:", 1)[-1] if "nearest valid request:" in message else ""
    size = _SIZE.search(text)
    ranks = _RANKS.search(_SIZE.sub("", text))
    return Nearest(int(ranks.group(1)) if ranks else None, (int(size.group(2)), int(size.group(1))) if size else None)


def _why(message: str, ranks: int) -> str:
    """What is wrong, in words that need no knowledge of the planner."""
    if "on its narrow axis" in message:
        m = re.search(r"at least \d+ \((\d+) px\)", message)
        return f"a tile needs at least {m.group(1) if m else 128} px on the image's shorter side"
    if "only one distinct tile window" in message:
        return f"at this size only one tile size fits {ranks} rank(s), so there is no tile plan to choose"
    if "more ranks than useful tiles" in message:
        return f"it cannot be cut into a tile of useful size for each of the {ranks} ranks"
    return message.split("; nearest valid request:")[0]


def _size_hint(size: Optional[Tuple[int, int]], width_name: str, height_name: str) -> Optional[str]:
    if size is None:
        return None
    return f"{width_name} to {size[0]} and {height_name} to {size[1]}"


def for_tile_planner(message: str, family: str, width: int, height: int, ranks: int) -> Optional[str]:
    """The Tile Planner's message for a planner refusal (``None`` when ``message`` is not one)."""
    step = _NOT_MULTIPLE.search(message)
    if step:
        name, value, ratio, options = step.groups()
        return f"family {family} decodes in steps of {ratio} px and {name} {value} is not one: set {name} to {options}"
    if "nearest valid request:" not in message:
        return None
    near = nearest(message)
    fixes = []
    if near.ranks is not None:
        fixes.append(f"set ranks to {near.ranks}")
    size = _size_hint(near.size, "width", "height")
    if size:
        fixes.append(f"set {size} or more")
    fix = " or ".join(fixes) if fixes else "choose a larger width and height or fewer ranks"
    return f"{width}x{height} px cannot be tiled for {ranks} rank(s): {_why(message, ranks)}; {fix}"


def for_decode(message: str, width: int, height: int, ranks: int, node: str) -> str:
    """The Distributed VAE Decode's message when mode 'tile-runs' cannot plan tiles for its latent."""
    near = nearest(message)
    fixes = ["use mode 'row' (exact, any size)"]
    if near.ranks is not None:
        fixes.append(f"set num_ranks on the PatchRay Cluster node to {near.ranks}")
    if near.size is not None:
        fixes.append(f"decode an image of at least {near.size[0]}x{near.size[1]} px")
    why = _why(message, ranks)
    if _FLAG.search(why):  # a refusal this module does not know: its words without the flags
        why = why.split("nearest valid")[0].rstrip("; ")
    return (
        f"{node}: mode 'tile-runs' cannot tile the {width}x{height} px image of 'samples' for the {ranks} rank(s) of "
        f"'cluster' ({why}): " + ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]
    )
