"""Tile Planner: the geometric planner's coarse / balanced / fine plans, a preview, and a plan wire."""

from __future__ import annotations

from ._comfy import io, ui
from .bridge import diagnostics
from .types import CATEGORY, TILE_PLAN

__all__ = ["PatchRayTilePlanner", "FAMILY_NAMES"]


def _family_names():
    from ..distributed.vae.families import FAMILIES

    return list(FAMILIES)


FAMILY_NAMES = _family_names()


def family_tooltip(what: str) -> str:
    """The family widget's tooltip: which ComfyUI VAE each family is (from the layout table) and its pixels per latent."""
    from ..distributed.vae.families import FAMILIES
    from .bridge.vae import covered_vaes_by_family

    names = covered_vaes_by_family()
    known = [f"{f}: {' / '.join(names[f])} ({FAMILIES[f].spatial_ratio} px per latent)" for f in FAMILY_NAMES if f in names]
    other = [f for f in FAMILY_NAMES if f not in names]
    text = f"{what} The VAE that ComfyUI loads as: " + "; ".join(known) + "."
    if other:
        text += f" {', '.join(other)}: the diffusers models of those names (PatchRay's library and benchmark)."
    return text


class PatchRayTilePlanner(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayTilePlanner",
            display_name="PatchRay Tile Planner",
            category=f"{CATEGORY}/vae",
            description=(
                "Plans tiles for a tiled distributed decode: the coarse (fewest, largest tiles), balanced and fine plans of "
                "the planner's Pareto frontier, a preview of the chosen plan (each rank's tiles in its colour) and a plan wire "
                "for PatchRay Distributed VAE Decode."
            ),
            inputs=[
                io.Combo.Input("family", options=FAMILY_NAMES, default="kl", tooltip=family_tooltip("VAE family of the decode the tiles are for: it sets the pixels per latent row.")),
                io.Int.Input("width", default=1024, min=64, max=16384, step=8, tooltip="Output image width in pixels (a multiple of the family's ratio)."),
                io.Int.Input("height", default=1024, min=64, max=16384, step=8, tooltip="Output image height in pixels (a multiple of the family's ratio)."),
                io.Int.Input("frames", default=1, min=1, max=4096, tooltip="Output frames (video families); every tile carries all frames."),
                io.Int.Input("ranks", default=2, min=1, max=64, tooltip="Number of ranks the tiles are shared by."),
                io.Combo.Input("choice", options=["coarse", "balanced", "fine"], default="balanced", tooltip="Which plan goes out on the plan wire and into the preview."),
                io.Image.Input("image", optional=True, tooltip="Optional image to draw the tiles over (e.g. a previous decode); grey canvas otherwise."),
            ],
            outputs=[
                TILE_PLAN.Output(display_name="plan", tooltip="The chosen tile plan, for the decode node's plan input."),
                io.Image.Output(display_name="preview", tooltip="The chosen plan drawn over the image area: tile cores tinted per rank, tile windows outlined."),
                io.String.Output(display_name="plans", tooltip="The coarse, balanced and fine plans as text: window, overlap, tile count, extra area, imbalance."),
            ],
        )

    @classmethod
    def execute(cls, family, width, height, frames=1, ranks=2, choice="balanced", image=None) -> io.NodeOutput:
        plan, preview, text = diagnostics.plan_preview(family, width, height, frames, ranks, choice, image)
        return io.NodeOutput(plan, preview, text, ui=ui.PreviewText(text))
