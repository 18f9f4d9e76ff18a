"""PatchRay's ComfyUI nodes (V3 schema). Imported only by ``comfy_entrypoint`` (ComfyUI present).

Layers, dependencies pointing one way: the node modules here (schema + one call) -> :mod:`.bridge` (ComfyUI's
objects <-> the library, and the code the ranks run inside ComfyUI) -> ``distributed/`` (no ComfyUI knowledge).
Node ids are prefixed ``PatchRay`` and never renamed.

Importing this package first installs the bridge's import shim (:mod:`.bridge.shim`): the library runs as
``patchray.distributed`` however ComfyUI named the pack. The node modules load lazily (``NODES`` /
``PatchRayExtension`` on first access): the rank processes import ``patchray.nodes.bridge.ksampler_rank``
(ComfyUI's sampler, run on each rank) without pulling in the V3 schema API.
"""

from __future__ import annotations

from .bridge.shim import use_canonical_library

use_canonical_library(__name__.rsplit(".", 1)[0])  # before any node module imports ..distributed

__all__ = ["PatchRayExtension", "NODES"]


def __getattr__(name):
    if name in __all__:
        from . import _extension

        return getattr(_extension, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
