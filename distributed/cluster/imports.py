"""How the rank processes import this library and the functions the driver sends them.

Design decisions:

* **One name on the ranks: ``patchray``.** Ray pickles classes and functions by module name, so the driver must
  use the library under the name the ranks import it by. A driver that imported the library under another
  root name (a checkout imported by its folder name) is refused at once with the fix
  (:func:`require_canonical_root`), rather than failing later on a rank with ``No module named ...``: the
  rank actor's own class could not be found there. Whoever loads the package under another name maps that
  name onto ``patchray`` before importing the library (the pack's node layer does).
* **The ranks can import ``patchray`` even when it is not pip-installed** (a checkout loaded by path): a folder
  holding only a ``patchray`` link to this package (:func:`staging_dir`) goes on the ranks' import path
  (:func:`staging_pythonpath`). Only that one name is exposed; putting the package's parent folder on the path
  would expose its siblings (and shadow ComfyUI's own ``nodes`` module).
* **One staging helper for the driver and the ranks.** The node layer's import shim puts the same folder on
  ComfyUI's own ``sys.path`` before ``patchray`` can be imported at all, so it loads this file by its path: the
  module level uses the standard library only, and the staging functions need nothing else.
* **The package's functions travel by name** (``patchray.x:y``, :func:`fn_ref` / :func:`resolve_fn`), the
  library's and the node layer's alike: a function defined in a file of this package is named by that file's place
  in it, whatever name the driver imported it under (ComfyUI imports the node layer under its folder's path, a name
  no rank can import). Callers pass the function itself, never a hand-written string; any other callable is
  pickled by Ray as usual.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
from typing import Any, Callable

__all__ = ["CANONICAL", "DRIVER_ROOT", "PACK_DIR", "fn_ref", "resolve_fn", "require_canonical_root", "is_this_pack", "staging_dir",
           "staging_pythonpath"]

#: the name this package has on the ranks
CANONICAL = "patchray"
#: the name this package has in this process
DRIVER_ROOT = __name__.rsplit(".distributed.cluster", 1)[0]
#: the package's folder (the repository root)
PACK_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the package's top-level folders whose functions travel by name (the rest of the checkout is not packaged)
_PACKAGED = ("distributed", "nodes")


def require_canonical_root() -> None:
    """Refuse a driver that imported this library under another root name (see the module docstring)."""
    if DRIVER_ROOT != CANONICAL:
        from .errors import ClusterSetupError

        raise ClusterSetupError(
            f"this library was imported as '{DRIVER_ROOT}.distributed', but the rank processes import it as "
            f"'{CANONICAL}.distributed', so Ray could not find its classes there: import it as '{CANONICAL}' "
            f"(pip install the package, or map '{DRIVER_ROOT}.distributed' onto '{CANONICAL}.distributed' before "
            "importing the library)"
        )


def is_this_pack(spec) -> bool:
    """Whether a module spec found for ``patchray`` is this package's folder (through any link to it)."""
    return bool(spec and spec.origin and os.path.dirname(os.path.realpath(spec.origin)) == os.path.realpath(PACK_DIR))


def _staging_root() -> str:
    # one folder per checkout: two ComfyUI installs (or test runs) of one user must not re-point each other's link
    # while their ranks start
    pack = hashlib.sha1(os.path.realpath(PACK_DIR).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"patchray-import-{os.getuid() if hasattr(os, 'getuid') else 0}-{pack}")


def staging_dir() -> str:
    """The folder holding only a ``patchray`` link to this package, made (or re-pointed) if needed."""
    root = _staging_root()
    os.makedirs(root, exist_ok=True)
    link = os.path.join(root, CANONICAL)
    if not (os.path.islink(link) and os.path.realpath(link) == os.path.realpath(PACK_DIR)):
        tmp = f"{link}.{os.getpid()}"
        try:
            os.symlink(PACK_DIR, tmp)
            os.replace(tmp, link)  # atomic: a rank starting meanwhile sees the old link or the new one
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    return root


def staging_pythonpath() -> str:
    """A folder that makes ``import patchray`` find this package, or ``""`` when it is installed as ``patchray``."""
    spec = importlib.util.find_spec(CANONICAL)
    if is_this_pack(spec) and os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))) != _staging_root():
        return ""  # installed (editable or not): the ranks find it in the same site-packages
    return staging_dir()


def _canonical_module(mod: str) -> str:
    """``patchray.<path>`` of a module defined in a file of this package (any import name), else ``""``."""
    if mod == DRIVER_ROOT or mod.startswith(DRIVER_ROOT + "."):
        return f"{CANONICAL}{mod[len(DRIVER_ROOT):]}"
    path = getattr(sys.modules.get(mod), "__file__", None)
    if not path:
        return ""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(PACK_DIR))
    if rel.startswith(os.pardir) or os.path.isabs(rel) or not rel.endswith(".py"):
        return ""
    parts = rel[: -len(".py")].split(os.sep)
    if parts[0] not in _PACKAGED:  # tests and tools live in the checkout, not in the package the ranks import
        return ""
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([CANONICAL, *parts]) if all(p.isidentifier() for p in parts) else ""


def fn_ref(fn: Callable) -> Any:
    """A function of this package as ``"patchray.module:qualname"``; any other callable unchanged (Ray pickles it).

    Example::

        >>> fn_ref(resolve_fn)
        'patchray.distributed.cluster.imports:resolve_fn'
    """
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or "<" in qual or isinstance(fn, str):
        return fn
    canonical = _canonical_module(mod)
    return f"{canonical}:{qual}" if canonical else fn


def resolve_fn(fn: Any) -> Any:
    """The callable named by :func:`fn_ref`'s string (``"module:qualname"``), or ``fn`` itself."""
    if isinstance(fn, str):
        mod, _, qual = fn.partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    return fn
