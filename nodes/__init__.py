"""PatchRay's ComfyUI nodes (V3 schema). Imported only by ``comfy_entrypoint`` (ComfyUI present).

Every node is a thin ``io.ComfyNode``: ``execute`` validates, converts ComfyUI objects, calls one function
from ``distributed/`` and converts the result back. Node ids are prefixed ``PatchRay`` and never renamed.

The node modules load lazily (``NODES`` / ``PatchRayExtension`` on first access): the rank processes import
``patchray.nodes._ksampler_rank`` (ComfyUI's sampler, run on each rank) without pulling in the V3 schema API.
"""

from __future__ import annotations

from ._library import use_canonical_library

use_canonical_library(__name__.rsplit(".", 1)[0])  # before any node module imports ..distributed

__all__ = ["PatchRayExtension", "NODES"]


def __getattr__(name):
    if name in __all__:
        from . import _extension

        return getattr(_extension, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
