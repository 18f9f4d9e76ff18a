"""What the cluster leaves behind and what it notices between calls (found by the soak harness, tests/comfyui/soak.py):
the embedded cluster's rendezvous folder goes with the cluster, a folder a SIGKILLed driver left is removed by the next
start, and a rank killed between calls is replaced before the next call instead of failing it. Real Ray, CPU ranks."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from ..conftest import TEST_PYTHONPATH
from . import cluster_tasks as tasks


def _config(**kw):
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=2, device="cpu", extra_pythonpath=(TEST_PYTHONPATH,), **kw)


def _folders():
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"patchray-rdzv-{os.getpid()}-")}


def test_stale_rendezvous_folders_of_dead_drivers_are_removed_and_others_kept(tmp_path, monkeypatch):
    from patchray.distributed.cluster import ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"patchray-rdzv-{dead.pid}-abc").mkdir()  # its driver exited (a SIGKILLed ComfyUI)
    (tmp_path / f"patchray-rdzv-{os.getpid()}-def").mkdir()  # this process's own (a cluster of it in use)
    (tmp_path / "patchray-rdzv-0bqt0my_").mkdir()  # the old naming: whose it is cannot be told, so it stays
    ranks._remove_stale_rendezvous()
    assert {p.name for p in tmp_path.iterdir()} == {f"patchray-rdzv-{os.getpid()}-def", "patchray-rdzv-0bqt0my_"}


@pytest.mark.usefixtures("ray_session")
def test_the_rendezvous_folder_goes_with_the_cluster_and_a_rank_killed_between_calls_is_replaced():
    from patchray.distributed.cluster import get_cluster, shutdown_cluster

    shutdown_cluster()
    before = _folders()
    cluster = get_cluster(_config())
    assert len(_folders() - before) == 1  # the FileStore's folder of this cluster
    assert cluster.run(tasks.refuse, 1) == [1, 1]
    os.kill(cluster.ranks_info[1]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    t0 = time.monotonic()
    fresh = get_cluster(_config())  # not the cluster with a dead rank: the call below would fail on it
    assert fresh is not cluster and cluster.broken
    assert fresh.run(tasks.refuse, 2) == [2, 2]
    assert time.monotonic() - t0 < 120
    assert len(_folders() - before) == 1  # the dead cluster's folder went with it
    shutdown_cluster()
    assert _folders() == before


_FRESH_RAY_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import ray
    from patchray.distributed.cluster import ClusterConfig, get_cluster, shutdown_cluster

    def on_sigterm(signum, frame):  # the host's handler (ComfyUI's process has PatchRay's): it must still run
        print(json.dumps({"handled": True}), flush=True)
        shutdown_cluster(stop_ray=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    config = ClusterConfig(num_ranks=2, device="cpu")
    done = threading.Event()

    def prompt_worker():  # as in ComfyUI: the ranks and Ray start on another thread than the main one
        first = get_cluster(config)
        node = ray._private.worker.global_worker.node
        gcs = node.all_processes["gcs_server"][0].process.pid
        raylet = node.all_processes["raylet"][0].process.pid
        time.sleep(3)  # the watchdog has listed the raylet's helpers
        os.kill(gcs, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while ray.is_initialized() and time.monotonic() < deadline:  # the watchdog gives this Ray up
            time.sleep(0.2)
        second = get_cluster(config)  # a fresh Ray in the same process
        print(json.dumps({"ping": second.ping() and second is not first, "old_raylet": raylet}), flush=True)
        done.set()
        time.sleep(600)

    threading.Thread(target=prompt_worker, daemon=True).start()
    done.wait(300)
    time.sleep(600)
    """
)


def _session_alive(session: int):
    import psutil

    alive = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == session and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {' '.join(p.cmdline())[:60]}")
        except (OSError, psutil.Error):
            pass
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGTERM's disposition and the session are read on Linux")
def test_sigterm_still_reaches_the_host_after_a_fresh_ray_and_nothing_of_either_ray_is_left(tmp_path):
    """A second ``ray.init`` in one process (after the watchdog gave a Ray with a dead GCS up) once left SIGTERM to
    Ray's crash handler, which ended the process at once: the host's handler never ran, Ray's helpers lingered a
    minute and the rendezvous folder stayed. The dead Ray's own helpers (re-parented when its raylet went) lingered a
    minute too. Here the host's handler runs, and within 20 s nothing of the session is left."""
    tmp = tempfile.mkdtemp(prefix="prsig-", dir="/tmp")  # short: Ray's socket paths live below it
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
    proc = subprocess.Popen([sys.executable, "-c", _FRESH_RAY_CHILD], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True, cwd=tmp)
    try:
        line = proc.stdout.readline()
        assert line and json.loads(line)["ping"], "the child did not start a second cluster on a fresh Ray"
        proc.send_signal(signal.SIGTERM)
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, f"the host's SIGTERM handler did not run (exit {proc.returncode})"
        assert '"handled": true' in out
        deadline = time.monotonic() + 20
        while _session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _session_alive(proc.pid), _session_alive(proc.pid)
        assert not [n for n in os.listdir(tmp) if n.startswith("patchray-rdzv-")], os.listdir(tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        shutil.rmtree(tmp, ignore_errors=True)
