"""Driver-side checks and plans of a distributed decode/encode: refuse before anything is shipped.

Design decisions:

* **Refuse on the driver.** What can be checked from shapes (latent rank and channels against the VAE, rows
  against the rank count and the band weights, input size against the compression ratio) is checked here, with the
  same verdicts the ranks would reach (the same functions: ``row.validate_latent``'s band table,
  ``row.check_encode_input``), before any weights or tensors are shipped; the ranks keep their own checks as the
  backstop.
* **auto** picks row mode (exact: equals the single-GPU decode) unless the link is slow enough that the topology
  advice prefers whole tiles (:func:`choose_mode`).
* **Plans are data.** A tile plan travels as ``TilePlan.to_dict()`` and is rebuilt on the ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .spec import VaeSpec, latent_channels, latent_frames_hw

__all__ = ["MODES", "choose_mode", "check_decode_input", "check_latent", "check_input", "row_tiled_plan", "tile_plan_for"]

log = logging.getLogger(__name__)

MODES = ("auto", "row", "tile-runs")


def choose_mode(family: str, height: int, width: int, frames: int, world_size: int, topology: Any = None) -> str:
    """``auto``'s choice: row mode (exact) unless the topology advice says the link favours whole tiles.

    Args:
        topology: a ``topology.TopologyReport`` (e.g. from ``topology.cached_probe``); ``None``: row mode.
    """
    if world_size == 1 or topology is None:
        return "row"
    try:
        from ..topology import choose_decode_mode

        mode = choose_decode_mode(topology).mode
    except Exception as exc:  # advice is optional: never fail a decode over it
        log.debug("topology advice unavailable: %s", exc)
        return "row"
    if mode == "tile-runs":
        from .planner import plan_tiles

        try:
            plan_tiles(family, height, width, frames, world_size)
        except ValueError:  # the image is too small for tiles on this many ranks: row mode works
            return "row"
    return mode if mode in ("row", "tile-runs") else "row"


def check_decode_input(spec: VaeSpec, z: torch.Tensor, world_size: int, mode: str = "auto") -> None:
    """Every check of a decode's input that needs no rank: call it before the cluster starts.

    Refuses a latent whose rank or channels do not fit the VAE, one holding NaN or infinite values, and (in row
    and auto mode) one with fewer latent rows than ranks, with the same verdicts the ranks would reach.

    Raises:
        ValueError: naming what is wrong and the fix.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
    check_latent(spec, z, world_size, "row" if mode == "auto" else mode)
    finite = torch.isfinite(z)
    if not bool(finite.all()):
        nan, inf = int(torch.isnan(z).sum()), int(torch.isinf(z).sum())
        raise ValueError(
            f"the latent holds {nan} NaN and {inf} infinite value(s) of {z.numel()}: it would decode to a black or "
            "broken image; the sampler that made it diverged (often fp16 overflow: sample in bf16 or fp32)"
        )


def check_latent(spec: VaeSpec, z: torch.Tensor, world_size: int, mode: str, weights=None) -> None:
    """The ranks' latent checks (``row.validate_latent``), made here before anything is shipped."""
    from .families import get_family
    from .row import row_bands

    fam = get_family(spec.family)
    want_dim = 5 if fam.is_video else 4
    if not torch.is_tensor(z) or z.dim() != want_dim:
        layout = "[B, C, T, h, w]" if fam.is_video else "[B, C, h, w]"
        raise ValueError(f"{spec.family} latents are {want_dim}-D {layout}; got shape {tuple(getattr(z, 'shape', ()))}")
    channels = latent_channels(spec)
    if channels is not None and z.shape[1] != channels:
        raise ValueError(
            f"latent has {z.shape[1]} channels but this {spec.family} VAE expects {channels}; "
            "pass a latent made by this VAE (or load the matching VAE)"
        )
    if mode == "row":
        row_bands(z.shape[-2], world_size, weights=weights)  # too few rows for the ranks: ValueError naming the rank count that fits


def check_input(spec: VaeSpec, x: torch.Tensor, world_size: int, weights=None) -> None:
    """The ranks' encode-input checks (``row.check_encode_input``), made here before anything is shipped."""
    from .families import image_channels
    from .row import check_encode_input

    check_encode_input(spec.family, x, image_channels(spec.family, spec.config), world_size, weights)


def row_tiled_plan(spec: VaeSpec, z: torch.Tensor, world_size: int, tiles: int) -> Optional[dict]:
    """A plan of ``tiles`` full-width tiles over the latent rows (a quarter-window overlap), or None when the rows
    cannot give every rank a row of every tile."""
    from collections import namedtuple

    from .families import get_family
    from .planner import exact_plan

    fam = get_family(spec.family)
    ratio = fam.spatial_ratio
    rows, cols = int(z.shape[-2]), int(z.shape[-1])
    overlap = max(1, rows // (4 * tiles))
    window = -(-(rows + (tiles - 1) * overlap) // tiles)
    if tiles < 2 or window >= rows or window <= overlap or window < world_size:
        return None
    height, width, frames = latent_frames_hw(spec.family, z)
    family = namedtuple("Family", "name spatial_ratio")(spec.family, ratio)
    plan = exact_plan(family, height, width, frames, 1, (window * ratio, cols * ratio), (overlap * ratio, 0), min_tile_latent=1)
    if min(y1 - y0 for y0, y1, _, _ in plan.tiles_latent) < world_size:
        return None
    return plan.to_dict()


def tile_plan_for(spec: VaeSpec, z: torch.Tensor, world_size: int, plan=None) -> dict:
    """The tile-runs plan for ``z`` as a dict: ``plan`` checked against the rank count, or the planner's balanced
    (else coarse) plan. Needs no rank, so callers can refuse before the cluster starts.

    Raises:
        ValueError: a plan for another rank count, or an image too small for tiles on this many ranks.
    """
    from .planner import TilePlan, plan_tiles

    if plan is None:
        height, width, frames = latent_frames_hw(spec.family, z)
        report = plan_tiles(spec.family, height, width, frames, world_size)
        plan = (report.balanced or report.coarse).to_dict()
    elif isinstance(plan, TilePlan):
        plan = plan.to_dict()
    if int(plan.get("world_size", world_size)) != world_size:
        raise ValueError(
            f"the tile plan was made for {plan.get('world_size')} ranks but the cluster has {world_size}; re-plan for {world_size}"
        )
    return plan
