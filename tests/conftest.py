"""Shared test set-up: CPU ranks, one embedded Ray per test session, stopped at the end."""

import os
from pathlib import Path

import pytest

#: The folder that makes this test package importable (the pack root is itself a package, so test
#: modules are named ``<root folder>.tests...``). Ray rank processes need it on their import path to
#: resolve test task functions by name; pass it as ClusterConfig(extra_pythonpath=(TEST_PYTHONPATH,)).
TEST_PYTHONPATH = str(Path(__file__).resolve().parents[2])

# Keep the 2-core CI machine responsive: each rank process uses one thread unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _own_exactness_verdicts(tmp_path, monkeypatch):
    """Each test keeps the runtime exactness check's verdicts in its own folder: a verdict one test left behind must
    not decide another test's run (and the user's cache is never touched)."""
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path / "patchray-cache"))


@pytest.fixture(scope="session")
def ray_session():
    """Yield once Ray may be used; stop the cluster and the embedded Ray after the last test."""
    yield
    from patchray.distributed.cluster import shutdown_cluster

    shutdown_cluster(stop_ray=True)
