"""PatchRay: multi-GPU ComfyUI nodes on Ray.

This file is both the ComfyUI entry point (ComfyUI imports the pack folder by its full path) and the
root of the ``patchray`` Python package (``pip install -e .``). It imports nothing from ComfyUI at
import time: ``comfy_entrypoint`` loads the nodes only when ComfyUI asks for them, so the library and
its tests work without ComfyUI.
"""

WEB_DIRECTORY = "./web"

__version__ = "0.1.0"


async def comfy_entrypoint():
    """Return PatchRay's ``ComfyExtension`` (V3 node API)."""
    from .nodes import PatchRayExtension

    return PatchRayExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint", "__version__"]
