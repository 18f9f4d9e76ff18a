"""The embedded Ray's own processes, watched: a dead GCS or raylet costs the prompt that used it, never the host.

Why: Ray's driver library ends the process it runs in when that process's Ray dies under it. Measured with Ray 2.60
by the soak harness (``tests/comfyui/soak.py``) in a real ComfyUI server: with its raylet SIGKILLed, ComfyUI ended at
the next PatchRay prompt (the driver's next write to the object store: "The connection to the plasma store is
failed. Terminate the process"); with its GCS SIGKILLed, ComfyUI ended 60 s later with no prompt running ("Failed to
connect to GCS within 60 seconds"); and the rank processes outlived their raylet by a minute, holding their models.

Design decisions:

* **Only the embedded Ray is watched.** Its GCS and raylet are children of this process (Ray keeps their ``Popen``
  objects), so a death is seen by ``waitpid`` within :data:`POLL_S`, without asking Ray, whose calls block while its
  GCS is gone. An existing cluster (``address=``) belongs to its operator and is not watched.
* **On a death**, in this order: every rank cluster of this process is marked lost (its calls and its wait loops
  raise :class:`~.errors.RankFailure` naming the process within half a second, and it makes no more Ray calls, which
  would block on the dead GCS); its rank processes are killed by PID (they run on this machine); then, once a call in
  flight has left (bounded), Ray is shut down in this process, which stops its fatal timers. The next
  :func:`~.registry.get_cluster` starts a fresh embedded Ray. ``ray.shutdown()`` with a dead GCS takes a few seconds
  when the cluster's own Ray calls (``ray.kill``, removing the placement group) are skipped; with them it blocks past
  the 60 s after which Ray would end the process.
* **The dead Ray's helpers go with it.** The raylet starts helper processes (its dashboard and runtime-env agents);
  when the raylet dies they are re-parented and lingered about a minute (soak harness: 51-63 s), holding their
  ports. The watchdog keeps the list of the raylet's descendants (refreshed every :data:`_HELPERS_EVERY_S`) and kills
  the ones still running, by PID and start time, once this process's Ray is shut down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional

__all__ = ["POLL_S", "dead_processes", "reason_for", "watch", "lost_reason", "on_ray_death"]

log = logging.getLogger(__name__)

#: how often the embedded Ray's GCS and raylet are checked (a ``waitpid`` each: cheap)
POLL_S = 0.25
#: how long the shutdown waits for a call or a cluster start in flight to leave before it shuts Ray down anyway
_LEAVE_S = 15.0
#: how often the list of the raylet's descendant processes is refreshed
_HELPERS_EVERY_S = 2.0

_state = {"lost": None, "node": None}
_lock = threading.Lock()


def _essential(node) -> dict:
    from ray._private import ray_constants

    procs = getattr(node, "all_processes", None) or {}
    return {name: procs.get(name, ()) for name in (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET)}


def dead_processes(node=None) -> List[str]:
    """Names of the embedded Ray's GCS and raylet processes that have exited (``[]``: none, or Ray not embedded here).

    Args:
        node: Ray's ``Node`` object of the embedded Ray (default: this process's current one).
    """
    if node is None:
        import ray

        node = getattr(ray._private.worker.global_worker, "node", None)
    dead = []
    for name, infos in _essential(node).items():
        for info in infos:
            process = getattr(info, "process", None)
            if process is not None and process.poll() is not None:
                dead.append(name)
                break
    return dead


def reason_for(dead: List[str]) -> str:
    """What the user reads when the embedded Ray's ``dead`` processes (``dead_processes()``) took the ranks along."""
    names = {"gcs_server": "GCS", "raylet": "raylet"}
    return (f"the embedded Ray's {' and '.join(names.get(d, d) for d in dead)} process exited (killed, or out of "
            "memory); PatchRay stopped the ranks and this process's Ray, and the next prompt starts them again")


def lost_reason() -> Optional[str]:
    """Why this process's embedded Ray was given up (``None`` while it is healthy or after a fresh one started)."""
    return _state["lost"]


def watch() -> None:
    """Start watching this process's embedded Ray (call right after ``ray.init`` started it; idempotent per Ray)."""
    import ray

    node = getattr(ray._private.worker.global_worker, "node", None)
    if node is None or not any(_essential(node).values()):
        return  # not a Ray this process started (an existing cluster): its operator's
    with _lock:
        if _state["node"] is node:
            return
        _state["node"], _state["lost"] = node, None
    threading.Thread(target=_watch, args=(node,), name="patchray-ray-watchdog", daemon=True).start()


def _raylet_descendants(node) -> Dict[int, float]:
    """The processes the raylet started, and theirs (``{pid: start time}``; empty when the raylet is gone)."""
    from ray._private import ray_constants

    try:
        import psutil  # a dependency of Ray

        found = {}
        for info in (getattr(node, "all_processes", None) or {}).get(ray_constants.PROCESS_TYPE_RAYLET, ()):
            process = getattr(info, "process", None)
            if process is None or process.poll() is not None:
                continue
            for child in psutil.Process(process.pid).children(recursive=True):
                try:
                    found[child.pid] = child.create_time()
                except psutil.Error:
                    pass
        return found
    except Exception:  # the raylet went while it was read: the last list stands
        return {}


def _kill_helpers(helpers: Dict[int, float]) -> int:
    """SIGKILL the processes of ``helpers`` that still run (the same start time: never a process that reused the PID)."""
    killed = 0
    try:
        import psutil
    except ImportError:
        return 0
    for pid, started in helpers.items():
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                killed += 1
        except psutil.Error:
            pass
    return killed


def _watch(node) -> None:
    import ray

    stop = threading.Event()
    helpers: Dict[int, float] = {}
    next_list = 0.0
    while not stop.wait(POLL_S):
        if ray._private.worker.global_worker.node is not node:
            return  # Ray was shut down (and maybe started again, watched by its own thread)
        dead = dead_processes(node)
        if dead:
            helpers.update(_raylet_descendants(node))  # a dead GCS leaves the raylet running: its helpers now
            _give_up(node, dead, helpers)
            return
        if time.monotonic() >= next_list:
            helpers = _raylet_descendants(node) or helpers
            next_list = time.monotonic() + _HELPERS_EVERY_S


#: what runs when a watched Ray dies, in registration order: ``handler(node, reason, leave_s)``. The cluster
#: registry registers the one that abandons this Ray's rank clusters and shuts the Ray down (``registry.py``), so
#: this module, which ``ray_setup`` starts, imports nothing of the clusters it protects.
_handlers: List[Callable] = []


def on_ray_death(handler: Callable) -> None:
    """Run ``handler(node, reason, leave_s)`` when a watched embedded Ray dies (registered once)."""
    if handler not in _handlers:
        _handlers.append(handler)


def _give_up(node, dead: List[str], helpers: Optional[Dict[int, float]] = None) -> None:
    reason = reason_for(dead)
    with _lock:
        _state["lost"] = reason
    log.error("PatchRay: %s", reason)
    for handler in list(_handlers):
        try:
            handler(node, reason, _LEAVE_S)
        except Exception:  # noqa: BLE001 - the next handler, and the helpers' cleanup, must still run
            log.exception("PatchRay: giving up the dead Ray")
    killed = _kill_helpers(helpers or {})
    log.info("PatchRay: this process's Ray is shut down (%d of its helper processes stopped); the next PatchRay prompt "
             "starts a fresh one", killed)
