"""Checks made in ComfyUI's process before any rank works or any weight is shipped, worded in the nodes' terms.

Each function takes what a node has in hand (widget values, the LATENT, the plan wire) and raises ``ValueError``
naming the widget to change and a value that works; it never suggests a value that cannot work (no "num_ranks
<= 0"). They are cheap (arithmetic on shapes), so a node calls them first.

* :func:`sampling_rows` -- Distributed KSampler: the latent's rows give every rank a band of the UNet.
* :func:`plan_for_latent` -- Distributed VAE Decode: a Tile Planner plan matches the latent it is used on.
* :func:`plan_use_note` -- a plan wired into a mode that does not use it: the note to show (not silently ignored).
* :func:`tile_planner_request` -- Tile Planner: refuse requests that cannot be useful, with the nearest one that is.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["sampling_rows", "check_sampling_rows", "plan_for_latent", "plan_use_note", "tile_planner_request"]

#: ComfyUI's IMAGE is float32 [frames, height, width, 3]
_IMAGE_BYTES_PER_PIXEL = 3 * 4


def check_sampling_rows(latent_rows: int, num_ranks: int, align: int, ratio: int = 8) -> None:
    """Refuse a latent whose rows cannot give each of ``num_ranks`` ranks a band of ``align`` rows (``ratio`` pixels
    per latent row).

    Raises:
        ValueError: naming the image height and the Cluster node's num_ranks, with values that work.
    """
    rows, n, align = int(latent_rows), int(num_ranks), max(1, int(align))
    px = rows * ratio
    if rows % align:
        lower, upper = (rows // align) * align * ratio, -(-rows // align) * align * ratio
        options = f"{upper} px" if lower == 0 else f"{lower} or {upper} px"
        raise ValueError(
            f"latent_image is {px} px high, which this model cannot split into row bands: its height must be a multiple of "
            f"{align * ratio} px (the UNet halves the rows {align.bit_length() - 1} time(s)); use an image height of {options}"
        )
    units = rows // align
    if units < n:
        raise ValueError(
            f"latent_image is {px} px high: {units} band(s) of {align * ratio} px for {n} ranks, and every rank needs one; "
            f"set num_ranks on the PatchRay Cluster node to {units} or fewer, or make the image at least {n * align * ratio} px high"
        )


def _row_align(model) -> int:
    """The UNet's total row downsampling: the product of its row-strided convolutions' strides (1 if none)."""
    import torch

    align = 1
    diffusion_model = getattr(getattr(model, "model", None), "diffusion_model", None)
    if diffusion_model is None:
        return 1
    for m in diffusion_model.modules():
        if isinstance(m, torch.nn.Conv2d) and m.stride[0] > 1:
            align *= m.stride[0]
    return align


def sampling_rows(model, latent, num_ranks: int) -> None:
    """The Distributed KSampler's check of its latent's rows against the cluster's ranks (before anything ships)."""
    check_sampling_rows(int(latent.shape[-2]), int(num_ranks), _row_align(model))


def plan_for_latent(plan: Optional[dict], latent_shape, ratio: int) -> None:
    """Refuse a Tile Planner plan made for another size than the latent it decodes.

    Args:
        plan: the plan wire (``TilePlan.to_dict()``) or ``None``.
        latent_shape: the LATENT's ``samples`` shape (``[B, C, h, w]`` or ``[B, C, T, h, w]``).
        ratio: the VAE's pixels per latent row/column.
    """
    if plan is None:
        return
    want_h, want_w = int(latent_shape[-2]) * ratio, int(latent_shape[-1]) * ratio
    have_h, have_w = int(plan["height"]), int(plan["width"])
    if (have_h, have_w) != (want_h, want_w):
        raise ValueError(
            f"plan was made for {have_w}x{have_h} px, but this latent decodes to {want_w}x{want_h} px: set the Tile "
            f"Planner's width to {want_w} and height to {want_h}"
        )


def plan_use_note(mode: str, plan: Optional[dict]) -> Optional[str]:
    """The note to show when a plan is wired into a mode that does not use it (``None`` when it is used or absent)."""
    if plan is None:
        return None
    if mode == "row":
        return "plan is unused: row mode shards rows exactly and takes no tile plan (choose a tile mode to use the plan)"
    return None


def _memory_bytes() -> Optional[int]:
    try:
        import psutil  # a dependency of Ray

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def tile_planner_request(family: str, width: int, height: int, frames: int, ranks: int, memory_bytes: Optional[int] = None) -> None:
    """Refuse a Tile Planner request that cannot be useful, naming the nearest one that is.

    * an image family with more than one frame (it decodes single images);
    * a video family's frame count its temporal compression cannot give (``ratio * k + 1``);
    * a decode whose IMAGE (float32 frames x height x width x 3) would not fit in this machine's memory: nothing could
      receive it.
    """
    from ...distributed.vae.families import FAMILIES

    spec = FAMILIES[family]
    w, h, f = int(width), int(height), int(frames)
    if not spec.is_video and f != 1:
        raise ValueError(f"family {family} decodes single images: set frames to 1 (got {f})")
    t = int(spec.temporal_ratio)
    if spec.is_video and t > 1 and (f - 1) % t:
        lower = (f - 1) // t * t + 1
        raise ValueError(f"family {family} decodes {t}k + 1 frames (its latent has one frame per {t}): set frames to {lower} or {lower + t}")
    memory = _memory_bytes() if memory_bytes is None else memory_bytes
    if memory:
        need = f * h * w * _IMAGE_BYTES_PER_PIXEL
        if need > memory:
            fit = max(1, memory // (h * w * _IMAGE_BYTES_PER_PIXEL))
            if spec.is_video and t > 1:
                fit = max(1, (fit - 1) // t * t + 1)
            hint = (f"set frames to {fit} or fewer at {w}x{h}" if f > 1 and fit * h * w * _IMAGE_BYTES_PER_PIXEL <= memory
                    else "lower width and height")
            raise ValueError(
                f"{w}x{h} px x {f} frame(s) decodes to a {need / 2**30:.1f} GiB IMAGE (float32), more than this machine's "
                f"{memory / 2**30:.1f} GiB memory, so no decode could deliver it: {hint}"
            )
