"""The rank cluster: Ray actors that each host one rank of one ``torch.distributed`` group.

Design decisions:

* **Embedded and safe by default.** Without an address PatchRay starts a local Ray bound to
  127.0.0.1 with the dashboard off (see :func:`_ray_init_kwargs` for every setting and what still
  listens). With ``address=`` it joins an existing Ray cluster instead: the pack then runs on a real
  Ray cluster, not a home-made one.
* **One bundle per rank** in a placement group (PACK by default, SPREAD for several nodes). A GPU
  rank asks for ``{"GPU": 1}``; its device is what Ray assigned (``ray.get_gpu_ids()`` /
  ``CUDA_VISIBLE_DEVICES``), never derived from the rank number.
* **Race-free rendezvous.** On one machine the ranks meet through a ``FileStore`` in a fresh temporary
  folder (no listening socket at all). Across nodes, rank 0 opens the ``TCPStore`` on port 0 and
  reports the port the OS gave it; the others connect to it. Either way all ranks
  ``init_process_group`` together under an explicit timeout, and there is no "pick a free port,
  close it, hope" window to retry around.
* **Bounded failure.** :meth:`RankCluster.run` waits with a deadline; a rank that dies, raises while
  its peers block in a collective, or overruns the deadline turns into a :class:`RankFailure` that
  names the rank. The actors are then killed (a group with a lost member cannot be trusted) and the
  next call rebuilds the cluster. An interrupt (Ctrl-C, or ComfyUI's cancel through ``cancel_check``)
  stops every rank the same way.
* **The pack is importable on the ranks however it was loaded.** ComfyUI imports the pack under its
  folder path, not as ``patchray``; the actors get a ``patchray`` import path and alias the driver's
  module names onto it, so functions and values pickled in the driver resolve on the ranks.
* **Reused across calls.** :func:`get_cluster` keeps one cluster per process and rebuilds it only when
  its configuration changes or after a fault, so a second ComfyUI prompt pays no start-up.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .context import ParallelContext

__all__ = [
    "ClusterConfig",
    "RankCluster",
    "RankFailure",
    "ClusterSetupError",
    "get_cluster",
    "shutdown_cluster",
    "check_cluster",
    "rank_cache",
    "report_progress",
    "caused_by",
]

log = logging.getLogger(__name__)

#: the name this package has on the ranks
CANONICAL = "patchray"
#: the name this package has in this process (``patchray`` when pip-installed, the folder path under ComfyUI)
_DRIVER_ROOT = __name__.rsplit(".distributed.cluster", 1)[0]
_PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ClusterSetupError(RuntimeError):
    """The cluster could not be formed (resources, Ray start-up, rendezvous)."""


class RankFailure(RuntimeError):
    """A rank died, raised, hung or was interrupted during a call. The message names the rank(s)."""

    def __init__(self, message: str, ranks: Sequence[int] = (), cause: Optional[BaseException] = None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.cause = cause


@dataclass(frozen=True)
class ClusterConfig:
    """How to build the rank cluster.

    Args:
        num_ranks: number of ranks (one process each). Default 2.
        device: ``"auto"`` (GPU ranks when the Ray cluster has GPUs, else CPU ranks), ``"cuda"`` or ``"cpu"``.
        address: an existing Ray cluster's address (``"auto"``, ``"host:6379"``, ``"ray://host:10001"``);
            ``None`` starts an embedded local Ray bound to 127.0.0.1.
        strategy: placement-group strategy, ``"PACK"`` (default: ranks on as few nodes as possible) or ``"SPREAD"``.
        init_timeout_s: bound on forming the process group (and on waiting for the placement group).
        call_timeout_s: default bound on one :meth:`RankCluster.run` call.
        extra_pythonpath: extra import paths for the rank processes (e.g. a ComfyUI checkout).
        object_store_mb: embedded Ray's object store size; ``None`` sizes it from this machine's memory.
        dashboard: start Ray's dashboard (embedded mode only; off by default, bound to 127.0.0.1 when on).
        gpu_ids: embedded mode only: the physical GPUs the ranks may use (one per rank, e.g. ``(1, 2)``);
            empty lets Ray pick. The embedded Ray is started seeing only these GPUs.

    Example:
        >>> cfg = ClusterConfig(num_ranks=2, device="cpu")
    """

    num_ranks: int = 2
    device: str = "auto"
    address: Optional[str] = None
    strategy: str = "PACK"
    init_timeout_s: float = 120.0
    call_timeout_s: float = 1800.0
    extra_pythonpath: tuple = ()
    object_store_mb: Optional[int] = None
    dashboard: bool = False
    gpu_ids: tuple = ()

    def __post_init__(self):
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be an integer >= 1 (got {self.num_ranks!r})")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu' (got {self.device!r})")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD (got {self.strategy!r})")
        if self.init_timeout_s <= 0 or self.call_timeout_s <= 0:
            raise ValueError("init_timeout_s and call_timeout_s must be positive")
        object.__setattr__(self, "extra_pythonpath", tuple(self.extra_pythonpath))
        object.__setattr__(self, "gpu_ids", tuple(self.gpu_ids))
        if self.gpu_ids:
            if any(not isinstance(g, int) or g < 0 for g in self.gpu_ids) or len(set(self.gpu_ids)) != len(self.gpu_ids):
                raise ValueError(f"gpu_ids must be distinct GPU indices >= 0 (got {self.gpu_ids!r})")
            if len(self.gpu_ids) != self.num_ranks:
                raise ValueError(f"gpu_ids lists {len(self.gpu_ids)} GPU(s) for {self.num_ranks} ranks: list one GPU per rank")
            if self.device == "cpu":
                raise ValueError("gpu_ids pins GPUs, but device is 'cpu': drop gpu_ids or use device='cuda'")
            if self.address is not None:
                raise ValueError(
                    "gpu_ids applies to the embedded cluster only; on an existing Ray cluster choose GPUs with "
                    "Ray's own resources (CUDA_VISIBLE_DEVICES when starting its nodes)"
                )


# --------------------------------------------------------------------------------------------------
# Ray start-up


def _embedded_env() -> Dict[str, str]:
    """Environment that keeps an embedded Ray on loopback; set before Ray starts its processes.

    Measured with Ray 2.60 (``ss -ltnp``): ``ray.init(_node_ip_address="127.0.0.1")`` alone silently
    replaces 127.0.0.1 by the machine's LAN address, and every Ray server (GCS, raylet, workers, the
    dashboard/runtime-env agents, the metrics exporters) binds that address or all interfaces. Ray keeps
    a loopback node address only while ``ray_constants.ENABLE_RAY_CLUSTER`` is false, which is what
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets (the name is misleading: it applies on Linux too, and
    only forbids other nodes joining this embedded single-node cluster). With it, every listener binds
    127.0.0.1 (``tests/distributed/test_cluster_security.py`` checks this on every CI run).
    """
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # Token auth is Ray 2.60's default and stays on: it guards the gRPC servers and agent endpoints.
        # (RAY_AUTH_MODE is deliberately not set here: set after `import ray`, the driver and the GCS
        # disagree about it and the GCS refuses the driver.)
        # Ray's usage-stats reporting would try to reach the internet
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def _apply_embedded_env() -> None:
    for k, v in _embedded_env().items():
        os.environ.setdefault(k, v)
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        # ray_constants reads the variable at import time: correct it if Ray was imported first
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def _ray_init_kwargs(config: ClusterConfig) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(
        ignore_reinit_error=True,
        log_to_driver=False,
        logging_level=logging.WARNING,
        namespace="patchray",
    )
    if config.address is not None:
        kwargs["address"] = config.address
        return kwargs
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a modest machine
        total = 8 << 30
    store_mb = config.object_store_mb or int(max(256, min(total * 0.15 / 2**20, 8192)))
    kwargs.update(
        _node_ip_address="127.0.0.1",
        include_dashboard=config.dashboard,
        dashboard_host="127.0.0.1",
        object_store_memory=store_mb << 20,
        # A few CPU "slots" more than cores so CPU ranks (tiny bundles) and helper tasks always fit.
        num_cpus=max(os.cpu_count() or 1, 1),
        configure_logging=True,
    )
    return kwargs


def _staging_pythonpath() -> str:
    """A folder holding only a ``patchray`` link to this pack, so rank processes can ``import patchray``.

    Only that one name is added to the ranks' import path: putting the pack's parent folder on it would
    also expose ``nodes`` and shadow ComfyUI's own ``nodes`` module.
    """
    spec = importlib.util.find_spec(CANONICAL) if _DRIVER_ROOT == CANONICAL else None
    if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) == _PACK_DIR:
        # pip-installed (editable or not): the ranks inherit the same site-packages
        return ""
    root = os.path.join(tempfile.gettempdir(), f"patchray-import-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(root, exist_ok=True)
    link = os.path.join(root, CANONICAL)
    if not (os.path.islink(link) and os.path.realpath(link) == os.path.realpath(_PACK_DIR)):
        tmp = f"{link}.{os.getpid()}"
        try:
            os.symlink(_PACK_DIR, tmp)
            os.replace(tmp, link)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    return root


_ray_started_with: List[tuple] = []  # (address, gpu_ids) this process's Ray was started/joined with


def _ensure_ray(config: ClusterConfig):
    import ray

    wanted = (config.address, config.gpu_ids)
    if ray.is_initialized():
        if not _ray_started_with or _ray_started_with[0] == wanted:
            return ray
        # another cluster was asked for (embedded <-> an address, other pinned GPUs): leave this one first
        ray.shutdown()
    if config.address is None:
        _apply_embedded_env()
        # Ray 2.60 announces at every start that token auth is on and how to turn it off; PatchRay keeps it on
        # (README, "Security defaults"), so the announcement is only noise in a ComfyUI console.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    saved_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if config.gpu_ids:
        # Ray detects the GPUs it manages from CUDA_VISIBLE_DEVICES when it starts
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in config.gpu_ids)
    try:
        ray.init(**_ray_init_kwargs(config))
    except Exception as exc:
        where = f"the Ray cluster at {config.address!r}" if config.address else "an embedded local Ray"
        raise ClusterSetupError(f"could not start or reach {where}: {exc}") from exc
    finally:
        if config.gpu_ids:
            if saved_visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved_visible
    _ray_started_with[:] = [wanted]
    log.info("Ray ready in %.1f s", time.perf_counter() - t0)
    return ray


# --------------------------------------------------------------------------------------------------
# the rank side

_RANK_CACHE: Dict[Any, Any] = {}


def rank_cache() -> Dict[Any, Any]:
    """A dict that lives as long as this rank's actor: cache models here by content key."""
    return _RANK_CACHE


# (done, total) of the call running in this process; read by the driver through _RankActor.progress()
_PROGRESS: List[int] = [0, 0]


def report_progress(done: int, total: int) -> None:
    """From inside a function run by :meth:`RankCluster.run`: report ``done`` of ``total`` units of work.

    The driver polls rank 0's figure while it waits and hands it to the ``progress`` callback of ``run``
    (ComfyUI's progress bar). Cheap (two ints in this process); report from rank 0, other ranks may too.
    """
    _PROGRESS[0], _PROGRESS[1] = int(done), int(total)


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolve the driver's module names (``<folder path>.distributed.x``) to ``patchray.distributed.x``."""

    def __init__(self, alias: str, target: str):
        self.alias, self.target = alias, target

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.alias or fullname.startswith(self.alias + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        real = importlib.import_module(self.target + spec.name[len(self.alias):])
        self._real_spec = real.__spec__
        return real

    def exec_module(self, module):
        module.__spec__ = self._real_spec  # keep the real spec on the shared module object


class _RankActor:
    """Hosts one rank. Methods are called by :class:`RankCluster` only."""

    def __init__(self, rank: int, world_size: int, driver_root: str, device_kind: str):
        self.rank, self.world_size, self.device_kind = rank, world_size, device_kind
        if driver_root != CANONICAL:
            sys.meta_path.insert(0, _AliasFinder(driver_root, CANONICAL))
        self.ctx: Optional[ParallelContext] = None
        self._store = None
        if device_kind == "cpu":
            threads = max(1, (os.cpu_count() or 1) // max(1, world_size))
            torch.set_num_threads(threads)

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
            "node_ip": ray.util.get_node_ip_address(),
            "device": str(dev),
            "device_name": name,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def open_store(self, host: str, timeout_s: float) -> int:
        """Rank 0 only (several nodes): open the rendezvous store on a port the OS picks, return the port."""
        from torch.distributed import TCPStore

        self._store = TCPStore(host, 0, self.world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        return self._store.port

    def init_group(self, rendezvous: dict, backend: str, timeout_s: float) -> str:
        """Join the process group. ``rendezvous`` is ``{"file": path}`` (one machine) or ``{"host", "port"}``."""
        import torch.distributed as dist
        from torch.distributed import FileStore, TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        if self._store is None:
            if "file" in rendezvous:
                self._store = FileStore(rendezvous["file"], self.world_size)
            else:
                self._store = TCPStore(rendezvous["host"], rendezvous["port"], self.world_size, is_master=False, timeout=timeout)
        device = self._device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=self._store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.ctx = ParallelContext.from_group(None, device)
        return str(device)

    def call(self, fn, packed):
        """Run ``fn(ctx, *args, **kwargs)``; ``packed`` is the ``(args, kwargs)`` put once by the driver."""
        args, kwargs = packed
        if self.ctx is None:
            raise ClusterSetupError(f"rank {self.rank}: process group not initialised")
        fn = _resolve(fn)
        try:
            return fn(self.ctx, *args, **kwargs)
        finally:
            # reset when a call ends (its figure starts at 0 on a new actor): the driver's first poll of the next
            # call may run before that call starts, and must not see this call's figure
            _PROGRESS[0] = _PROGRESS[1] = 0

    def ping(self) -> int:
        return self.rank

    def progress(self) -> tuple:
        """(done, total) last reported by the running call (answered by the actor's second thread)."""
        return (_PROGRESS[0], _PROGRESS[1])

    def close(self) -> None:
        import torch.distributed as dist

        _RANK_CACHE.clear()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the group may be broken; the process is about to go anyway
                pass
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _fn_ref(fn: Callable) -> Any:
    """A module-level function travels by name (``patchray.x:y``) so it resolves however the pack was loaded."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if mod and "<" not in qual and (mod == _DRIVER_ROOT or mod.startswith(_DRIVER_ROOT + ".")):
        return f"{CANONICAL}{mod[len(_DRIVER_ROOT):]}:{qual}"
    return fn  # anything else is pickled by Ray as usual


def _resolve(fn):
    if isinstance(fn, str):
        mod, _, qual = fn.partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    return fn


# --------------------------------------------------------------------------------------------------
# the driver side


class RankCluster:
    """N rank actors forming one process group. Build it with :func:`get_cluster`.

    Example:
        >>> cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))  # doctest: +SKIP
        >>> cluster.run(my_module.my_fn, 3)  # my_fn(ctx, 3) on both ranks  # doctest: +SKIP
    """

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.broken = False
        self._actors: List[Any] = []
        self._pg = None
        self._lock = threading.Lock()
        t0 = time.perf_counter()
        ray = _ensure_ray(config)
        self.device_kind = self._pick_device(ray)
        self.backend = "nccl" if self.device_kind == "cuda" else "gloo"
        try:
            self._start(ray)
        except BaseException:
            self._kill()
            raise
        self.seconds_to_ready = time.perf_counter() - t0

    # -- formation

    def _pick_device(self, ray) -> str:
        n = self.config.num_ranks
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if self.config.device == "cpu":
            return "cpu"
        if self.config.device == "cuda" or (self.config.device == "auto" and gpus > 0):
            if gpus < n:
                raise ClusterSetupError(
                    f"asked for {n} GPU ranks but the Ray cluster has {gpus} GPU(s); "
                    f"use num_ranks <= {gpus}" + (" or device='cpu'" if gpus == 0 or self.config.device == "auto" else "")
                )
            return "cuda"
        return "cpu"

    def _start(self, ray):
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        n = cfg.num_ranks
        bundle = {"GPU": 1, "CPU": 0.01} if self.device_kind == "cuda" else {"CPU": 0.01}
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy=cfg.strategy)
        try:
            ray.get(self._pg.ready(), timeout=cfg.init_timeout_s)
        except Exception as exc:
            remove_placement_group(self._pg)
            self._pg = None
            raise ClusterSetupError(
                f"could not place {n} {self.device_kind.upper()} ranks within {cfg.init_timeout_s:.0f} s "
                f"(cluster resources: {ray.cluster_resources()}): {exc}"
            ) from exc

        pythonpath = [p for p in (_staging_pythonpath(), *cfg.extra_pythonpath) if p]
        env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(pythonpath + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if cfg.address is None:
            # one machine: keep the collectives' sockets on loopback as well
            env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        if self.device_kind == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        actor_cls = ray.remote(_RankActor)
        for r in range(n):
            opts = dict(
                num_cpus=0.01,
                num_gpus=1 if self.device_kind == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": env},
                max_concurrency=2,  # a second thread answers ping() while a call runs
                name=None,
            )
            self._actors.append(actor_cls.options(**opts).remote(r, n, _DRIVER_ROOT, self.device_kind))

        deadline = time.monotonic() + cfg.init_timeout_s
        self.ranks_info = self._get([a.describe.remote() for a in self._actors], deadline, "starting the rank actors")
        if cfg.address is None:
            # One machine: rendezvous through a file. A TCPStore's server socket binds every interface
            # (torch offers no bind address), which the embedded cluster must not open.
            rendezvous = {"file": os.path.join(tempfile.mkdtemp(prefix="patchray-rdzv-"), "store")}
        else:
            host = self.ranks_info[0]["node_ip"]
            port = self._get([self._actors[0].open_store.remote(host, cfg.init_timeout_s)], deadline, "opening the rendezvous store")[0]
            rendezvous = {"host": host, "port": port}
        self.devices = self._get(
            [a.init_group.remote(rendezvous, self.backend, cfg.init_timeout_s) for a in self._actors],
            deadline,
            "forming the process group",
        )
        self.rendezvous = rendezvous

    # -- calls

    def _get(
        self,
        refs,
        deadline: float,
        what: str,
        cancel_check: Optional[Callable[[], None]] = None,
        progress: Optional[Callable[[int, int], None]] = None,
    ):
        """Wait for one ref per rank; turn death, errors, interrupts and overruns into RankFailure."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        pending = {ref: i for i, ref in enumerate(refs)}
        poll = _ProgressPoll(self._actors[0], progress) if progress is not None and self._actors else None
        results: Dict[int, Any] = {}
        first_error: Optional[tuple] = None
        grace_deadline = None
        try:
            while pending:
                now = time.monotonic()
                limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
                if now >= limit:
                    stuck = sorted(pending.values())
                    if first_error is not None:
                        rank, exc = first_error
                        raise self._failure(f"rank {rank} failed while {what}; ranks {stuck} were left waiting", [rank] + stuck, exc)
                    raise self._failure(
                        f"rank(s) {stuck} did not finish {what} within {self.config.call_timeout_s if 'call' in what else self.config.init_timeout_s:.0f} s",
                        stuck,
                        None,
                    )
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(0.5, max(0.01, limit - now)))
                if cancel_check is not None:
                    cancel_check()
                if poll is not None:
                    poll()
                for ref in ready:
                    rank = pending.pop(ref)
                    try:
                        results[rank] = ray.get(ref)
                    except RayTaskError as exc:
                        cause = exc.as_instanceof_cause() if hasattr(exc, "as_instanceof_cause") else exc
                        if first_error is None:
                            first_error = (rank, cause)
                            # peers that raise the same validation error finish at once; peers blocked in a
                            # collective with the failed rank never will: give them a short grace period.
                            grace_deadline = time.monotonic() + 10.0
                    except RayActorError as exc:
                        raise self._failure(f"rank {rank} died while {what}: {exc}", [rank], exc)
        except BaseException as exc:
            if isinstance(exc, RankFailure):
                raise
            # KeyboardInterrupt, ComfyUI's cancel, anything unexpected: stop every rank, re-raise
            self._kill()
            raise
        if first_error is not None:
            rank, cause = first_error
            # every rank returned or raised: the group is intact, only report the error
            if isinstance(cause, (ValueError, TypeError, NotImplementedError, KeyError)):
                raise cause
            raise RankFailure(f"rank {rank} raised while {what}: {type(cause).__name__}: {cause}", [rank], cause) from cause
        return [results[i] for i in range(len(refs))]

    def _failure(self, message: str, ranks, cause) -> RankFailure:
        self._kill()
        return RankFailure(message + "; the cluster was stopped and will be rebuilt on the next call", ranks, cause)

    def run(
        self,
        fn: Callable,
        *args,
        timeout_s: Optional[float] = None,
        cancel_check: Optional[Callable[[], None]] = None,
        progress: Optional[Callable[[int, int], None]] = None,
        **kwargs,
    ) -> List[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order.

        Args:
            fn: a module-level function (sent by name) or any picklable callable.
            timeout_s: bound on the whole call (default ``config.call_timeout_s``).
            cancel_check: called about twice a second while waiting; if it raises (e.g. ComfyUI's
                ``throw_exception_if_processing_interrupted``), every rank is stopped and the exception propagates.
            progress: ``progress(done, total)`` is called while waiting whenever rank 0's
                :func:`report_progress` figure changes (polled about twice a second).

        Raises:
            RankFailure: a rank died, hung past the bound, or failed while its peers waited.
            ValueError/TypeError/NotImplementedError: the ranks refused the input (the group stays usable).
        """
        import ray

        if self.broken:
            raise RankFailure("this cluster was stopped after an earlier failure; call get_cluster() for a new one")
        with self._lock:
            payload = ray.put((args, kwargs))
            ref_fn = _fn_ref(fn)
            # one ObjectRef for the arguments: they travel once, Ray resolves it on each rank
            refs = [a.call.remote(ref_fn, payload) for a in self._actors]
            deadline = time.monotonic() + (timeout_s or self.config.call_timeout_s)
            return self._get(refs, deadline, f"calling {getattr(fn, '__qualname__', fn)}", cancel_check, progress)

    def describe(self) -> dict:
        return {
            "num_ranks": self.config.num_ranks,
            "backend": self.backend,
            "device_kind": self.device_kind,
            "devices": list(self.devices),
            "ranks": self.ranks_info,
            "seconds_to_ready": round(self.seconds_to_ready, 3),
            "address": self.config.address or "embedded (127.0.0.1)",
        }

    def ping(self, timeout_s: float = 10.0) -> bool:
        import ray

        if self.broken:
            return False
        try:
            ray.get([a.ping.remote() for a in self._actors], timeout=timeout_s)
            return True
        except Exception:
            return False

    def _kill(self):
        import ray

        self.broken = True
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self._actors = []
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None

    def shutdown(self):
        """Destroy the process group on every rank, then stop the actors."""
        import ray

        if not self.broken and self._actors:
            try:
                ray.get([a.close.remote() for a in self._actors], timeout=30)
            except Exception:
                pass
        self._kill()


def caused_by(exc: Optional[BaseException], cls: type) -> bool:
    """Whether ``exc`` or a cause in its chain is a ``cls``, also across Ray (a rank's exception arrives as
    ``RayTaskError(cls)``, a subclass named after it, wrapped in :class:`RankFailure`'s ``cause``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, cls) or cls.__name__ in type(exc).__name__:
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False


class _ProgressPoll:
    """Keeps one ``progress()`` request to rank 0 in flight; forwards changed figures to the callback."""

    def __init__(self, actor, callback: Callable[[int, int], None]):
        self.actor, self.callback = actor, callback
        self.ref = actor.progress.remote()
        self.last = (0, 0)

    def __call__(self) -> None:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        if not ready:
            return
        try:
            value = tuple(ray.get(self.ref))
        except Exception:  # the rank died: the wait loop reports it
            return
        if value != self.last and value[1] > 0:
            self.last = value
            self.callback(*value)
        self.ref = self.actor.progress.remote()


_current: Optional[RankCluster] = None
_current_lock = threading.Lock()


def get_cluster(config: Optional[ClusterConfig] = None, **overrides) -> RankCluster:
    """Return the process-wide cluster for ``config``, building (or rebuilding) it when needed."""
    global _current
    config = config or ClusterConfig()
    if overrides:
        config = dataclasses.replace(config, **overrides)
    with _current_lock:
        if _current is not None and _current.config == config and not _current.broken:
            return _current
        if _current is not None:
            _current.shutdown()
            _current = None
        _current = RankCluster(config)
        return _current


def shutdown_cluster(stop_ray: bool = False) -> None:
    """Stop the process-wide cluster (and the embedded Ray if ``stop_ray``)."""
    global _current
    with _current_lock:
        if _current is not None:
            _current.shutdown()
            _current = None
    if stop_ray:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        _ray_started_with.clear()


# --------------------------------------------------------------------------------------------------
# the cluster check (``python -m patchray probe``)


def _check_rank(ctx: ParallelContext, nbytes: int) -> dict:
    import torch.distributed as dist

    from . import comm

    # all_reduce: sum of (rank + 1) over ranks is n(n+1)/2
    t = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    comm.all_reduce(t, ctx)
    expect = ctx.world_size * (ctx.world_size + 1) / 2
    all_reduce_ok = bool(torch.all(t == expect).item())
    # neighbour exchange: each rank sends its rank id; check what came back
    band = torch.full((2, 3), float(ctx.rank), device=ctx.device)
    halo = comm.exchange_halo(band, ctx, 0, [(1, 1)] * ctx.world_size)
    p2p_ok = (halo.before is None or bool(torch.all(halo.before == ctx.rank - 1).item())) and (
        halo.after is None or bool(torch.all(halo.after == ctx.rank + 1).item())
    )
    # bandwidth between neighbours: each rank sends nbytes to the previous one, timed after one warm-up
    numel = max(1, nbytes // 4)
    buf = torch.ones(numel, device=ctx.device)
    bw = None
    if ctx.world_size > 1:
        rows = [(0, numel)] * ctx.world_size  # everyone needs the whole tensor from the next rank
        big = buf.view(numel, 1)
        comm.exchange_halo(big, ctx, 0, rows)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        dist.barrier(group=ctx.group)
        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            comm.exchange_halo(big, ctx, 0, rows)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        dt = (time.perf_counter() - t0) / reps
        bw = (numel * 4) / dt / 1e9
    return {"rank": ctx.rank, "all_reduce_ok": all_reduce_ok, "p2p_ok": p2p_ok, "send_gbps_to_next": bw}


def check_cluster(config: Optional[ClusterConfig] = None, nbytes: int = 8 << 20) -> dict:
    """Form (or reuse) the cluster, check an all_reduce and a neighbour exchange, sample bandwidth.

    Returns a JSON-ready dict: ranks, devices, backend, seconds_to_ready, all_reduce_ok, p2p_ok and
    ``bandwidth_gbps`` per neighbour pair (GB/s of one-way payload, measured with the pack's own
    halo exchange, so on gloo+CUDA it includes the host staging).
    """
    t0 = time.perf_counter()
    cluster = get_cluster(config)
    ready = time.perf_counter() - t0
    results = cluster.run(_check_rank, nbytes, timeout_s=300)
    info = cluster.describe()
    return {
        "ranks": info["num_ranks"],
        "ready_ranks": len(results),
        "devices": info["devices"],
        "device_names": [r["device_name"] for r in info["ranks"]],
        "backend": info["backend"],
        "address": info["address"],
        "seconds_to_ready": round(max(ready, 0.0) if ready > 0.05 else info["seconds_to_ready"], 3),
        "all_reduce_ok": all(r["all_reduce_ok"] for r in results),
        "p2p_ok": all(r["p2p_ok"] for r in results),
        "bandwidth_gbps": {
            f"{r['rank'] + 1}->{r['rank']}": (round(r["send_gbps_to_next"], 3) if r["send_gbps_to_next"] else None)
            for r in results[:-1]
        },
        "per_rank": results,
    }
