"""The process-wide rank cluster: one :class:`~.ranks.RankCluster` per process, reused across calls.

:func:`get_cluster` rebuilds it only when its configuration changes or after a fault (a rank process that went away
between calls counts: it would fail the next call), so a second call pays no start-up; :func:`running_cluster` describes it without starting anything; :func:`free_rank_caches` and
:func:`shutdown_cluster` are bounded, for callers that must not hang (ComfyUI's model unloading, signal handlers).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, List, Optional

from .config import ClusterConfig
from .ranks import RankCluster, abandon_all
from .ray_setup import forget_ray
from .watchdog import on_ray_death

__all__ = ["get_cluster", "running_cluster", "shutdown_cluster", "free_rank_caches", "give_up_ray"]

log = logging.getLogger(__name__)

_current: Optional[RankCluster] = None
_current_lock = threading.Lock()


def get_cluster(config: Optional[ClusterConfig] = None, cancel_check: Optional[Callable[[], None]] = None, **overrides) -> RankCluster:
    """Return the process-wide cluster for ``config``, building (or rebuilding) it when needed.

    ``cancel_check`` is polled about twice a second while a new cluster starts (placing, starting the ranks, forming
    the group); when it raises, the ranks started so far are stopped and its exception propagates.
    """
    global _current
    config = config or ClusterConfig()
    if overrides:
        config = dataclasses.replace(config, **overrides)
    with _current_lock:
        if _current is not None and _current.config == config and not _current.broken:
            if _current.usable():
                return _current
            # a rank's process went away between calls (killed, out of memory): the next call would fail on it
            log.warning("a rank of the cluster is gone since its last call: starting new ranks")
            _current._kill()
            _current = None
        if _current is not None:
            _current.shutdown()
            _current = None
        _current = RankCluster(config, cancel_check=cancel_check)
        return _current


def _ray_died(node, reason: str, leave_s: float) -> None:
    """The watchdog's handler when this process's embedded Ray died: every rank cluster on it is marked lost and its
    rank processes killed (no Ray calls: they would block on a dead GCS); a call in flight notices within half a
    second and leaves, and so does a cluster start (which holds the registry); then the Ray is given up."""
    clusters = abandon_all(reason, node)
    for cluster in clusters:
        if cluster._lock.acquire(timeout=leave_s):
            cluster._lock.release()
    give_up_ray(node, leave_s)


def give_up_ray(node, wait_s: float) -> None:
    """After this process's embedded Ray died under it (``watchdog.py``, its clusters already abandoned): forget the
    process-wide cluster and shut Ray down in this process, so its driver library does not end the process.

    ``node`` is the Ray ``Node`` that died: Ray is shut down only while it is still this process's (a start in
    progress that already replaced it is left alone). Waits at most ``wait_s`` for a start in progress to leave.
    """
    global _current
    import ray

    locked = _current_lock.acquire(timeout=wait_s)
    try:
        if _current is not None and _current.broken:
            _current = None
        if ray._private.worker.global_worker.node is node:
            try:
                ray.shutdown()
            except Exception as exc:  # what is left of Ray must not take the host down with it
                log.warning("shutting down the lost Ray: %s", exc)
            forget_ray()
    finally:
        if locked:
            _current_lock.release()


def running_cluster(config: ClusterConfig) -> Optional[RankCluster]:
    """The process-wide cluster when it runs with ``config`` and is usable, else ``None``; never starts, never waits.

    For describing a configured cluster without starting its ranks (a start in progress on another thread reads as
    not running)."""
    if not _current_lock.acquire(blocking=False):
        return None
    try:
        cluster = _current
    finally:
        _current_lock.release()
    if cluster is None or cluster.broken or cluster.config != config or not cluster.usable(timeout_s=None):
        return None
    return cluster


def free_rank_caches(timeout_s: float = 10.0) -> List[int]:
    """Drop the cached models and weights on the process-wide cluster's ranks, if there is one (ranks stay up).

    Bounded: returns ``[]`` at once when no cluster runs or one is being started (it has cached nothing yet), and
    within ``timeout_s`` otherwise. Failures are logged, not raised: freeing memory must never break its caller.
    """
    if not _current_lock.acquire(timeout=1.0):
        return []
    try:
        cluster = _current
    finally:
        _current_lock.release()
    if cluster is None:
        return []
    try:
        freed = cluster.free_cached(timeout_s)
    except Exception as exc:  # a dead rank: the next call rebuilds the cluster anyway
        log.warning("could not free the ranks' cached models: %s", exc)
        return []
    log.info("freed the ranks' cached models (%s entries per rank)", freed)
    return freed


def shutdown_cluster(stop_ray: bool = False, lock_timeout_s: Optional[float] = None) -> None:
    """Stop the process-wide cluster (and the embedded Ray if ``stop_ray``).

    ``lock_timeout_s`` bounds the wait for a call or a start in progress on another thread; past it the cluster is
    stopped anyway (for a process that is terminating: that call then fails, which no one will read).
    """
    global _current
    locked = _current_lock.acquire(timeout=-1 if lock_timeout_s is None else lock_timeout_s)
    try:
        cluster, _current = _current, None
        if cluster is not None:
            if locked:
                cluster.shutdown()
            else:
                cluster._kill()  # no graceful close: the other thread may be inside a collective
    finally:
        if locked:
            _current_lock.release()
    if stop_ray:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        forget_ray()


on_ray_death(_ray_died)
