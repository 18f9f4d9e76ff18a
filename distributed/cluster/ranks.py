"""The driver side: N rank actors forming one process group, run-on-all, faults and progress.

Design decisions:

* **One bundle per rank** in a placement group (PACK by default, SPREAD for several nodes). A GPU rank asks
  for ``{"GPU": 1}``; CPU ranks (tests, CI, demos) ask for a sliver of a CPU. What the cluster cannot hold
  (too few GPUs, too few nodes for STRICT_SPREAD) is refused before anything is placed; a placement that
  does not complete within ``connect_timeout_s`` is reported with the cluster's resources.
* **Every node runs the same software.** Each rank reports its node and package versions when it starts; a
  rank that cannot start (a node without PatchRay) or whose PatchRay/torch/diffusers/Ray/Python differ
  from the driver's is named, with its node, before any work runs.
* **Bounded failure.** :meth:`RankCluster.run` waits with a deadline; a rank that dies, raises while its
  peers block in a collective, or overruns the deadline turns into a :class:`RankFailure` whose message is
  the root cause (see ``errors.py``). The actors are then killed (a group with a lost member cannot be
  trusted) and the next call rebuilds the cluster. An interrupt (Ctrl-C, or a caller's ``cancel_check``)
  stops every rank the same way.
* **Reused across calls**: the process-wide cluster lives in ``registry.py`` (:func:`.registry.get_cluster`), which
  first checks that every rank's process still runs (a rank killed between calls would fail the next call; on one
  machine this is a PID lookup, no Ray call).
* **A Ray that dies under the cluster** (the embedded Ray's GCS or raylet, ``watchdog.py``) marks it lost: a call in
  flight fails within half a second naming the process, the rank processes are killed by PID, and no Ray call is
  made any more (with a dead GCS they block past the minute after which Ray ends the host process).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional

from .actor import _RankActor
from .config import ClusterConfig
from .errors import (
    ClusterSetupError,
    RankError,
    RankFailure,
    all_traces,
    describe_rank_error,
    failure_message,
    involved_ranks,
    root_cause,
)
from .imports import fn_ref, require_canonical_root, staging_pythonpath
from .limits import check_rank_count
from .ray_setup import ensure_ray, package_versions

__all__ = ["RankCluster", "task_label", "abandon_all"]

log = logging.getLogger(__name__)

#: every cluster of this process that may still hold ranks (starting, running or broken but not yet stopped)
_LIVE: "weakref.WeakSet[RankCluster]" = weakref.WeakSet()


def abandon_all(reason: str, node: Any = None) -> List["RankCluster"]:
    """Give up the clusters of this process that run on the Ray ``node`` (Ray's ``Node`` object; ``None``: all),
    because that Ray died (``watchdog.py``): each is marked lost, its rank processes are killed by PID, and it makes
    no more Ray calls. Returns them."""
    clusters = [c for c in list(_LIVE) if node is None or c._ray_node is node]
    for cluster in clusters:
        cluster._abandon(reason)
    return clusters

#: the exceptions the ranks raise to refuse an input (computed from shared data, so the group stays usable)
_REFUSALS = (ValueError, TypeError, NotImplementedError, KeyError)


def task_label(fn) -> str:
    """What a call does, in the words errors use ("rank 1 died ... (while sampling)"): the function's ``patchray_task``
    attribute when it has one (the library's rank tasks set it), else ``calling <its name>``."""
    label = getattr(fn, "patchray_task", None)
    return label if isinstance(label, str) and label else f"calling {getattr(fn, '__qualname__', fn)}"
#: how long the other ranks may take to finish once one rank has failed (they may be blocked on it)
_GRACE_S = 10.0
#: package versions every node must share with the driver
_SHARED_PACKAGES = ("patchray", "torch", "diffusers", "ray", "python")


class RankCluster:
    """N rank actors forming one process group. Build it with :func:`get_cluster`.

    Example:
        >>> cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))  # doctest: +SKIP
        >>> cluster.run(my_module.my_fn, 3)  # my_fn(ctx, 3) on both ranks  # doctest: +SKIP
    """

    def __init__(self, config: ClusterConfig, cancel_check: Optional[Callable[[], None]] = None):
        self.config = config
        self.broken = False
        self._lost: Optional[str] = None  # why this process's Ray was given up under the cluster (watchdog.py)
        self._actors: List[Any] = []
        self._pg = None
        self._rendezvous_dir: Optional[str] = None
        self._ray_node: Any = None
        self._reported_at: Optional[float] = None  # when every rank had reported its process (time.time())
        self._lock = threading.Lock()
        self._cancel_check = cancel_check
        _LIVE.add(self)
        t0 = time.perf_counter()
        require_canonical_root()
        # what this machine cannot hold is refused before Ray starts (embedded) or anything is placed
        check_rank_count(-(-config.num_ranks // config.ranks_per_gpu), config.device, embedded=config.address is None,
                         gpu_ids=config.gpu_ids)
        if cancel_check is not None:
            cancel_check()
        ray = ensure_ray(config)
        self._ray_node = getattr(ray._private.worker.global_worker, "node", None)  # the Ray it runs on (watchdog.py)
        self.device_kind = self._pick_device(ray)
        # NCCL refuses two ranks on one GPU: ranks that share a GPU meet through gloo
        self.backend = "nccl" if self.device_kind == "cuda" and config.ranks_per_gpu == 1 else "gloo"
        try:
            self._start(ray)
        except BaseException:
            self._kill()
            raise
        self.seconds_to_ready = time.perf_counter() - t0

    # -- formation

    def _pick_device(self, ray) -> str:
        n = -(-self.config.num_ranks // self.config.ranks_per_gpu)  # GPUs the ranks need
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if self.config.device == "cpu":
            return "cpu"
        if self.config.device == "cuda" or (self.config.device == "auto" and gpus > 0):
            if gpus == 0:  # device 'cuda' on a cluster without GPUs: lowering num_ranks cannot help
                raise ClusterSetupError(
                    "device is cuda but the Ray cluster has no GPU: set device to cpu for CPU ranks, or add nodes with GPUs"
                )
            if gpus < n:
                k = self.config.ranks_per_gpu
                share = "each GPU rank needs its own" if k == 1 else f"{k} ranks share a GPU"
                raise ClusterSetupError(
                    f"num_ranks is {self.config.num_ranks}, but the Ray cluster has {gpus} GPU(s) and {share}: set "
                    f"num_ranks to at most {gpus * k}" + (", or device to cpu for CPU ranks" if self.config.device == "auto" else "")
                )
            return "cuda"
        return "cpu"

    def _check_capacity(self, ray) -> None:
        """Refuse at once what the cluster can never hold (waiting for the placement would only time out)."""
        cfg, n = self.config, self.config.num_ranks
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        if cfg.strategy == "STRICT_SPREAD" and len(nodes) < n:
            raise ClusterSetupError(
                f"strategy STRICT_SPREAD puts each of the {n} ranks on its own node, but the Ray cluster has "
                f"{len(nodes)} alive node(s): add nodes, lower num_ranks or use strategy='SPREAD'"
            )
        if self.device_kind == "cpu" and ray.cluster_resources().get("CPU", 0) < 0.01 * n:
            raise ClusterSetupError(
                f"{n} CPU ranks need {0.01 * n:g} CPU in all, but the Ray cluster offers "
                f"{ray.cluster_resources().get('CPU', 0):g}: start its nodes with CPUs (ray start --num-cpus ...)"
            )

    def _start(self, ray):
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        n = cfg.num_ranks
        self._check_capacity(ray)
        gpu_share = 1.0 / cfg.ranks_per_gpu if self.device_kind == "cuda" else 0
        bundle = {"GPU": gpu_share, "CPU": 0.01} if self.device_kind == "cuda" else {"CPU": 0.01}
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy=cfg.strategy)
        try:
            self._wait_placed(ray, cfg.connect_timeout_s)
        except Exception as exc:
            if self._cancelled(exc):
                raise
            remove_placement_group(self._pg)
            self._pg = None
            raise ClusterSetupError(
                f"could not place {n} {self.device_kind.upper()} ranks ({cfg.strategy}) within "
                f"connect_timeout_s={cfg.connect_timeout_s:g} s; the Ray cluster has {ray.cluster_resources()} in "
                f"all and {ray.available_resources()} free: free or add resources, or lower num_ranks "
                f"({type(exc).__name__})"
            ) from None

        pythonpath = [p for p in (staging_pythonpath(), *cfg.extra_pythonpath) if p]
        env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
        if cfg.address is None:
            # one machine: the ranks inherit this process's import path, and keep their sockets on loopback
            inherited = os.environ.get("PYTHONPATH", "")
            env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        else:
            # a cluster: each node keeps its own import path (expanded by Ray on the node), this one means nothing there
            inherited = "${PYTHONPATH}"
        if pythonpath or cfg.address is not None:
            env["PYTHONPATH"] = os.pathsep.join(pythonpath + [inherited]).rstrip(os.pathsep)
        if self.device_kind == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        actor_cls = ray.remote(_RankActor)
        for r in range(n):
            opts = dict(
                num_cpus=0.01,
                num_gpus=gpu_share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": env},
                max_concurrency=2,  # a second thread answers ping() while a call runs
                name=None,
            )
            if self.device_kind == "cpu" and cfg.rank_threads:
                opts["runtime_env"] = {"env_vars": dict(env, OMP_NUM_THREADS=str(cfg.rank_threads[r]))}
            threads = cfg.rank_threads[r] if self.device_kind == "cpu" and cfg.rank_threads else None
            self._actors.append(actor_cls.options(**opts).remote(r, n, self.device_kind, cfg.rank_memory_mb, threads))

        deadline = time.monotonic() + cfg.init_timeout_s
        cancel = self._cancel_check
        try:
            self.ranks_info = self._get(
                [a.describe.remote() for a in self._actors], deadline, "starting the rank actors", cfg.init_timeout_s, cancel
            )
        except RankFailure as exc:
            if self._lost:
                raise ClusterSetupError(f"the ranks could not start: {self._lost}") from exc
            raise ClusterSetupError(
                f"{exc}: every node needs the same PatchRay, torch, diffusers and Ray as this machine (pip install "
                "them there, or add the package's folder with extra_pythonpath)"
            ) from exc
        self._reported_at = time.time()
        self._check_versions()
        if cfg.address is None:
            # One machine: rendezvous through a file. A TCPStore's server socket binds every interface
            # (torch offers no bind address), which the embedded cluster must not open.
            _remove_stale_rendezvous()
            self._rendezvous_dir = tempfile.mkdtemp(prefix=f"{_RDZV_PREFIX}{os.getpid()}-")
            rendezvous = {"file": os.path.join(self._rendezvous_dir, "store")}
        else:
            host = self.ranks_info[0]["node_ip"]
            port = self._get(
                [self._actors[0].open_store.remote(host, cfg.init_timeout_s)], deadline, "opening the rendezvous store", cfg.init_timeout_s, cancel
            )[0]
            rendezvous = {"host": host, "port": port}
            log.info("rendezvous: rank 0 listens on %s:%d (TCPStore) while the group forms", host, port)
        self.devices = self._get(
            [a.init_group.remote(rendezvous, self.backend, cfg.init_timeout_s) for a in self._actors],
            deadline,
            "forming the process group",
            cfg.init_timeout_s,
            cancel,
        )
        self.rendezvous = rendezvous
        self._cancel_check = None  # the caller's check belongs to the prompt that started the cluster

    def _wait_placed(self, ray, bound_s: float) -> None:
        """Wait for the placement group, polling the caller's cancel check about twice a second."""
        ready_ref = self._pg.ready()
        deadline = time.monotonic() + bound_s
        while True:
            ready, _ = ray.wait([ready_ref], timeout=max(0.01, min(0.5, deadline - time.monotonic())))
            if ready:
                ray.get(ready_ref)
                return
            if self._cancel_check is not None:
                self._cancel_check()
            if self._lost:
                raise ClusterSetupError(f"the ranks could not be placed: {self._lost}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"placement not ready within {bound_s:g} s")

    @staticmethod
    def _cancelled(exc: BaseException) -> bool:
        """An exception from the caller's cancel check (not one of Ray's): it propagates unchanged."""
        return not type(exc).__module__.startswith("ray") and not isinstance(exc, TimeoutError)

    def _check_versions(self) -> None:
        mine = package_versions()
        for info in self.ranks_info:
            theirs = info.get("versions", {})
            differ = [f"{k} {theirs.get(k, 'missing')} (here {mine[k]})" for k in _SHARED_PACKAGES if theirs.get(k) != mine[k]]
            if differ:
                raise ClusterSetupError(
                    f"rank {info['rank']} runs on node {info['node_ip']} ({info['host']}, Ray node {info['node_id'][:12]}) "
                    f"with {', '.join(differ)}: install the same versions on every node of the Ray cluster"
                )

    # -- calls

    def _get(
        self,
        refs,
        deadline: float,
        what: str,
        bound_s: float,
        cancel_check: Optional[Callable[[], None]] = None,
        progress: Optional[Callable[[int, int], None]] = None,
    ):
        """Wait for one ref per rank; turn death, errors, interrupts and overruns into RankFailure.

        ``bound_s`` is the bound ``deadline`` was computed from, for the message.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        pending = {ref: i for i, ref in enumerate(refs)}
        poll = _ProgressPoll(self._actors[0], progress) if progress is not None and self._actors else None
        results: Dict[int, Any] = {}
        errors: List[RankError] = []
        grace_deadline = None
        try:
            while pending:
                if self._lost:
                    raise self._lost_failure(what)
                now = time.monotonic()
                limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
                if now >= limit:
                    stuck = sorted(pending.values())
                    if errors:
                        raise self._rank_failure(errors, what, stuck)
                    raise self._failure(f"rank(s) {stuck} did not finish {what} within {bound_s:.0f} s", stuck, None)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(0.5, max(0.01, limit - now)))
                if cancel_check is not None:
                    cancel_check()
                if poll is not None:
                    poll()
                for ref in ready:
                    rank = pending.pop(ref)
                    try:
                        results[rank] = ray.get(ref)
                    except (RayTaskError, RayActorError) as exc:
                        errors.append(describe_rank_error(rank, exc))
                        if isinstance(exc, RayActorError):
                            # a dead rank never answers its peers: stop now
                            raise self._rank_failure(errors, what, sorted(pending.values()))
                        if grace_deadline is None:
                            # peers that raise the same validation error finish at once; peers blocked in a
                            # collective with the failed rank never will: give them a short grace period.
                            grace_deadline = time.monotonic() + _GRACE_S
            if poll is not None:
                poll.finish()
        except BaseException as exc:
            if isinstance(exc, RankFailure):
                raise
            # KeyboardInterrupt, a caller's cancel, anything unexpected: stop every rank, re-raise
            self._kill()
            raise
        if errors:
            # every rank returned or raised
            root = root_cause(errors)
            if any(e.communication for e in errors):
                raise self._rank_failure(errors, what, [])  # collectives failed: the group cannot be trusted
            # an error the caller expects and recovers from (its class says so: e.g. a rank without the cached weights,
            # which the caller resends) is no warning for the log
            quiet = getattr(root.cause, "patchray_expected", False)
            (log.debug if quiet else log.warning)("%s\n%s", failure_message(errors, what), all_traces(errors))
            if isinstance(root.cause, _REFUSALS):
                # a refusal computed from shared data: the group is intact, the caller gets the original exception
                _annotate(root.cause, root)
                raise root.cause
            raise RankFailure(failure_message(errors, what), involved_ranks(errors), root.cause, all_traces(errors))
        return [results[i] for i in range(len(refs))]

    def _lost_failure(self, what: str) -> RankFailure:
        """The failure of a call or start that was in flight when this process's Ray was given up."""
        self._kill()
        return RankFailure(f"the ranks stopped while {what}: {self._lost}", list(range(self.config.num_ranks)))

    def _rank_failure(self, errors: List[RankError], what: str, waiting) -> RankFailure:
        message = failure_message(errors, what, waiting)
        log.error("%s\n%s", message, all_traces(errors))
        return self._failure(message, involved_ranks(errors, waiting), root_cause(errors).cause, all_traces(errors))

    def _failure(self, message: str, ranks, cause, trace: str = "") -> RankFailure:
        """Stop every rank and return the :class:`RankFailure` to raise (the next call rebuilds the cluster)."""
        self._kill()
        return RankFailure(message + "; the cluster was stopped and will be rebuilt on the next call", ranks, cause, trace)

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
            cancel_check: called about twice a second while waiting; if it raises (e.g. an application's
                "interrupted" check), every rank is stopped and the exception propagates.
            progress: ``progress(done, total)`` is called while waiting whenever rank 0's
                :func:`report_progress` figure changes (polled about twice a second).

        Raises:
            RankFailure: a rank died, hung past the bound, or failed while its peers waited.
            ValueError/TypeError/NotImplementedError/KeyError: the ranks refused the input (the group stays usable);
                the rank's original exception, with its trace in ``.trace``.
        """
        import ray

        if self._lost:
            raise RankFailure(f"the ranks were stopped: {self._lost}", list(range(self.config.num_ranks)))
        if self.broken:
            raise RankFailure("this cluster was stopped after an earlier failure; call get_cluster() for a new one")
        if self.config.address is None:
            # a write to the object store of an embedded Ray whose raylet died ends this process (Ray's driver
            # library does): check its processes first (a waitpid each; watchdog.py gives the lost Ray up)
            from .watchdog import dead_processes, reason_for

            dead = dead_processes()
            if dead:
                self._abandon(reason_for(dead))
                raise RankFailure(f"the ranks were stopped: {self._lost}", list(range(self.config.num_ranks)))
        with self._lock:
            payload = ray.put((args, kwargs))
            ref_fn = fn_ref(fn)
            # one ObjectRef for the arguments: they travel once, Ray resolves it on each rank
            refs = [a.call.remote(ref_fn, payload) for a in self._actors]
            bound = timeout_s or self.config.call_timeout_s
            deadline = time.monotonic() + bound
            return self._get(refs, deadline, task_label(fn), bound, cancel_check, progress)

    def describe(self) -> dict:
        return {
            "num_ranks": self.config.num_ranks,
            "backend": self.backend,
            "device_kind": self.device_kind,
            "devices": list(self.devices),
            "ranks": self.ranks_info,
            "seconds_to_ready": round(self.seconds_to_ready, 3),
            "address": self.config.address or "embedded (127.0.0.1)",
            "nodes": sorted({r["node_id"] for r in self.ranks_info}),
        }

    def usable(self, timeout_s: Optional[float] = 10.0) -> bool:
        """Whether every rank is still there to take a call: on one machine (embedded) each rank's process is looked
        up by PID (no Ray call, microseconds); on a Ray cluster each rank is pinged within ``timeout_s`` (``None``: not
        pinged, for callers that must not wait)."""
        if self.broken or self._lost:
            return False
        if self.config.address is None:
            return all(_rank_process(info.get("pid"), self._reported_at) is not None for info in getattr(self, "ranks_info", None) or [])
        return True if timeout_s is None else self.ping(timeout_s)

    def ping(self, timeout_s: float = 10.0) -> bool:
        import ray

        if self.broken or self._lost:
            return False
        try:
            ray.get([a.ping.remote() for a in self._actors], timeout=timeout_s)
            return True
        except Exception:
            return False

    def free_cached(self, timeout_s: float = 10.0) -> List[int]:
        """Drop every rank's cached models and weights (the ranks stay up); per rank, the entries dropped."""
        import ray

        if self.broken or self._lost or not self._actors:
            return []
        return ray.get([a.free_cache.remote() for a in self._actors], timeout=timeout_s)

    def _abandon(self, reason: str) -> None:
        """This process's Ray died under the cluster: mark it lost, kill its rank processes by PID (they run on this
        machine; Ray's own workers linger a minute after their raylet), and make no more Ray calls."""
        self._lost = reason
        self.broken = True
        if self.config.address is None:
            for info in getattr(self, "ranks_info", None) or []:
                _kill_rank_process(info.get("pid"), self._reported_at)
        self._kill()

    def _kill(self):
        import ray

        self.broken = True
        if self._lost:  # Ray's calls would block on a dead GCS; the rank processes were killed by PID
            self._actors, self._pg = [], None
            self._remove_rendezvous()
            _LIVE.discard(self)
            return
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
        self._remove_rendezvous()
        _LIVE.discard(self)

    def _remove_rendezvous(self) -> None:
        """The embedded cluster's rendezvous folder (a FileStore file): one was left in the temporary folder per
        cluster start until the soak harness counted them."""
        folder, self._rendezvous_dir = self._rendezvous_dir, None
        if folder:
            shutil.rmtree(folder, ignore_errors=True)

    def shutdown(self):
        """Destroy the process group on every rank, then stop the actors."""
        import ray

        if not self.broken and not self._lost and self._actors:
            try:
                ray.get([a.close.remote() for a in self._actors], timeout=30)
            except Exception:
                pass
        self._kill()


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
        self._forward(value)
        self.ref = self.actor.progress.remote()

    def _forward(self, value: tuple) -> None:
        if value != self.last and value[1] > 0:
            self.last = value
            self.callback(*value)

    def finish(self, timeout_s: float = 2.0) -> None:
        """After every rank returned: forward the figure rank 0's call ended with (a call shorter than the poll
        interval would otherwise show none); bounded, and silent if rank 0 does not answer in time."""
        import ray

        ref = self.actor.last_progress.remote()
        ready, _ = ray.wait([ref], timeout=timeout_s)
        if ready:
            try:
                self._forward(tuple(ray.get(ref)))
            except Exception:
                return


#: the embedded cluster's rendezvous folders in the temporary folder: ``patchray-rdzv-<driver PID>-<random>``
_RDZV_PREFIX = "patchray-rdzv-"


def _remove_stale_rendezvous() -> None:
    """Remove the rendezvous folders of drivers that no longer run (a driver killed with SIGKILL cannot remove its
    own); a folder whose driver still runs, or named otherwise, is left alone."""
    import glob

    for folder in glob.glob(os.path.join(tempfile.gettempdir(), _RDZV_PREFIX + "*-*")):
        pid = os.path.basename(folder)[len(_RDZV_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            import psutil  # a dependency of Ray

            running = psutil.pid_exists(int(pid))
        except Exception:
            continue
        if not running:
            shutil.rmtree(folder, ignore_errors=True)


def _rank_process(pid, started_by: Optional[float]):
    """The rank process ``pid`` on this machine while it runs (``psutil.Process``), else ``None``: gone, a zombie, or
    the PID reused by a process created after ``started_by`` (the time the ranks had reported, ``time.time()``)."""
    if not pid:
        return None
    try:
        import psutil  # a dependency of Ray

        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if started_by is not None and proc.create_time() > started_by + 1.0:
            return None
        return proc
    except Exception:
        return None


def _kill_rank_process(pid, started_by: Optional[float]) -> None:
    """SIGKILL a rank's process on this machine by PID (never another process that reused the PID)."""
    proc = _rank_process(pid, started_by)
    if proc is not None:
        try:
            proc.kill()
        except Exception:  # gone already
            pass


def _annotate(exc: BaseException, err: RankError) -> None:
    """Give a rank's original exception its rank and trace (the user's message stays the original one)."""
    try:
        exc.rank = err.rank
        exc.trace = err.trace
    except AttributeError:  # an exception type with __slots__: the log still has the trace
        pass
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on rank {err.rank}; its full trace is in the log and in .trace)")
