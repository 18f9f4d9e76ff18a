"""PatchRay's ComfyUI nodes (V3 schema). Imported only by ``comfy_entrypoint`` (ComfyUI present).

Every node is a thin ``io.ComfyNode``: ``execute`` validates, converts ComfyUI objects, calls one function
from ``distributed/`` and converts the result back. Node ids are prefixed ``PatchRay`` and never renamed.
"""

from __future__ import annotations

from ._library import use_canonical_library

use_canonical_library(__name__.rsplit(".", 1)[0])  # before any node module imports ..distributed

from ._comfy import ComfyExtension  # noqa: E402
from .bench import PatchRayBenchmark  # noqa: E402
from .cluster import PatchRayCluster  # noqa: E402
from .planner import PatchRayTilePlanner  # noqa: E402
from .topology import PatchRayTopologyProbe  # noqa: E402
from .vae import PatchRayVAEDecode, PatchRayVAEEncode  # noqa: E402

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
