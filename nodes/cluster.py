"""The Cluster node: start the embedded rank cluster or join a Ray cluster; hand a handle to the other nodes."""

from __future__ import annotations

from ._comfy import interrupt_check, io, ui
from .bridge import diagnostics
from .bridge.diagnostics import cluster_config
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayCluster", "cluster_config"]


class PatchRayCluster(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayCluster",
            display_name="PatchRay Cluster",
            category=f"{CATEGORY}/cluster",
            description=(
                "Starts PatchRay's rank cluster (one process per GPU, on an embedded local Ray) or joins an existing "
                "Ray cluster. The cluster outlives the prompt; changing a setting rebuilds it."
            ),
            inputs=[
                io.Int.Input("num_ranks", default=2, min=1, max=64, tooltip="Number of ranks (one GPU each; CPU processes when device is cpu)."),
                io.Combo.Input(
                    "device",
                    options=["auto", "cuda", "cpu"],
                    default="auto",
                    tooltip="auto: GPU ranks when the machine has enough GPUs, else CPU ranks. cuda: require GPUs. cpu: CPU ranks (testing).",
                ),
                io.String.Input(
                    "address",
                    default="",
                    tooltip="Empty: start an embedded Ray bound to 127.0.0.1. Otherwise an existing Ray cluster ('auto', 'host:6379' or 'ray://host:10001').",
                ),
                io.String.Input(
                    "gpu_ids",
                    default="",
                    tooltip="Optional comma-separated GPU indices, one per rank (e.g. '0,2'). Empty: Ray assigns free GPUs.",
                ),
            ],
            outputs=[
                CLUSTER.Output(display_name="cluster", tooltip="Handle to the running cluster, for the other PatchRay nodes."),
                io.String.Output(display_name="info", tooltip="The ranks, their devices and the process-group backend, as JSON."),
            ],
        )

    @classmethod
    def execute(cls, num_ranks, device, address="", gpu_ids="") -> io.NodeOutput:
        config = cluster_config(num_ranks, device, address, gpu_ids)
        text, summary = diagnostics.start_cluster(config, cancel_check=interrupt_check())
        return io.NodeOutput(config, text, ui=ui.PreviewText(summary))
