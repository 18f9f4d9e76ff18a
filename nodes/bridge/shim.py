"""The bridge's one import shim: the library is ``patchray`` however ComfyUI loaded the pack.

ComfyUI imports a custom-node folder under its full path (``/x/ComfyUI/custom_nodes/PatchRay``), so a plain relative
import would load ``distributed/`` as ``/x/.../PatchRay.distributed.*``. Ray pickles classes and functions by their
module name, and a rank process cannot import a module named after a path: the rank actors would fail to start.

What :func:`use_canonical_library` guarantees, once ``<pack>.nodes`` is imported (``nodes/__init__.py`` calls it
before any node module is imported):

1. ``import patchray`` in this process resolves to this pack's folder: either the installed package already is this
   folder, or a folder holding only a ``patchray`` link to the pack (``$TMPDIR/patchray-import-<uid>-<hash of the pack folder>``) is put first
   on ``sys.path`` and on ``os.environ["PYTHONPATH"]``, which the rank processes inherit. Only that one name is
   exposed: the pack's parent folder on the path would shadow ComfyUI's own ``nodes`` module.
2. Every module ``<pack>.distributed[.x]`` is the module object ``patchray.distributed[.x]`` (a meta-path finder
   maps the names; the module is executed once, under the canonical name). So every class and function of
   ``distributed/`` the nodes reach has ``__module__`` ``patchray.distributed...`` and Ray pickles it by a name the
   ranks can import; ``distributed/`` itself always runs as ``patchray.distributed``.
3. The node modules keep ComfyUI's name (``<pack>.nodes...``): nothing of theirs travels to the ranks. The code the
   ranks run from the bridge is named by its canonical string (``patchray.nodes.bridge.ksampler_rank:sample``).
4. If another package named ``patchray`` shadows this pack, importing the nodes fails with an ``ImportError``
   that says so, rather than running two copies of the library.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.util
import os
import sys
import tempfile

__all__ = ["use_canonical_library", "CANONICAL"]

CANONICAL = "patchray"
_PACK_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # nodes/bridge/shim.py


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


def _same_pack(spec) -> bool:
    return bool(spec and spec.origin and os.path.dirname(os.path.realpath(spec.origin)) == _PACK_DIR)


def _staging_dir() -> str:
    # one folder per user and pack folder: two ComfyUI servers with different PatchRay checkouts on one machine must
    # not re-point each other's link (their rank processes would import the other checkout)
    tag = hashlib.sha1(os.path.realpath(_PACK_DIR).encode()).hexdigest()[:12]
    root = os.path.join(tempfile.gettempdir(), f"patchray-import-{os.getuid() if hasattr(os, 'getuid') else 0}-{tag}")
    os.makedirs(root, exist_ok=True)
    link = os.path.join(root, CANONICAL)
    if not (os.path.islink(link) and os.path.realpath(link) == os.path.realpath(_PACK_DIR)):
        tmp = f"{link}.{os.getpid()}"
        os.symlink(_PACK_DIR, tmp)
        os.replace(tmp, link)
    return root


def use_canonical_library(pack_name: str) -> None:
    """Route ``<pack_name>.distributed`` to ``patchray.distributed`` (no-op when the pack *is* ``patchray``)."""
    if pack_name == CANONICAL:
        return
    if not _same_pack(importlib.util.find_spec(CANONICAL)):
        root = _staging_dir()
        sys.path.insert(0, root)
        # the rank processes inherit this (the cluster passes the driver's PYTHONPATH on to them)
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        importlib.invalidate_caches()
        if not _same_pack(importlib.util.find_spec(CANONICAL)):
            raise ImportError(f"another '{CANONICAL}' package shadows this pack ({_PACK_DIR}); uninstall it")
    if not any(isinstance(f, _CanonicalFinder) and f.pack_name == pack_name for f in sys.meta_path):
        sys.meta_path.insert(0, _CanonicalFinder(pack_name))
