"""PatchRay's ComfyUI nodes (V3 schema). Imported only by ``comfy_entrypoint`` (ComfyUI present).

Every node is a thin ``io.ComfyNode``: ``execute`` validates, converts ComfyUI objects, calls one function
from ``distributed/`` and converts the result back. Node ids are prefixed ``PatchRay`` and never renamed.
"""

from __future__ import annotations

from ._comfy import ComfyExtension
from .bench import PatchRayBenchmark
from .cluster import PatchRayCluster
from .planner import PatchRayTilePlanner
from .topology import PatchRayTopologyProbe
from .vae import PatchRayVAEDecode, PatchRayVAEEncode

__all__ = ["PatchRayExtension", "NODES"]

NODES = (
    PatchRayCluster,
    PatchRayVAEDecode,
    PatchRayVAEEncode,
    PatchRayTilePlanner,
    PatchRayTopologyProbe,
    PatchRayBenchmark,
)


class PatchRayExtension(ComfyExtension):
    """The extension ``comfy_entrypoint()`` returns: PatchRay's explicit node list."""

    async def get_node_list(self):
        return list(NODES)
