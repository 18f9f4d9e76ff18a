"""The node list and the ``ComfyExtension`` that ``comfy_entrypoint()`` returns."""

from __future__ import annotations

from ._comfy import ComfyExtension
from .bridge import lifecycle
from .bench import PatchRayBenchmark, PatchRaySamplerBenchmark
from .cluster import PatchRayCluster
from .ksampler import PatchRayKSampler, PatchRayKSamplerAdvanced
from .parallel_model import PatchRayParallelModel
from .planner import PatchRayTilePlanner
from .topology import PatchRayTopologyProbe
from .vae import PatchRayParallelVAE, PatchRayVAEDecode, PatchRayVAEEncode

__all__ = ["PatchRayExtension", "NODES"]

NODES = (
    PatchRayCluster,
    PatchRayParallelModel,
    PatchRayVAEDecode,
    PatchRayVAEEncode,
    PatchRayParallelVAE,
    PatchRayKSampler,
    PatchRayKSamplerAdvanced,
    PatchRayTilePlanner,
    PatchRayTopologyProbe,
    PatchRayBenchmark,
    PatchRaySamplerBenchmark,
)


class PatchRayExtension(ComfyExtension):
    """The extension ``comfy_entrypoint()`` returns: PatchRay's explicit node list.

    Loading it installs the lifecycle hooks (:mod:`.bridge.lifecycle`: ComfyUI's "Free model" frees the ranks,
    SIGTERM stops the embedded Ray). ``on_load`` is the place newer ComfyUI versions call for that; 0.3.64 never
    calls it, so ``get_node_list`` (called once, from the main thread, when the pack loads) installs them too.
    Installing is idempotent.
    """

    async def on_load(self) -> None:
        lifecycle.install()

    async def get_node_list(self):
        lifecycle.install()
        return list(NODES)
