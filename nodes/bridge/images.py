"""PNG file -> IMAGE tensor (for charts and heatmaps the library writes)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["png_to_image"]


def png_to_image(path: str) -> torch.Tensor:
    """IMAGE ``[1, H, W, 3]`` float 0..1 from a PNG (alpha composited on white)."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(bg, im).convert("RGB")
        arr = np.asarray(rgb, dtype=np.float32) / 255.0
    return torch.from_numpy(arr.copy()).unsqueeze(0)
