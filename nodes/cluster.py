"""The Cluster node: configure the embedded rank cluster or a Ray cluster to join; hand a handle to the other nodes.

The node checks its widgets against this machine (rank count, GPUs) and starts nothing: the ranks start when a node
first uses the handle, after that node has refused what cannot run (a layout the rank count cannot hold, a model
PatchRay does not cover, a latent too small for the ranks), so a refusal costs no start-up. They then stay up for
later prompts.
"""

from __future__ import annotations

from ._comfy import io, ui
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
                "PatchRay's rank cluster (one process per GPU, on an embedded local Ray) or an existing Ray cluster to "
                "join. The ranks start when a PatchRay node first uses them, after that node has checked its inputs; "
                "they outlive the prompt, and changing a setting rebuilds them."
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
                CLUSTER.Output(display_name="cluster", tooltip="Handle to the cluster, for the other PatchRay nodes (the first to use it starts the ranks)."),
                io.String.Output(display_name="info", tooltip="The ranks, their devices and the process-group backend, as JSON (started: false until a node has used them)."),
            ],
        )

    @classmethod
    def execute(cls, num_ranks, device, address="", gpu_ids="") -> io.NodeOutput:
        config = cluster_config(num_ranks, device, address, gpu_ids)
        text, summary = diagnostics.describe_cluster(config)  # starts nothing: the first node to use the handle does
        return io.NodeOutput(config, text, ui=ui.PreviewText(summary))
