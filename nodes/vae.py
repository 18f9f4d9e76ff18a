"""Distributed VAE Decode / Encode: ComfyUI's own VAE and LATENT/IMAGE in, the stock nodes' outputs out. Parallel
VAE: ComfyUI's VAE in, the same VAE out, decoding and encoding on the ranks wherever it is connected.

Schemas only; the work is one call into the bridge (:mod:`.bridge.vae`, :mod:`.bridge.parallel_vae`). The decode
settings are one set of input helpers, so the Parallel VAE's widgets are the Distributed VAE Decode's (names,
options, defaults, tooltips) and a workflow can move from one node to the other.
"""

from __future__ import annotations

from ._comfy import interrupt_check, io, progress_callback, ui
from .bridge import parallel_vae as bridge_parallel
from .bridge import vae as bridge_vae
from .types import CATEGORY, CLUSTER, TILE_PLAN

__all__ = ["PatchRayVAEDecode", "PatchRayVAEEncode", "PatchRayParallelVAE"]


def _vae_input():
    return io.Vae.Input("vae", tooltip="ComfyUI's VAE, from the stock Load VAE or checkpoint loader.")


def _cluster_input():
    return CLUSTER.Input("cluster", tooltip="The rank cluster, from PatchRay Cluster.")


def _mode_input():
    return io.Combo.Input(
        "mode",
        options=["auto", "row", "tile-runs"],
        default="auto",
        tooltip="auto: row mode when the links allow it, else tiles. row: exact, needs fast links. tile-runs: whole tiles per rank, little traffic.",
    )


def _gn_sync_input():
    return io.Boolean.Input(
        "gn_sync",
        default=False,
        tooltip="Tile modes only: share GroupNorm statistics between tiles so colours match the full decode (one extra collective per norm).",
    )


def _plan_input():
    return TILE_PLAN.Input("plan", optional=True, tooltip="Optional tile plan from PatchRay Tile Planner (tile-runs mode); without it the planner's balanced plan is used.")


def _precision_input():
    return io.Combo.Input(
        "precision",
        options=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        tooltip=(
            "Compute dtype on the ranks. auto: the dtype ComfyUI itself would use for this VAE (fp32 on CPU). fp32 matches the "
            "stock node within 1/255. On CPU ranks keep auto or fp32: PyTorch's CPU bf16/fp16 convolutions are many times "
            "slower (a 128x128 SDXL decode took minutes in bf16, seconds in fp32)."
        ),
    )


def _balance_input():
    return io.Combo.Input(
        "balance",
        options=["equal", "speed"],
        default="equal",
        optional=True,
        tooltip=(
            "Row mode: how many rows each rank decodes. equal: the same for every rank. speed: in proportion to each "
            "rank's measured speed (a short benchmark run once per cluster), so a faster GPU takes more rows and a "
            "mixed pair (e.g. 4090 + 3090) finishes together. The image is the same either way; tile modes ignore it."
        ),
    )


def _decode_settings() -> list:
    """The Distributed VAE Decode's inputs after ``samples``, in its order: the Parallel VAE's inputs too."""
    return [_vae_input(), _cluster_input(), _mode_input(), _precision_input(), _gn_sync_input(), _plan_input(), _balance_input()]


def _output(result: "bridge_vae.Result") -> io.NodeOutput:
    if result.note is None:
        return io.NodeOutput(result.value)
    return io.NodeOutput(result.value, ui=ui.PreviewText(result.note))


def _progress():
    """ComfyUI's progress bar for the running node, advanced per stage by the ranks (None outside ComfyUI)."""
    return progress_callback(1)


def _finish(progress) -> None:
    if progress is not None:
        progress(1, 1)


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
                "A VAE family PatchRay cannot shard falls back to ComfyUI's own decode, with a note on the node; a rank that runs "
                "out of memory makes the decode retry in row-tiled mode (smaller pieces), also noted on the node."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The latent to decode (from a sampler or an Empty Latent node)."),
                *_decode_settings(),
            ],
            outputs=[io.Image.Output(display_name="IMAGE", tooltip="The decoded image(s), like the stock VAE Decode: [B, H, W, 3] in 0..1; video frames in the batch.")],
        )

    @classmethod
    def execute(cls, samples, vae, cluster, mode="auto", precision="auto", gn_sync=False, plan=None, balance="equal") -> io.NodeOutput:
        progress = _progress()
        result = bridge_vae.decode(samples, vae, cluster, mode, precision, gn_sync, plan, cancel_check=interrupt_check(), progress=progress,
                                   balance=balance)
        _finish(progress)
        return _output(result)


class PatchRayVAEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayVAEEncode",
            display_name="PatchRay Distributed VAE Encode",
            category=f"{CATEGORY}/vae",
            description=(
                "Encodes an image (or video frames) across the cluster's ranks, row-sharded, and returns the latent mean "
                "like the stock VAE Encode. A VAE family PatchRay cannot shard falls back to ComfyUI's own encode, with a note on the node."
            ),
            inputs=[
                io.Image.Input("pixels", tooltip="The image(s) to encode, [B, H, W, C] in 0..1; for video VAEs the batch is the frames."),
                _vae_input(),
                _cluster_input(),
                _precision_input(),
                _balance_input(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT", tooltip="The latent, like the stock VAE Encode: {'samples': tensor}.")],
        )

    @classmethod
    def execute(cls, pixels, vae, cluster, precision="auto", balance="equal") -> io.NodeOutput:
        progress = _progress()
        result = bridge_vae.encode(pixels, vae, cluster, precision, cancel_check=interrupt_check(), progress=progress, balance=balance)
        _finish(progress)
        return _output(result)


class PatchRayParallelVAE(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayParallelVAE",
            display_name="PatchRay Parallel VAE",
            category=f"{CATEGORY}/vae",
            description=(
                "The VAE, decoding and encoding on the cluster's ranks wherever it is connected: the stock VAE Decode and "
                "VAE Encode, their tiled versions, and any node that encodes or decodes with a VAE. Settings as on PatchRay "
                "Distributed VAE Decode (encodes are row-sharded: mode, gn_sync and plan apply to decodes). The weights are shared with the input VAE (not copied), and the input VAE is "
                "unchanged, so it can still feed stock nodes. Tiled nodes decode whole on the ranks: their tile sizes are not "
                "used, because the ranks already split the work (a band of rows each; a rank out of memory retries in row "
                "tiles) and row mode gives the exact untiled image. A VAE PatchRay cannot shard decodes and encodes as in "
                "ComfyUI, with the reason shown here and in the log."
            ),
            inputs=_decode_settings(),
            outputs=[
                io.Vae.Output(
                    display_name="VAE",
                    tooltip=(
                        "The same VAE, decoding and encoding on the ranks: connect it where the VAE went (VAE Decode, VAE "
                        "Decode (Tiled), VAE Encode...). It returns what the VAE returns; tiled nodes get the untiled result."
                    ),
                )
            ],
        )

    @classmethod
    def execute(cls, vae, cluster, mode="auto", precision="auto", gn_sync=False, plan=None, balance="equal") -> io.NodeOutput:
        hooks = bridge_parallel.Hooks(cancel_check=interrupt_check, progress=_progress)
        return _output(bridge_parallel.parallel_vae(vae, cluster, mode, precision, gn_sync, plan, balance, hooks=hooks))
