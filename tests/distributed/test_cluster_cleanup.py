"""What the cluster leaves behind and what it notices between calls (found by the soak harness, tests/comfyui/soak.py):
the embedded cluster's rendezvous folder goes with the cluster, a folder a SIGKILLed driver left is removed by the next
start, and a rank killed between calls is replaced before the next call instead of failing it. Real Ray, CPU ranks."""

import os
import signal
import subprocess
import sys
import tempfile
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
