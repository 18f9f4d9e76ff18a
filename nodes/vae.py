"""Distributed VAE Decode / Encode: ComfyUI's own VAE and LATENT/IMAGE in, the stock nodes' outputs out."""

from __future__ import annotations

import logging

from . import _convert as cv
from ._comfy import interrupt_check, io, progress_callback, ui
from .types import CATEGORY, CLUSTER, TILE_PLAN

__all__ = ["PatchRayVAEDecode", "PatchRayVAEEncode"]

log = logging.getLogger(__name__)

def _precision_input():
    return io.Combo.Input(
        "precision",
        options=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        tooltip="Compute dtype on the ranks. auto: the dtype ComfyUI itself would use for this VAE. fp32 matches the stock node within 1/255.",
    )


def _fallback_note(exc: Exception, what: str) -> str:
    msg = f"PatchRay cannot shard this VAE ({exc}); used ComfyUI's own single-device {what} instead."
    log.warning(msg)
    return msg


class PatchRayVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayVAEDecode",
            display_name="PatchRay Distributed VAE Decode",
            category=f"{CATEGORY}/vae",
            description=(
                "Decodes a latent across the cluster's ranks. row: each rank decodes a band of rows and exchanges halos, "
                "so the image equals the single-GPU decode. tile-runs: ranks decode runs of whole tiles blended at the seams. "
                "A VAE family PatchRay cannot shard falls back to ComfyUI's own decode, with a warning on the node."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The latent to decode (from a sampler or an Empty Latent node)."),
                io.Vae.Input("vae", tooltip="ComfyUI's VAE, from the stock Load VAE or checkpoint loader."),
                CLUSTER.Input("cluster", tooltip="The rank cluster, from PatchRay Cluster."),
                io.Combo.Input(
                    "mode",
                    options=["auto", "row", "tile-runs"],
                    default="auto",
                    tooltip="auto: row mode when the links allow it, else tiles. row: exact, needs fast links. tile-runs: whole tiles per rank, little traffic.",
                ),
                _precision_input(),
                io.Boolean.Input(
                    "gn_sync",
                    default=False,
                    tooltip="Tile modes only: share GroupNorm statistics between tiles so colours match the full decode (one extra collective per norm).",
                ),
                TILE_PLAN.Input("plan", optional=True, tooltip="Optional tile plan from PatchRay Tile Planner (tile-runs mode); without it the planner's balanced plan is used."),
            ],
            outputs=[io.Image.Output(display_name="IMAGE", tooltip="The decoded image(s), like the stock VAE Decode: [B, H, W, 3] in 0..1; video frames in the batch.")],
        )

    @classmethod
    def execute(cls, samples, vae, cluster, mode="auto", precision="auto", gn_sync=False, plan=None) -> io.NodeOutput:
        from ..distributed.cluster import get_cluster
        from ..distributed.vae.api import distributed_decode
        from ..distributed.vae.convert import UnsupportedVaeError

        z = cv.latent_tensor(samples)
        plan = cv.plan_dict(plan)
        try:
            spec = cv.vae_spec(vae)
        except UnsupportedVaeError as exc:
            note = _fallback_note(exc, "decode")
            return io.NodeOutput(cv.stock_decode(vae, samples), ui=ui.PreviewText(note))
        progress = progress_callback(1)
        x = distributed_decode(
            get_cluster(cluster),
            spec,
            z,
            mode=mode,
            plan=plan,
            dtype=cv.resolve_dtype(precision, vae),
            gn_sync=bool(gn_sync),
            cancel_check=interrupt_check(),
        )
        if progress is not None:
            progress(1)
        return io.NodeOutput(cv.decoded_to_image(x))


class PatchRayVAEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayVAEEncode",
            display_name="PatchRay Distributed VAE Encode",
            category=f"{CATEGORY}/vae",
            description=(
                "Encodes an image (or video frames) across the cluster's ranks, row-sharded, and returns the latent mean "
                "like the stock VAE Encode. A VAE family PatchRay cannot shard falls back to ComfyUI's own encode, with a warning."
            ),
            inputs=[
                io.Image.Input("pixels", tooltip="The image(s) to encode, [B, H, W, C] in 0..1; for video VAEs the batch is the frames."),
                io.Vae.Input("vae", tooltip="ComfyUI's VAE, from the stock Load VAE or checkpoint loader."),
                CLUSTER.Input("cluster", tooltip="The rank cluster, from PatchRay Cluster."),
                _precision_input(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT", tooltip="The latent, like the stock VAE Encode: {'samples': tensor}.")],
        )

    @classmethod
    def execute(cls, pixels, vae, cluster, precision="auto") -> io.NodeOutput:
        from ..distributed.cluster import get_cluster
        from ..distributed.vae.api import distributed_encode
        from ..distributed.vae.convert import UnsupportedVaeError
        from ..distributed.vae.families import get_family

        try:
            spec = cv.vae_spec(vae)
        except UnsupportedVaeError as exc:
            note = _fallback_note(exc, "encode")
            return io.NodeOutput({"samples": cv.stock_encode(vae, pixels)}, ui=ui.PreviewText(note))
        fam = get_family(spec.family)
        ratio = 2 ** (len(spec.config["block_out_channels"]) - 1) if "block_out_channels" in spec.config else fam.spatial_ratio
        x = cv.image_to_sample(pixels, ratio, fam.is_video)
        z = distributed_encode(get_cluster(cluster), spec, x, dtype=cv.resolve_dtype(precision, vae), cancel_check=interrupt_check())
        return io.NodeOutput({"samples": z})
