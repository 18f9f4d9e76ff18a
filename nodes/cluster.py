"""The Cluster node: start the embedded rank cluster or join a Ray cluster; hand a handle to the other nodes."""

from __future__ import annotations

import json

from ._comfy import interrupt_check, io, ui
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayCluster", "cluster_config"]


def cluster_config(num_ranks: int, device: str, address: str = "", gpu_ids: str = ""):
    """Validate the widget values and build the ``ClusterConfig`` the wire carries."""
    from ..distributed.cluster import ClusterConfig

    kwargs = dict(num_ranks=int(num_ranks), device=device, address=address.strip() or None)
    try:
        gpus = tuple(int(g) for g in gpu_ids.replace(" ", "").split(",") if g) if gpu_ids and gpu_ids.strip() else ()
    except ValueError:
        raise ValueError(f"gpu_ids must be comma-separated GPU indices such as '0,1' (got {gpu_ids!r})") from None
    if gpus:
        kwargs["gpu_ids"] = gpus  # ClusterConfig checks one GPU per rank, distinct, embedded, not cpu
    return ClusterConfig(**kwargs)


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
        from ..distributed.cluster import get_cluster

        config = cluster_config(num_ranks, device, address, gpu_ids)
        interrupt = interrupt_check()
        if interrupt is not None:
            interrupt()
        info = get_cluster(config).describe()
        text = json.dumps(info, indent=1, default=str)
        summary = f"{info['num_ranks']} {info['device_kind']} rank(s), {info['backend']}: " + ", ".join(map(str, info["devices"]))
        return io.NodeOutput(config, text, ui=ui.PreviewText(summary))
