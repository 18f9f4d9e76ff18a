"""What the bridge sends to the ranks by value: code the ranks cannot import by its module's name.

Ray pickles a function or class by its module's name, and a rank process imports that name. ComfyUI loads
``comfy_extras`` and other custom-node packs under their file paths (or folder names such as ``ComfyUI-Foo``), which
no rank can import. :func:`travel_by_value` pickles an object the way Ray will, reads back every module the pickle
names, and registers the ones no rank can import with Ray's pickler to travel by value; whatever does not pickle is
refused by name, before anything reaches a rank.

Both the Parallel Model path (the guider, the sampler, the model options) and the GGUF weights path use it, so it is
a module of its own below both.
"""

from __future__ import annotations

import io as _io
import logging
import os
import pickle
import sys

__all__ = ["travel_by_value"]

log = logging.getLogger(__name__)


def _custom_node_roots() -> list:
    """The folders ComfyUI loads custom nodes from (empty outside ComfyUI)."""
    try:
        import folder_paths

        return [os.path.realpath(p) for p in folder_paths.get_folder_paths("custom_nodes")]
    except Exception:  # outside ComfyUI: nothing counts as another pack's code
        return []


class _Modules(pickle.Unpickler):
    """Reads a pickle back, recording every module it imports a name from."""

    def __init__(self, data: bytes):
        super().__init__(_io.BytesIO(data))
        self.modules = set()

    def find_class(self, module, name):
        self.modules.add(module)
        return super().find_class(module, name)


def travel_by_value(what: str, obj) -> None:
    """Make ``obj`` travel to the ranks, or refuse it by name: code the ranks cannot import by its module's name (other
    custom-node packs; ComfyUI's comfy_extras, which ComfyUI loads under their file paths) is registered with Ray's
    pickler to travel by value; anything that does not pickle is refused."""
    from ray import cloudpickle

    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    roots = _custom_node_roots()
    for _ in range(3):  # registering a pack may reveal the packs its code refers to
        try:
            data = cloudpickle.dumps(obj)
            reader = _Modules(data)
            reader.load()
        except Exception as exc:
            raise NotImplementedError(
                f"PatchRay Parallel Model: {what} cannot travel to the ranks ({type(exc).__name__}: {exc}); sample "
                "this graph without the Parallel Model node, or remove the node that added it") from None
        foreign = set()
        for name in reader.modules:
            module = sys.modules.get(name)
            if module is None:
                continue
            if not all(part.isidentifier() for part in name.split(".")):
                # ComfyUI loads comfy_extras and custom-node packs under their paths (or folder names such as
                # "ComfyUI-Foo"): no rank can import a module by that name
                foreign.add(name)
                continue
            root = name.split(".")[0]
            path = os.path.realpath(getattr(sys.modules.get(root), "__file__", "") or "")
            if path and any(path.startswith(r + os.sep) for r in roots) and not path.startswith(ours + os.sep):
                foreign.add(root)
        new = [m for m in foreign if not cloudpickle.cloudpickle._is_registered_pickle_by_value(sys.modules[m])]
        if not new:
            return
        for m in new:
            log.info("PatchRay Parallel Model: %s uses code of %s, which the ranks cannot import by name: it travels "
                     "by value", what, m)
            cloudpickle.register_pickle_by_value(sys.modules[m])
