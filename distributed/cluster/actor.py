"""The rank side: one Ray actor per rank, its rendezvous, and what a function run on it can use.

Design decisions:

* **The device is what Ray assigned** (``ray.get_gpu_ids()`` / ``CUDA_VISIBLE_DEVICES``), never derived from the
  rank number.
* **Race-free rendezvous.** On one machine the ranks meet through a ``FileStore`` in a fresh temporary folder
  (no listening socket at all). Across nodes, rank 0 opens the ``TCPStore`` on port 0 and reports the port the
  OS gave it; the others connect to it. That store is the one listener PatchRay itself opens (torch binds it
  on every interface; it lives as long as the group). There is no "pick a free port, close it, hope" window.
* **Collectives use the interface Ray uses.** On a cluster, unless ``GLOO_SOCKET_IFNAME`` is set, gloo is
  pointed at the interface that holds the rank's Ray node address: the one the nodes already reach each
  other on (loopback for a loopback cluster), not whatever the host name resolves to.
* **Functions run with** ``fn(ctx, *args, **kwargs)``; :func:`rank_cache` keeps models between calls and
  :func:`report_progress` feeds the driver's progress callback.
"""

from __future__ import annotations

import datetime
import gc
import os
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from .. import comm
from ..context import ParallelContext
from .errors import ClusterSetupError
from .imports import resolve_fn
from .memory import memory_cap
from .ray_setup import package_versions

__all__ = ["rank_cache", "report_progress"]

_RANK_CACHE: Dict[Any, Any] = {}


def rank_cache() -> Dict[Any, Any]:
    """A dict that lives as long as this rank's actor: cache models here by content key."""
    return _RANK_CACHE


# (done, total) of the call running in this process; read by the driver through _RankActor.progress()
_PROGRESS: List[int] = [0, 0]
# the figure the last finished call ended with (_RankActor.last_progress): a call shorter than the driver's poll
# interval still shows its final figure
_LAST_PROGRESS: List[int] = [0, 0]


def report_progress(done: int, total: int) -> None:
    """From inside a function run by :meth:`RankCluster.run`: report ``done`` of ``total`` units of work.

    The driver polls rank 0's figure while it waits and hands it to the ``progress`` callback of ``run``
    (e.g. a progress bar). Cheap (two ints in this process); report from rank 0, other ranks may too.
    """
    _PROGRESS[0], _PROGRESS[1] = int(done), int(total)


class _RankActor:
    """Hosts one rank. Methods are called by :class:`RankCluster` only."""

    def __init__(self, rank: int, world_size: int, device_kind: str, rank_memory_mb: Optional[float] = None,
                 threads: Optional[int] = None):
        self.rank, self.world_size, self.device_kind = rank, world_size, device_kind
        self.rank_memory_mb = rank_memory_mb
        self.ctx: Optional[ParallelContext] = None
        self._store = None
        if device_kind == "cpu":
            threads = threads or max(1, (os.cpu_count() or 1) // max(1, world_size))
            torch.set_num_threads(threads)
        _exit_with_parent()

    def _device(self) -> torch.device:
        if self.device_kind != "cuda":
            return torch.device("cpu")
        import ray

        ids = ray.get_gpu_ids()
        if not ids:
            raise ClusterSetupError(f"rank {self.rank} was given no GPU by Ray")
        # Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU(s): the first visible one is ours.
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            return torch.device("cuda", 0)
        return torch.device("cuda", int(ids[0]))

    def describe(self) -> dict:
        import ray
        import socket

        dev = self._device()
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_ip": _node_ip(),
            "device": str(dev),
            "device_name": name,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "node_id": ray.get_runtime_context().get_node_id(),
            "versions": package_versions(),
        }

    def open_store(self, host: str, timeout_s: float) -> int:
        """Rank 0 only (several nodes): open the rendezvous store on a port the OS picks, return the port."""
        self._store = comm.tcp_store(
            host, 0, self.world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return self._store.port

    def init_group(self, rendezvous: dict, backend: str, timeout_s: float) -> str:
        """Join the process group. ``rendezvous`` is ``{"file": path}`` (one machine) or ``{"host", "port"}``."""
        if "host" in rendezvous and "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = _interface_of(_node_ip())
            if ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        timeout = datetime.timedelta(seconds=timeout_s)
        if self._store is None:
            if "file" in rendezvous:
                self._store = comm.file_store(rendezvous["file"], self.world_size)
            else:
                self._store = comm.tcp_store(rendezvous["host"], rendezvous["port"], self.world_size, is_master=False, timeout=timeout)
        device = self._device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        comm.init_process_group(backend, store=self._store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.ctx = comm.context_for_group(None, device)
        return str(device)

    def call(self, fn, packed):
        """Run ``fn(ctx, *args, **kwargs)``; ``packed`` is the ``(args, kwargs)`` put once by the driver."""
        args, kwargs = packed
        if self.ctx is None:
            raise ClusterSetupError(f"rank {self.rank}: process group not initialised")
        fn = resolve_fn(fn)
        try:
            with memory_cap(self.rank_memory_mb, self.ctx.device, self.rank):
                return fn(self.ctx, *args, **kwargs)
        finally:
            # reset when a call ends (its figure starts at 0 on a new actor): the driver's first poll of the next
            # call may run before that call starts, and must not see this call's figure
            _LAST_PROGRESS[0], _LAST_PROGRESS[1] = _PROGRESS
            _PROGRESS[0] = _PROGRESS[1] = 0
            del args, kwargs, packed
            _return_freed_memory()

    def ping(self) -> int:
        return self.rank

    def progress(self) -> tuple:
        """(done, total) last reported by the running call (answered by the actor's second thread)."""
        return (_PROGRESS[0], _PROGRESS[1])

    def last_progress(self) -> tuple:
        """(done, total) the last finished call ended with."""
        return (_LAST_PROGRESS[0], _LAST_PROGRESS[1])

    def free_cache(self) -> int:
        """Drop what functions cached on this rank (models, weights); returns how many entries were dropped.

        Answered by the actor's second thread, so it also runs while a call is in progress: that call keeps the
        objects it already holds, and the next call loads them again.
        """
        count = len(_RANK_CACHE)
        _RANK_CACHE.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return count

    def close(self) -> None:
        _RANK_CACHE.clear()
        try:
            comm.destroy_process_group()
        except Exception:  # the group may be broken; the process is about to go anyway
            pass
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_LIBC: List[Any] = []


def _return_freed_memory() -> None:
    """Hand the heap memory a call freed back to the system (glibc's ``malloc_trim``; elsewhere a no-op).

    A call's temporary tensors of a few MB to a few tens of MB are freed into glibc's arenas, which keep them: measured
    by the soak harness, the resident memory of a CPU rank running ComfyUI prompts climbed from 1.7 GB to 4-5 GB over
    36 prompts (one sampling model and one VAE cached at a time), stepping up at each new shape of work. The cached
    models are not freed; what the call released is returned, so a rank's resident memory is what it holds.
    """
    if not _LIBC:
        lib = None
        if os.name == "posix":
            try:
                import ctypes

                candidate = ctypes.CDLL(None)
                if hasattr(candidate, "malloc_trim"):  # glibc only (not musl, not macOS)
                    lib = candidate
            except OSError:
                lib = None
        _LIBC.append(lib)
    if _LIBC[0] is not None:
        _LIBC[0].malloc_trim(0)


#: how often a rank checks that the raylet that started it still runs
_PARENT_POLL_S = 1.0


def _exit_with_parent() -> None:
    """End this rank's process when the process that started it (Ray's raylet) is gone.

    Ray's own workers notice a dead raylet about a minute later, and until then a rank holds its models (measured by
    the soak harness: a rank of 1.5 GB outlived a SIGKILLed raylet by 65 s). On POSIX a process whose parent exits is
    given a new parent, which is what this watches; where that does not happen (Windows) it never fires.
    """
    parent = os.getppid()
    if parent <= 1:
        return

    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="patchray-parent-watch", daemon=True).start()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _interface_of(ip: str) -> Optional[str]:
    """The network interface holding ``ip`` (``"lo"`` for 127.0.0.1), or ``None``."""
    try:
        import psutil  # a dependency of Ray
    except ImportError:  # pragma: no cover
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None
