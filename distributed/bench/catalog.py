"""Canonical benchmark shapes, one table, versioned with the architectures they were chosen for.

Design decisions:

* **One order everywhere: height x width x frames.** ``--shape`` (``720x1280x81``), the ``--case`` windows
  (``WINDOW_HxW``) and the JSON (``[height, width]``) are all height first, although video resolutions are
  usually named width first (``832x480`` for 480p, ``1920x1280`` for LTX-2's landscape case). PatchRay stores
  every shape as an explicit ``(height, width, frames)`` and prints ``HxWxF``, so the wan 480p case is
  ``480x832x81`` here, on stdout and in the JSON.
* **Versioned with the architectures.** A shape is canonical *for* an architecture: LTX-2 uses larger frames
  because 32x compression must leave sixteen latent units on a tile's narrow axis. ``CATALOG_VERSION`` goes
  into every record beside a digest of the family's full config, so two reports compare only when both match.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Dict, NamedTuple, Tuple

__all__ = [
    "CATALOG_VERSION",
    "Shape",
    "CANONICAL_SHAPES",
    "CPU_DEFAULT",
    "canonical_shapes",
    "parse_shape",
    "format_shape",
    "architecture_digest",
]

#: bump when a shape below or a family's full architecture changes
CATALOG_VERSION = 1


class Shape(NamedTuple):
    """An input size in pixels (and frames; 1 for images)."""

    height: int
    width: int
    frames: int = 1

    def __str__(self) -> str:  # noqa: D105 - HxWxF, the project's one notation
        return format_shape(self)


CANONICAL_SHAPES: Dict[str, Tuple[Shape, ...]] = {
    "flux2": (Shape(1024, 1024), Shape(2048, 2048)),
    "kl": (Shape(1024, 1024), Shape(2048, 2048)),
    "qwen_image": (Shape(1024, 1024, 1), Shape(2048, 2048, 1)),
    # 480p and 720p, 81 frames (832x480 and 1280x720 width first), stored height first
    "wan": (Shape(480, 832, 81), Shape(720, 1280, 81)),
    "hunyuan_video": (Shape(480, 832, 129), Shape(720, 1280, 129)),
    "hunyuan_video_15": (Shape(480, 832, 129), Shape(720, 1280, 129)),
    # landscape 1536x1024 and 1920x1280 (width first), 121 frames, stored height first
    "ltx2": (Shape(1024, 1536, 121), Shape(1280, 1920, 121)),
    # Wan 2.2 TI2V-5B's 1280x704 and 1920x1088; LTX-Video as LTX-2 (at 32x, 1216x704 is too small for the tile
    # planner's sixteen-latent tiles on eight ranks; the row-mode memory harness measures it, row_memory.py)
    "wan22": (Shape(704, 1280, 121), Shape(1088, 1920, 121)),
    "ltx_video": (Shape(1024, 1536, 121), Shape(1280, 1920, 121)),
    "ltx_video_090": (Shape(1024, 1536, 121), Shape(1280, 1920, 121)),
    # HunyuanImage-2.1 generates at 2K (2560x1536 and 2048x2048, width first); its refiner VAE takes one-frame clips; HunyuanVideo as ComfyUI runs it
    "hunyuan_image": (Shape(1536, 2560), Shape(2048, 2048)),
    "hunyuan_image_refiner": (Shape(1024, 1024, 1), Shape(2048, 2048, 1)),
    "hunyuan_video_full_attention": (Shape(480, 832, 129), Shape(720, 1280, 129)),
    # Mochi generates 848x480 (width first) clips of 6k + 1 frames: 85 and 163
    "mochi": (Shape(480, 848, 85), Shape(480, 848, 163)),
    "hunyuan_refiner_conv3d": (Shape(1024, 1024, 1), Shape(2048, 2048, 1)),
    # Cosmos generates 1280x704 (width first) clips of 121 frames (8k + 1)
    "cosmos": (Shape(704, 1280, 121), Shape(704, 1280, 57)),
}

#: What ``python -m patchray bench`` runs with no arguments where there is no GPU: the full-size kl
#: architecture on two CPU ranks at 192x192 (24x24 latent), the smallest square at which the planner still finds
#: two tile plans at two ranks (sixteen latent units on a tile's narrow axis), so the default suite keeps its tiled
#: cases (unsharded, row, tile-runs coarse and fine). One warm-up and two timed iterations per case; measured in
#: results/README.md to finish well under five minutes on two cores (256x256 took about 2.6x as long).
CPU_DEFAULT = dict(family="kl", height=192, width=192, frames=1, ranks=2, dtype="fp32", warmup=1, iters=2, size="full")

_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?$")


def canonical_shapes(family: str) -> Tuple[Shape, ...]:
    """The canonical shapes of ``family`` (``ValueError`` naming the known families otherwise)."""
    try:
        return CANONICAL_SHAPES[family]
    except KeyError:
        raise ValueError(f"no canonical shapes for family {family!r}; known: {', '.join(sorted(CANONICAL_SHAPES))}") from None


def parse_shape(text: str) -> Shape:
    """Parse ``HEIGHTxWIDTH`` or ``HEIGHTxWIDTHxFRAMES``.

    Example:
        >>> parse_shape("720x1280x81")
        Shape(height=720, width=1280, frames=81)
    """
    m = _SHAPE_RE.match(str(text))
    if not m:
        raise ValueError(f"a shape is HEIGHTxWIDTH or HEIGHTxWIDTHxFRAMES, e.g. 1024x1024 or 720x1280x81 (got {text!r})")
    h, w, f = int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)
    if min(h, w, f) < 1:
        raise ValueError(f"shape sizes must be positive (got {text!r})")
    return Shape(h, w, f)


def format_shape(shape) -> str:
    """``HxWxF`` (``HxW`` is never printed: the frame count is always explicit)."""
    h, w, f = shape
    return f"{h}x{w}x{f}"


def architecture_digest(config: dict) -> str:
    """A short digest of a family's architecture config (what the canonical shapes are versioned with)."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
