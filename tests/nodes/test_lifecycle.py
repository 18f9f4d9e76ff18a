"""The ranks follow ComfyUI's lifecycle: unloading models frees the ranks' cached models, SIGTERM stops the embedded
Ray. Real Ray and CPU ranks; the SIGTERM case runs a real process and checks what is left with ``ss -ltn``."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from ..conftest import TEST_PYTHONPATH
from ..distributed import cluster_tasks as tasks


def _config(n=2):
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=n, device="cpu", extra_pythonpath=(TEST_PYTHONPATH,))


def _model_management():
    """A module with ComfyUI's function name and call shape (``unload_all_models()``), recording calls."""
    mm = types.ModuleType("model_management_under_test")
    mm.calls = []

    def unload_all_models():
        mm.calls.append("original")

    mm.unload_all_models = unload_all_models
    return mm


@pytest.mark.usefixtures("ray_session")
def test_unloading_models_frees_the_ranks_cached_models():
    from patchray.distributed.cluster import get_cluster
    from patchray.nodes.bridge import lifecycle

    mm = _model_management()
    original = mm.unload_all_models
    lifecycle.install(mm)
    try:
        assert mm.unload_all_models is not original and lifecycle.installed()["unload"]
        cluster = get_cluster(_config())
        # the ranks may hold what an earlier test of this session cached (the cluster is shared): count from there
        before = cluster.run(tasks.cache_len)
        assert cluster.run(tasks.cache_put, "test-lifecycle", 1 << 16) == [n + 1 for n in before]
        mm.unload_all_models()  # what ComfyUI's /free (unload_models / free_memory) ends in
        assert mm.calls == ["original"]  # ComfyUI's own unload ran
        assert cluster.run(tasks.cache_len) == [0, 0]
        assert get_cluster(_config()) is cluster  # the ranks stay up
    finally:
        lifecycle.uninstall()
    assert mm.unload_all_models is original and not lifecycle.installed()["unload"]


def test_unload_wrapper_is_idempotent_and_undone_safely_under_another_wrapper():
    from patchray.nodes.bridge import lifecycle

    mm = _model_management()
    original = mm.unload_all_models
    lifecycle.install(mm)
    ours = mm.unload_all_models
    lifecycle.install(mm)
    assert mm.unload_all_models is ours  # installed once

    def other_pack(*a, **k):  # another pack wraps the same attribute after PatchRay
        mm.calls.append("other")
        return ours(*a, **k)

    mm.unload_all_models = other_pack
    lifecycle.uninstall()
    assert mm.unload_all_models is other_pack  # not torn out from under the other pack
    mm.unload_all_models()
    assert mm.calls == ["other", "original"]  # PatchRay's layer passes through
    # without any cluster, the wrapper never breaks ComfyUI's unload
    lifecycle.install(mm)
    try:
        from patchray.distributed.cluster import shutdown_cluster

        shutdown_cluster()
        mm.unload_all_models()
    finally:
        lifecycle.uninstall()


def test_installing_without_comfyui_changes_nothing_but_the_sigterm_handler():
    from patchray.nodes.bridge import lifecycle

    before = signal.getsignal(signal.SIGTERM)
    lifecycle.install()  # no ComfyUI importable here: no unload wrapper
    try:
        assert lifecycle.installed() == {"unload": False, "sigterm": hasattr(signal, "SIGTERM")}
    finally:
        lifecycle.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import psutil
    from patchray.nodes.bridge import lifecycle
    from patchray.distributed.cluster import ClusterConfig, get_cluster
    import threading
    lifecycle.install()  # as ComfyUI loads the pack: on the main thread
    box, started = [], threading.Event()

    def prompt_worker():
        # as in ComfyUI, the ranks start on the prompt worker's thread (where ray.init installs no SIGTERM handler);
        # like that thread, it lives on (Ray's helpers die with the thread that spawned them: PR_SET_PDEATHSIG)
        box.append(get_cluster(ClusterConfig(num_ranks=2, device="cpu")))
        started.set()
        time.sleep(600)

    threading.Thread(target=prompt_worker, daemon=True).start()
    started.wait(300)
    assert box and box[0].ping()
    kids = psutil.Process().children(recursive=True)
    ports = sorted({c.laddr.port for k in kids for c in k.net_connections("tcp") if c.status == psutil.CONN_LISTEN})
    print(json.dumps({"pids": [k.pid for k in kids], "ports": ports}), flush=True)
    time.sleep(600)
    """
)


def _listening_ports():
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or shutil.which("ss") is None, reason="needs POSIX signals and ss")
def test_sigterm_stops_the_embedded_ray_and_closes_its_ports():
    import psutil

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, "the child did not start its cluster"
        started = json.loads(line)
        assert started["pids"] and started["ports"], started  # Ray's processes and their loopback listeners
        assert set(started["ports"]) <= _listening_ports()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # the process still ends as SIGTERM ends it
        # Ray's helper processes and listeners go with it (without the handler they lingered for a minute or two)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            alive = [p for p in started["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            still = set(started["ports"]) & _listening_ports()
            if not alive and not still:
                break
            time.sleep(0.5)
        assert not alive, f"Ray processes left after SIGTERM: {alive}"
        assert not still, f"ports still listening after SIGTERM: {sorted(still)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in json.loads(line).get("pids", []) if line else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.usefixtures("ray_session")
def test_a_prompt_that_failed_on_the_ranks_leaves_no_cached_weights_on_them():
    from patchray.distributed.cluster import get_cluster
    from patchray.nodes.bridge.errors import rank_errors_for_user

    cluster = get_cluster(_config())
    assert cluster.run(tasks.cache_put, "vae", 1 << 16) == [1, 1]
    with pytest.raises(ValueError, match="value must be >= 0"):
        with rank_errors_for_user():
            cluster.run(tasks.refuse, -1)  # a refusal raised on every rank: the group stays up
    assert get_cluster(_config()) is cluster and cluster.run(tasks.cache_len) == [0, 0]
    # errors that do not come from the ranks leave the caches alone
    cluster.run(tasks.cache_put, "vae", 1 << 16)
    with pytest.raises(KeyError):
        with rank_errors_for_user():
            raise KeyError("a node's own error")
    assert cluster.run(tasks.cache_len) == [1, 1]
