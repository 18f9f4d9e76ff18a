"""Tile geometry shared by every tiled mode: pixel rectangles, cores, blend ramps, the blend, seam errors.

Design decision: **an order-independent blend.** Each tile is weighted by separable linear ramps across the
overlaps it shares with its neighbours; ``sum(weight * tile)`` and ``sum(weight)`` are accumulated in fp32 in
raster order and divided at the end. Two complementary ramps sum to one, so a seam is a linear crossfade;
dividing by the accumulated weight keeps any geometry (thin exact-case blends, triple overlaps) correct. Weights
depend only on geometry, so a pixel's value does not depend on which process decoded which tile. Everything here
is derived from the plan identically on every rank.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .planner import TilePlan

__all__ = ["Rect", "Geometry", "Blend", "blend_cores", "intersect", "crop", "check_latent", "seam_error"]

Rect = Tuple[int, int, int, int]


def intersect(a: Rect, b: Rect) -> Optional[Rect]:
    y0, y1, x0, x1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (y0, y1, x0, x1) if y0 < y1 and x0 < x1 else None


def _ramps(spans: Sequence[Tuple[int, int]], index: int) -> torch.Tensor:
    """1-D fp32 weights of tile ``index`` along one axis: linear ramps over the overlaps with its neighbours."""
    a, b = spans[index]
    length = b - a
    pos = torch.arange(length, dtype=torch.float64) + 0.5
    w = torch.ones(length, dtype=torch.float64)
    if index > 0:
        ov = spans[index - 1][1] - a
        if ov > 0:
            w = w * torch.clamp(pos / ov, max=1.0)
    if index + 1 < len(spans):
        ov = b - spans[index + 1][0]
        if ov > 0:
            w = w * torch.clamp((length - pos) / ov, max=1.0)
    return w.to(torch.float32)


class Geometry:
    """Pixel rectangles, cores and blend ramps of a plan (derived identically on every rank)."""

    def __init__(self, plan: TilePlan):
        self.plan = plan
        r = plan.ratio
        rows, cols = plan.grid
        self.tiles = plan.tiles_pixels
        self.cores = tuple((y0 * r, y1 * r, x0 * r, x1 * r) for y0, y1, x0, x1 in plan.cores_latent)
        ys = [(t[0], t[1]) for t in self.tiles[::cols]]
        xs = [(t[2], t[3]) for t in self.tiles[:cols]]
        wy = [_ramps(ys, i) for i in range(rows)]
        wx = [_ramps(xs, j) for j in range(cols)]
        self.ramps = [(wy[i // cols], wx[i % cols]) for i in range(len(self.tiles))]
        # which tiles reach into each core, in raster order (the blend order)
        self.covering = [
            [t for t, rect in enumerate(self.tiles) if intersect(rect, core) is not None] for core in self.cores
        ]

    def weight(self, tile: int, rect: Rect) -> torch.Tensor:
        """Blend weight of ``tile`` over the absolute pixel ``rect`` (inside the tile)."""
        ty0, _, tx0, _ = self.tiles[tile]
        wy, wx = self.ramps[tile]
        return torch.outer(wy[rect[0] - ty0 : rect[1] - ty0], wx[rect[2] - tx0 : rect[3] - tx0])


def crop(t: torch.Tensor, origin: Rect, rect: Rect) -> torch.Tensor:
    """The part of ``t`` (whose last two dims start at ``origin``) covering absolute ``rect``."""
    return t[..., rect[0] - origin[0] : rect[1] - origin[0], rect[2] - origin[2] : rect[3] - origin[2]]


def check_latent(z: torch.Tensor, plan: TilePlan) -> None:
    if not isinstance(z, torch.Tensor) or z.dim() not in (4, 5):
        raise ValueError(f"z must be a 4-D [B,C,h,w] or 5-D [B,C,T,h,w] latent (got {getattr(z, 'shape', z)})")
    if tuple(z.shape[-2:]) != plan.latent_size:
        raise ValueError(
            f"latent is {tuple(z.shape[-2:])} but the plan was made for {plan.latent_size} "
            f"({plan.height}x{plan.width} px at ratio {plan.ratio}); plan for this latent's image size"
        )


class Blend:
    """Order-independent blend of whole tiles into the image: accumulate weight * tile and weight, divide once."""

    def __init__(self, plan: TilePlan, geo: Geometry):
        self.plan, self.geo = plan, geo
        self.acc = self.wsum = self.dtype = None

    def add(self, t: int, out: torch.Tensor) -> None:
        if self.acc is None:
            self.dtype = out.dtype
            self.acc = torch.zeros(out.shape[:-2] + (self.plan.height, self.plan.width), dtype=torch.float32, device=out.device)
            self.wsum = torch.zeros(self.plan.height, self.plan.width, dtype=torch.float32, device=out.device)
        y0, y1, x0, x1 = self.geo.tiles[t]
        w = self.geo.weight(t, self.geo.tiles[t]).to(out.device)
        self.acc[..., y0:y1, x0:x1] += out.float() * w
        self.wsum[y0:y1, x0:x1] += w

    def result(self) -> Optional[torch.Tensor]:
        """The blended image, or ``None`` if no tile was added (a rank that received no output)."""
        return None if self.acc is None else (self.acc / self.wsum).to(self.dtype)


def blend_cores(
    cores: Sequence[int], geo: Geometry, pieces: Dict[Tuple[int, int], torch.Tensor], lead: torch.Tensor
) -> List[torch.Tensor]:
    """Blend each core from its covering tiles' pieces (``pieces[(tile, core)]``), in raster order."""
    out = []
    for k in cores:
        core = geo.cores[k]
        hk, wk = core[1] - core[0], core[3] - core[2]
        acc = torch.zeros(lead.shape[:-2] + (hk, wk), dtype=torch.float32, device=lead.device)
        wsum = torch.zeros(hk, wk, dtype=torch.float32, device=lead.device)
        for t in geo.covering[k]:
            rect = intersect(geo.tiles[t], core)
            w = geo.weight(t, rect).to(lead.device)
            y0, y1, x0, x1 = (rect[0] - core[0], rect[1] - core[0], rect[2] - core[2], rect[3] - core[2])
            acc[..., y0:y1, x0:x1] += pieces[(t, k)].float() * w
            wsum[y0:y1, x0:x1] += w
        out.append((acc / wsum).to(lead.dtype))
    return out


def seam_error(image: torch.Tensor, reference: torch.Tensor, plan: TilePlan, band: int = 0) -> dict:
    """Mean absolute error of a tiled decode against a reference, overall and inside the overlap bands.

    Args:
        band: half-width in pixels of the band around each seam's centre; 0 means the full overlap.

    Returns:
        ``{"mean_abs": ..., "max_abs": ..., "seam_mean_abs": ..., "interior_mean_abs": ...}`` (floats).
    """
    diff = (image.float() - reference.float()).abs()
    mask = torch.zeros(plan.height, plan.width, dtype=torch.bool, device=diff.device)
    rows, cols = plan.grid
    tiles = plan.tiles_pixels
    ys = [(t[0], t[1]) for t in tiles[::cols]]
    xs = [(t[2], t[3]) for t in tiles[:cols]]
    for (a0, b0), (a1, _) in zip(ys, ys[1:]):
        lo, hi = (a1, b0) if not band else ((a1 + b0) // 2 - band, (a1 + b0) // 2 + band)
        mask[max(lo, 0) : hi, :] = True
    for (a0, b0), (a1, _) in zip(xs, xs[1:]):
        lo, hi = (a1, b0) if not band else ((a1 + b0) // 2 - band, (a1 + b0) // 2 + band)
        mask[:, max(lo, 0) : hi] = True
    per_pixel = diff.reshape(-1, plan.height, plan.width).mean(0)
    seam = per_pixel[mask]
    interior = per_pixel[~mask]
    return {
        "mean_abs": float(diff.mean()),
        "max_abs": float(diff.max()),
        "seam_mean_abs": float(seam.mean()) if seam.numel() else 0.0,
        "interior_mean_abs": float(interior.mean()) if interior.numel() else 0.0,
    }
