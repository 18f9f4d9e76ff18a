"""Starting or joining Ray: the embedded single-machine default, and connecting to an existing cluster.

Design decisions:

* **Embedded and safe by default.** Without an address PatchRay starts a local Ray bound to 127.0.0.1 with the
  dashboard off (:func:`embedded_env`, :func:`ray_init_kwargs` list every setting and what still listens).
* **An existing cluster is the user's.** With ``address=`` PatchRay only connects: it starts no Ray process, no
  dashboard and changes nothing in the cluster's configuration.
* **Connecting fails fast and says what to fix.** Before ``ray.init`` gets the address, PatchRay checks that the
  head's port answers within ``connect_timeout_s`` (Ray itself would retry for minutes, printing its own
  lines). What Ray refuses afterwards (another Ray version, token authentication) is rewritten as one message
  naming the fix. A loopback address (``127.0.0.1:6379``) is kept as given: by default Ray rewrites it to the
  machine's LAN address (it assumes other nodes must reach the driver), where a head bound to loopback does
  not listen, so for a loopback address PatchRay connects and announces this driver on loopback too
  (``ray_constants.ENABLE_RAY_CLUSTER`` off, as Ray does for its single-machine clusters).
* **Every node runs the same software.** :func:`package_versions` is what each rank reports and the driver
  compares (PatchRay, torch, diffusers, Ray, Python), so a node that differs is named before any work runs.
* **An embedded Ray that dies is replaced, not inherited.** Its GCS and raylet are watched (``watchdog.py``): a dead
  one costs the prompt in flight, this process shuts its Ray down (Ray's driver library would otherwise end the
  process), and :func:`ensure_ray` starts a fresh one for the next call.
* **SIGTERM stays the host's.** Each ``ray.init`` installs Ray's C++ crash handler (absl's failure signal handler)
  for SIGTERM too, chaining to the handler it replaced. The first one chains to the host's (ComfyUI's process with
  PatchRay's SIGTERM handler, which stops the ranks and Ray); a second ``ray.init`` in the same process (a fresh Ray
  after the first died) chains to the first crash handler, so SIGTERM then ended the process at once: Ray's helpers
  lingered a minute and the rendezvous folder stayed (found by the soak harness). After every ``ray.init`` SIGTERM
  goes back to the host: to Python's handler when one is set (its C trampoline, as read before the first
  ``ray.init``), else to what it was just before (Linux; elsewhere unchanged). No crash handler of Ray's holds
  SIGTERM, and a Python handler installed after the first ``ray.init`` is kept.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from .config import ClusterConfig
from .errors import ClusterSetupError, strip_ansi

__all__ = ["embedded_env", "ensure_ray", "forget_ray", "package_versions", "parse_host_port", "is_loopback_host", "ray_init_kwargs"]

log = logging.getLogger(__name__)


def embedded_env() -> Dict[str, str]:
    """Environment that keeps an embedded Ray on loopback; set before Ray starts its processes.

    Measured with Ray 2.60 (``ss -ltnp``): ``ray.init(_node_ip_address="127.0.0.1")`` alone silently
    replaces 127.0.0.1 by the machine's LAN address, and every Ray server (GCS, raylet, workers, the
    dashboard/runtime-env agents, the metrics exporters) binds that address or all interfaces. Ray keeps
    a loopback node address only while ``ray_constants.ENABLE_RAY_CLUSTER`` is false, which is what
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets (the name is misleading: it applies on Linux too, and
    only forbids other nodes joining this embedded single-node cluster). With it, every listener binds
    127.0.0.1 (``tests/distributed/test_cluster_security.py`` checks this on every CI run).
    The same setting keeps a head started with ``ray start --head --node-ip-address 127.0.0.1`` on loopback.
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
    for k, v in embedded_env().items():
        os.environ.setdefault(k, v)
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        # ray_constants reads the variable at import time: correct it if Ray was imported first
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def ray_init_kwargs(config: ClusterConfig) -> Dict[str, Any]:
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
        # the embedded cluster is always a Ray of its own: without an address ray.init() joins the head that a
        # `ray start` on this machine recorded (<tmp>/ray/ray_current_cluster) or RAY_ADDRESS names, and then refuses
        # the settings below
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=config.dashboard,
        dashboard_host="127.0.0.1",
        object_store_memory=store_mb << 20,
        # A few CPU "slots" more than cores so CPU ranks (tiny bundles) and helper tasks always fit.
        num_cpus=max(os.cpu_count() or 1, 1),
        configure_logging=True,
    )
    return kwargs


def package_versions() -> Dict[str, str]:
    """Versions of what every node must share: PatchRay, torch, diffusers, Ray and Python (``"missing"`` if absent)."""
    from importlib import metadata

    import torch

    root = sys.modules.get(__name__.rsplit(".distributed.cluster", 1)[0])
    try:
        diffusers = metadata.version("diffusers")
    except metadata.PackageNotFoundError:
        diffusers = "missing"
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:  # pragma: no cover - the ranks run inside Ray
        ray_version = "missing"
    return {
        "patchray": getattr(root, "__version__", "unknown"),
        "torch": torch.__version__,
        "diffusers": diffusers,
        "ray": ray_version,
        "python": ".".join(map(str, sys.version_info[:3])),
    }


def parse_host_port(address: str) -> Optional[Tuple[str, int]]:
    """``(host, port)`` of ``"host:port"``, ``"ray://host:port"`` or ``"[v6]:port"``; ``None`` for ``"auto"`` etc."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_reachable(address: str, timeout_s: float) -> None:
    parsed = parse_host_port(address)
    if parsed is None:
        return  # "auto" or a name Ray resolves itself: nothing to probe before Ray does
    host, port = parsed
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        reason = "nothing answered" if isinstance(exc, (socket.timeout, TimeoutError)) else (exc.strerror or str(exc))
        raise ClusterSetupError(
            f"could not reach the Ray cluster at {address!r} within {max(time.monotonic() - t0, 0):.1f} s "
            f"({reason}; connect_timeout_s={timeout_s:g}): check the address, that the head runs "
            f"(`ray start --head --port {port}` on {host}) and that TCP port {port} on {host} is open from this machine"
        ) from None


def _set_cluster_mode(loopback: bool) -> None:
    """Whether Ray may rewrite a loopback address to this machine's LAN address (see the module docstring)."""
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = not loopback


def _connect_error(address: str, exc: BaseException) -> ClusterSetupError:
    import ray

    text = strip_ansi(str(exc))
    chain = text
    cause = exc.__cause__
    while cause is not None:
        chain += "\n" + strip_ansi(str(cause))
        cause = cause.__cause__
    if "Version mismatch" in chain:
        found = [ln.strip() for ln in chain.splitlines() if ln.strip().startswith(("Ray:", "Python:"))]
        theirs = found[0] if found else "another version"
        return ClusterSetupError(
            f"the Ray cluster at {address!r} was started with {theirs}, this process has Ray: {ray.__version__}: "
            f"install the same Ray version (Ray refuses any difference; PatchRay needs at least the same "
            f"major.minor) here and on every node, or restart the cluster with Ray {ray.__version__}"
        )
    if "InvalidAuthToken" in chain or "AuthenticationError" in chain or "Authentication token" in chain:
        return ClusterSetupError(
            f"the Ray cluster at {address!r} requires token authentication and this process has no matching token: "
            "set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token) in the "
            "environment that runs PatchRay"
        )
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return ClusterSetupError(f"could not connect to the Ray cluster at {address!r}: {first}")


_ray_started_with: List[tuple] = []  # (address, gpu_ids) this process's Ray was started/joined with

def _sigaction(signo: int, new=None):
    """``sigaction(signo, new, &old)`` through the C library; returns ``old`` as raw bytes (a buffer larger than any
    platform's ``struct sigaction``: only copied back, never read)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    old = ctypes.create_string_buffer(512)
    if libc.sigaction(signo, new, old) != 0:
        raise OSError(ctypes.get_errno(), "sigaction")
    return old


#: the raw disposition of SIGTERM while a Python handler holds it (Python's own C trampoline, which calls whichever
#: Python handler ``signal.signal`` set), read before this process's first ``ray.init``; ``[]``: not read yet
_python_sigterm: List[Any] = []


def _read_sigterm():
    """SIGTERM's disposition now (raw), or ``None`` where it is not kept (not Linux, no C library to ask). Before the
    process's first ``ray.init`` with a Python handler in place, also kept as Python's trampoline."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        raw = _sigaction(signal.SIGTERM)
    except Exception as exc:
        log.debug("could not read SIGTERM's disposition: %s", exc)
        return None
    if not _python_sigterm and callable(signal.getsignal(signal.SIGTERM)):
        _python_sigterm.append(raw)
    return raw


def _restore_sigterm(saved) -> None:
    """After ``ray.init``: SIGTERM to the Python handler when one is set (Python's trampoline: Ray's shutdown of an
    earlier Ray may have reset the C-level disposition under it), else back to ``saved`` (read just before)."""
    if saved is None:
        return
    if _python_sigterm and callable(signal.getsignal(signal.SIGTERM)):
        saved = _python_sigterm[0]
    try:
        _sigaction(signal.SIGTERM, saved)
    except Exception as exc:
        log.debug("could not restore SIGTERM's disposition: %s", exc)


def forget_ray() -> None:
    _ray_started_with.clear()


def ensure_ray(config: ClusterConfig):
    """Start the embedded Ray, or connect to ``config.address``; reuse this process's Ray when it matches."""
    import ray

    from .watchdog import dead_processes, watch

    wanted = (config.address, config.gpu_ids)
    if ray.is_initialized():
        dead = dead_processes()
        if dead:
            # this process's embedded Ray died under it (the watchdog gives it up too, bounded): start a fresh one
            log.warning("the embedded Ray's %s process(es) exited: starting a fresh Ray", ", ".join(dead))
            ray.shutdown()
            forget_ray()
        elif not _ray_started_with or _ray_started_with[0] == wanted:
            return ray
        else:
            # another cluster was asked for (embedded <-> an address, other pinned GPUs): leave this one first
            ray.shutdown()
    if config.address is None:
        _apply_embedded_env()
        # Ray 2.60 announces at every start that token auth is on and how to turn it off; PatchRay keeps it on
        # (README, "Security defaults"), so the announcement is only noise in the caller's console.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    else:
        _check_reachable(config.address, config.connect_timeout_s)
        parsed = parse_host_port(config.address)
        _set_cluster_mode(loopback=parsed is not None and is_loopback_host(parsed[0]))
    t0 = time.perf_counter()
    saved_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if config.gpu_ids:
        # Ray detects the GPUs it manages from CUDA_VISIBLE_DEVICES when it starts
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in config.gpu_ids)
    sigterm = _read_sigterm()
    try:
        ray.init(**ray_init_kwargs(config))
    except Exception as exc:
        if ray.is_initialized():
            ray.shutdown()
        if config.address is None:
            raise ClusterSetupError(f"could not start an embedded local Ray: {strip_ansi(str(exc))}") from exc
        raise _connect_error(config.address, exc) from exc
    finally:
        _restore_sigterm(sigterm)  # Ray's crash handler must not take SIGTERM from the host (module docstring)
        if config.gpu_ids:
            if saved_visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved_visible
    _ray_started_with[:] = [wanted]
    if config.address is None:
        watch()  # a dead GCS or raylet must cost a prompt, not this process (watchdog.py)
    log.info("Ray ready in %.1f s", time.perf_counter() - t0)
    return ray
