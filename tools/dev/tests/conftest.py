"""Tests of the development instruments: run from the repository root with ``python -m pytest tools/dev/tests``.

The instruments import the library as the installed ``patchray`` package and are themselves imported as
``tools.dev.<name>``, so the repository root goes on the import path, here and (through ``extra_pythonpath``) on the
rank processes of any cluster an instrument forms.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[3])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# one thread per rank process, as the library's own tests do
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test keeps the runtime exactness check's verdicts in its own folder."""
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path / "patchray-cache"))


@pytest.fixture(scope="session", autouse=True)
def _stop_cluster():
    yield
    from patchray.distributed.cluster import shutdown_cluster

    shutdown_cluster(stop_ray=True)
