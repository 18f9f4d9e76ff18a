"""The bridge's one import shim: the library is ``patchray`` however ComfyUI loaded the pack.

ComfyUI imports a custom-node folder under its full path (``/x/ComfyUI/custom_nodes/PatchRay``), so a plain relative
import would load ``distributed/`` as ``/x/.../PatchRay.distributed.*``. Ray pickles classes and functions by their
module name, and a rank process cannot import a module named after a path: the rank actors would fail to start.

What :func:`use_canonical_library` guarantees, once ``<pack>.nodes`` is imported (``nodes/__init__.py`` calls it
before any node module is imported):

1. ``import patchray`` in this process resolves to this pack's folder: either the installed package already is this
   folder, or the library's staging folder (``distributed/cluster/imports.py``: a folder holding only a ``patchray``
   link to the pack) is put first on ``sys.path`` and on ``os.environ["PYTHONPATH"]``, which the rank processes
   inherit. Only that one name is exposed: the pack's parent folder on the path would shadow ComfyUI's own ``nodes``
   module. That helper is loaded by its file path: ``patchray`` cannot be imported yet, and importing it relatively
   would load ``distributed/`` under the path name this shim exists to avoid.
2. Every module ``<pack>.distributed[.x]`` is the module object ``patchray.distributed[.x]`` (a meta-path finder
   maps the names; the module is executed once, under the canonical name). So every class and function of
   ``distributed/`` the nodes reach has ``__module__`` ``patchray.distributed...`` and Ray pickles it by a name the
   ranks can import; ``distributed/`` itself always runs as ``patchray.distributed``.
3. The node modules keep ComfyUI's name (``<pack>.nodes...``): no object of theirs travels to the ranks. The code the
   ranks run from the bridge is passed as the function itself, and the cluster sends it by its canonical name
   (``patchray.nodes.bridge.ksampler_rank:sample``: ``cluster.fn_ref`` names a function by its file in the pack).
4. If another package named ``patchray`` shadows this pack, importing the nodes fails with an ``ImportError``
   that says so, rather than running two copies of the library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

__all__ = ["use_canonical_library", "CANONICAL"]

_PACK_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # nodes/bridge/shim.py


def _load_staging():
    """``distributed/cluster/imports.py`` under a private name (stdlib only at module level; see the docstring)."""
    path = os.path.join(_PACK_DIR, "distributed", "cluster", "imports.py")
    spec = importlib.util.spec_from_file_location("_patchray_import_staging", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_STAGING = _load_staging()
CANONICAL = _STAGING.CANONICAL


class _CanonicalFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``<pack>.distributed.x`` -> the module object ``patchray.distributed.x``."""

    def __init__(self, pack_name: str):
        self.pack_name = pack_name
        self.alias = f"{pack_name}.distributed"

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.alias or fullname.startswith(self.alias + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(CANONICAL + spec.name[len(self.pack_name):])

    def exec_module(self, module):
        pass  # already executed under its canonical name


def use_canonical_library(pack_name: str) -> None:
    """Route ``<pack_name>.distributed`` to ``patchray.distributed`` (no-op when the pack *is* ``patchray``)."""
    if pack_name == CANONICAL:
        return
    if not _STAGING.is_this_pack(importlib.util.find_spec(CANONICAL)):
        root = _STAGING.staging_dir()
        sys.path.insert(0, root)
        # the rank processes inherit this (the cluster passes the driver's PYTHONPATH on to them)
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        importlib.invalidate_caches()
        if not _STAGING.is_this_pack(importlib.util.find_spec(CANONICAL)):
            raise ImportError(f"another '{CANONICAL}' package shadows this pack ({_PACK_DIR}); uninstall it")
    if not any(isinstance(f, _CanonicalFinder) and f.pack_name == pack_name for f in sys.meta_path):
        sys.meta_path.insert(0, _CanonicalFinder(pack_name))
