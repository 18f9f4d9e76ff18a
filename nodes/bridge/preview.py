"""Presentation only: draw a tile plan over the image area as an IMAGE tensor (no planning happens here)."""

from __future__ import annotations

from typing import Optional

import torch

from ...distributed.vae.planner import TilePlan

__all__ = ["draw_plan"]

# colour-blind-safe palette (Okabe-Ito), one colour per rank, cycled
_PALETTE = torch.tensor(
    [[0.902, 0.624, 0.0], [0.337, 0.706, 0.914], [0.0, 0.620, 0.451], [0.941, 0.894, 0.259],
     [0.0, 0.447, 0.698], [0.835, 0.369, 0.0], [0.800, 0.475, 0.655], [0.6, 0.6, 0.6]]
)


def draw_plan(plan: dict, image: Optional[torch.Tensor] = None) -> torch.Tensor:
    """IMAGE ``[1, H, W, 3]``: each rank's tile cores tinted in its colour, every tile window outlined.

    Args:
        plan: ``TilePlan.to_dict()``.
        image: optional IMAGE to draw over (its first frame, resized by nearest to the plan's size); grey otherwise.
    """
    h, w, ratio = int(plan["height"]), int(plan["width"]), int(plan["ratio"])
    if image is not None:
        base = image[0, :, :, :3].float()
        if tuple(base.shape[:2]) != (h, w):
            base = torch.nn.functional.interpolate(base.movedim(-1, 0)[None], size=(h, w), mode="nearest")[0].movedim(0, -1)
        canvas = base.clone()
    else:
        canvas = torch.full((h, w, 3), 0.35)
    owner = []
    for rank, (start, stop) in enumerate(plan["runs"]):
        owner += [rank] * (int(stop) - int(start))
    tiles = [[int(v) * ratio for v in t] for t in plan["tiles_latent"]]
    # cores: the pixels each tile owns (seams cut mid-overlap), as the planner defines them
    for k, (y0, y1, x0, x1) in enumerate(TilePlan.from_dict(plan).cores_latent):
        color = _PALETTE[owner[k] % len(_PALETTE)]
        y0, y1, x0, x1 = y0 * ratio, y1 * ratio, x0 * ratio, x1 * ratio
        canvas[y0:y1, x0:x1] = canvas[y0:y1, x0:x1] * 0.55 + color * 0.45
    lw = max(1, min(h, w) // 128)
    for k, (y0, y1, x0, x1) in enumerate(tiles):
        color = _PALETTE[owner[k] % len(_PALETTE)] * 0.6
        canvas[y0 : y0 + lw, x0:x1] = color
        canvas[max(y0, y1 - lw) : y1, x0:x1] = color
        canvas[y0:y1, x0 : x0 + lw] = color
        canvas[y0:y1, max(x0, x1 - lw) : x1] = color
    return canvas.clamp(0, 1).unsqueeze(0).contiguous()

