"""The ranks follow ComfyUI's memory and process lifecycle: "Free model" frees them too, and stopping ComfyUI stops Ray.

ComfyUI 0.3.64 offers no event for either, so the bridge wraps what ComfyUI calls:

* **Unloading models.** ComfyUI's "Unload Models" / "Free model and node cache" actions (the ``/free`` route with
  ``unload_models`` or ``free_memory``) end in ``comfy.model_management.unload_all_models()``, which ``main.py``
  looks up on the module at each call (as does the out-of-memory path in ``execution.py``). PatchRay replaces that
  module attribute with a wrapper that calls the original first and then drops the models and weights cached on
  the ranks (:func:`~patchray.distributed.cluster.free_rank_caches`; the ranks stay up, so the next prompt only
  ships the weights again). The wrapper never raises because of PatchRay, and :func:`uninstall` puts the original
  back when the attribute is still the wrapper (when another pack wrapped it since, PatchRay's layer turns into a
  pass-through instead, so that pack's wrapper keeps working).
* **SIGTERM.** ComfyUI installs no SIGTERM handler, so the process dies at once and the embedded Ray's helper
  processes (GCS, raylet, a loopback listener) linger for a minute or two. PatchRay's handler stops the ranks and
  the embedded Ray, then hands the signal to the previous handler (the default one terminates the process, with
  the same exit status as before). Installed from the main thread only (Python requires it); a no-op where the
  platform has no SIGTERM. An existing Ray cluster (``address=``) is only disconnected from, never stopped.
  (``ray.init`` installs its own SIGTERM handler only when called from the main thread; in ComfyUI the ranks start
  on the prompt worker's thread, so PatchRay's handler stays the one in place.)

Both are installed once per process by :func:`install` (called when ComfyUI loads the extension).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable, Optional

__all__ = ["install", "uninstall", "installed"]

log = logging.getLogger(__name__)

_state = {"unload": None, "sigterm": None}  # the installed wrapper / the previous SIGTERM handler
_lock = threading.Lock()


def _free_ranks() -> None:
    try:
        from ...distributed.cluster import free_rank_caches

        free_rank_caches()
    except Exception as exc:  # never break ComfyUI's own unload
        log.warning("PatchRay: could not free the ranks' cached models: %s", exc)


def _make_unload_wrapper(original: Callable) -> Callable:
    def unload_all_models(*args, **kwargs):
        result = original(*args, **kwargs)
        if wrapper.active:
            _free_ranks()
        return result

    wrapper = unload_all_models
    wrapper.active = True
    wrapper.__wrapped__ = original
    wrapper.__doc__ = (original.__doc__ or "") + "\n\n(PatchRay: also frees the models cached on the rank processes.)"
    return wrapper


def _install_unload(mm) -> None:
    current = getattr(mm, "unload_all_models", None)
    if current is None:
        return
    if _state["unload"] is not None and _state["unload"][1] is current and current.active:
        return  # already installed
    wrapper = _make_unload_wrapper(current)
    mm.unload_all_models = wrapper
    _state["unload"] = (mm, wrapper)


def _stop_ray_now() -> None:
    try:
        from ...distributed.cluster import shutdown_cluster

        shutdown_cluster(stop_ray=True, lock_timeout_s=2.0)  # bounded: a prompt may be running on the ranks
    except Exception as exc:
        log.warning("PatchRay: stopping Ray on SIGTERM failed: %s", exc)


def _on_sigterm(signum, frame):
    _stop_ray_now()
    previous = _state["sigterm"]
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    # the default action: terminate, as the process would have without PatchRay
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_sigterm() -> None:
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not allowed here (an embedding host): leave it
        return
    _state["sigterm"] = current


def install(model_management=None) -> None:
    """Install the unload wrapper and the SIGTERM handler (idempotent).

    Args:
        model_management: the module to wrap (default ``comfy.model_management``; skipped when ComfyUI is absent).
    """
    with _lock:
        mm = model_management
        if mm is None:
            try:
                import comfy.model_management as mm
            except ImportError:
                mm = None
        if mm is not None:
            _install_unload(mm)
        _install_sigterm()


def uninstall() -> None:
    """Undo :func:`install`: the original ``unload_all_models`` and SIGTERM handler are back (or PatchRay's layers
    pass through, where another wrapper was installed on top since)."""
    with _lock:
        if _state["unload"] is not None:
            mm, wrapper = _state["unload"]
            wrapper.active = False
            if getattr(mm, "unload_all_models", None) is wrapper:
                mm.unload_all_models = wrapper.__wrapped__
            _state["unload"] = None
        if hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                previous = _state["sigterm"]
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        _state["sigterm"] = None


def installed() -> dict:
    """What is installed now: ``{"unload": bool, "sigterm": bool}``."""
    unload = _state["unload"]
    sigterm = hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm
    return {"unload": unload is not None and unload[1].active, "sigterm": bool(sigterm)}
