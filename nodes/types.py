"""PatchRay's custom wire types, declared once.

``CLUSTER`` carries a :class:`patchray.distributed.cluster.ClusterConfig` (frozen, hashable): every node that
takes it calls ``get_cluster(config)``, which reuses the process-wide cluster or rebuilds it after a fault,
so a cached Cluster node output never points at dead actors. ``TILE_PLAN`` carries ``TilePlan.to_dict()``.
"""

from __future__ import annotations

from ._comfy import io

__all__ = ["CLUSTER", "TILE_PLAN", "CATEGORY"]

CLUSTER = io.Custom("PATCHRAY_CLUSTER")
TILE_PLAN = io.Custom("PATCHRAY_TILE_PLAN")

CATEGORY = "PatchRay"
