"""Nothing in the pack assumes Linux without a guard: every module imports, and the probe, the machine checks and the
lifecycle hooks run, in a process where POSIX-only modules, os functions, signals, Linux files (/proc, /sys,
/dev/shm) and Linux tools (ss, nvidia-smi) are absent (tests/windows_sim.py takes them away before any import)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_imports_and_the_probe_runs_without_posix_only_sources(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "windows_sim.py")], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["failed"] == {}, out["failed"]
    py_files = [p for folder in ("distributed", "nodes") for p in (ROOT / folder).rglob("*.py")]
    assert len(out["imported"]) == len(py_files) + 1  # every module, and the package itself
    # the machine check works without sysconf, /proc or sched_getaffinity (memory unknown: bounded by cores only)
    assert out["machine"]["cores"] >= 1 and out["max_cpu_ranks"] >= 2
    assert out["machine"]["available_bytes"] is None
    assert "PatchRay topology probe" in out["probe_text"]
    assert out["lifecycle"]["sigterm"] is True  # SIGTERM exists on Windows too; the handler installs
