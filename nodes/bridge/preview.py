"""Presentation only: draw a tile plan as an IMAGE tensor, with a legend (no planning happens here).

Design decisions:

* **A preview has a size cap.** The plan is drawn at most :data:`PREVIEW_MAX_SIDE` pixels on its long side (scaled
  down, never up): a 16384x16384 plan drawn at full size was a 3 GiB float canvas plus copies (12 GB in 14 s). The
  plan itself (the wire) is never scaled; the legend says the scale.
* **The legend is part of the image** (a strip under the plan): which colour is which rank, what the outlines are,
  and the size in ComfyUI's order, width x height.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...distributed.vae.planner import TilePlan

__all__ = ["draw_plan", "PREVIEW_MAX_SIDE", "legend_height"]

#: the preview's long side at most, in pixels (the node shows it at a few hundred pixels anyway)
PREVIEW_MAX_SIDE = 1024


def legend_height(width: int) -> int:
    """The legend strip's height under a plan drawn ``width`` pixels wide (its text scales with the picture, so it
    stays readable when the node shows the picture at a few hundred pixels)."""
    return round(_font_size(width) * 3.4)


def _font_size(width: int) -> int:
    return max(12, round(width / 40))


def _font(size: int):
    from PIL import ImageFont

    try:  # matplotlib (a dependency) ships DejaVu Sans
        from matplotlib import font_manager

        return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)
    except Exception:
        return ImageFont.load_default()

# colour-blind-safe palette (Okabe-Ito), one colour per rank, cycled
_PALETTE = np.array(
    [[0.902, 0.624, 0.0], [0.337, 0.706, 0.914], [0.0, 0.620, 0.451], [0.941, 0.894, 0.259],
     [0.0, 0.447, 0.698], [0.835, 0.369, 0.0], [0.800, 0.475, 0.655], [0.6, 0.6, 0.6]], dtype=np.float32
)


def _scaled(v: int, scale: float) -> int:
    return int(round(v * scale))


def draw_plan(plan: dict, image: Optional[torch.Tensor] = None, max_side: int = PREVIEW_MAX_SIDE) -> torch.Tensor:
    """IMAGE ``[1, h + legend_height(w), w, 3]``: each rank's tile cores tinted in its colour, every tile window outlined,
    and a legend strip; ``(h, w)`` is the plan's size scaled to at most ``max_side`` on the long side.

    Args:
        plan: ``TilePlan.to_dict()``.
        image: optional IMAGE to draw over (its first frame, resized to the preview's size); grey otherwise.
        max_side: the cap on the plan area's long side.
    """
    from PIL import Image, ImageDraw

    H, W, ratio = int(plan["height"]), int(plan["width"]), int(plan["ratio"])
    scale = min(1.0, max_side / max(H, W))
    h, w = max(1, _scaled(H, scale)), max(1, _scaled(W, scale))
    if image is not None:
        base = image[0, :, :, :3].float()
        if tuple(base.shape[:2]) != (h, w):
            base = torch.nn.functional.interpolate(base.movedim(-1, 0)[None], size=(h, w), mode="nearest")[0].movedim(0, -1)
        canvas = base.numpy().astype(np.float32).copy()
    else:
        canvas = np.full((h, w, 3), 0.35, dtype=np.float32)
    owner = []
    for rank, (start, stop) in enumerate(plan["runs"]):
        owner += [rank] * (int(stop) - int(start))
    k_px = ratio * scale
    # cores: the pixels each tile owns (seams cut mid-overlap), as the planner defines them
    for k, (y0, y1, x0, x1) in enumerate(TilePlan.from_dict(plan).cores_latent):
        color = _PALETTE[owner[k] % len(_PALETTE)]
        ys, ye, xs, xe = _scaled(y0, k_px), _scaled(y1, k_px), _scaled(x0, k_px), _scaled(x1, k_px)
        canvas[ys:ye, xs:xe] = canvas[ys:ye, xs:xe] * 0.55 + color * 0.45
    lw = max(1, min(h, w) // 128)
    for k, (y0, y1, x0, x1) in enumerate(plan["tiles_latent"]):
        color = _PALETTE[owner[k] % len(_PALETTE)] * 0.6
        ys, ye, xs, xe = _scaled(y0, k_px), _scaled(y1, k_px), _scaled(x0, k_px), _scaled(x1, k_px)
        canvas[ys : ys + lw, xs:xe] = color
        canvas[max(ys, ye - lw) : ye, xs:xe] = color
        canvas[ys:ye, xs : xs + lw] = color
        canvas[ys:ye, max(xs, xe - lw) : xe] = color
    fs = _font_size(w)
    lh = legend_height(w)
    font = _font(fs)
    out = np.zeros((h + lh, w, 3), dtype=np.float32)
    out[:h] = np.clip(canvas, 0, 1)
    out[h:] = 0.12
    legend = Image.fromarray((out[h:] * 255).round().astype(np.uint8))
    draw = ImageDraw.Draw(legend)
    x, pad = round(fs * 0.4), round(fs * 0.3)
    for rank in range(len(plan["runs"])):
        label = f"rank {rank}"
        step = fs + pad + int(draw.textlength(label, font=font)) + fs
        if x + step > w - 2 * fs:
            draw.text((x, pad), "...", fill=(230, 230, 230), font=font)
            break
        color = tuple(int(c * 255) for c in _PALETTE[rank % len(_PALETTE)])
        draw.rectangle([x, pad + fs * 0.15, x + fs * 0.8, pad + fs * 0.95], fill=color)
        draw.text((x + fs + pad // 2, pad), label, fill=(230, 230, 230), font=font)
        x += step
    note = f"tint: each rank's tiles; outline: tile windows; {W}x{H} px" + (f" at {scale:.0%}" if scale < 1 else "")
    draw.text((round(fs * 0.4), pad + round(fs * 1.6)), note, fill=(200, 200, 200), font=font)
    out[h:] = np.asarray(legend, dtype=np.float32) / 255.0
    return torch.from_numpy(out).unsqueeze(0).contiguous()
