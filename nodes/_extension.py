"""The node list and the ``ComfyExtension`` that ``comfy_entrypoint()`` returns."""

from __future__ import annotations

from ._comfy import ComfyExtension
from .bench import PatchRayBenchmark
from .cluster import PatchRayCluster
from .ksampler import PatchRayKSampler
from .planner import PatchRayTilePlanner
from .topology import PatchRayTopologyProbe
from .vae import PatchRayVAEDecode, PatchRayVAEEncode

__all__ = ["PatchRayExtension", "NODES"]

NODES = (
    PatchRayCluster,
    PatchRayVAEDecode,
    PatchRayVAEEncode,
    PatchRayKSampler,
    PatchRayTilePlanner,
    PatchRayTopologyProbe,
    PatchRayBenchmark,
)


class PatchRayExtension(ComfyExtension):
    """The extension ``comfy_entrypoint()`` returns: PatchRay's explicit node list."""

    async def get_node_list(self):
        return list(NODES)
