"""A short soak on real CPU Ray ranks without ComfyUI: the CI version of ``tests/comfyui/soak.py``.

``soak_mix.py`` runs in a process (and session) of its own, as ComfyUI would: steady rounds of the Distributed VAE
Decode node, the Parallel VAE and a sampling run, each against its one-process twin; then malformed node inputs, a
rank SIGKILLed between calls and during a run, a cancel mid-run, the embedded Ray's raylet SIGKILLed between calls and
its GCS during a run, and a per-rank memory cap, each followed by a run that must work. Here: every case ends as it
should (errors of the right kind, naming the cause, within the bound), the driver's and the ranks' resident memory
stay flat over the steady rounds, and after the process stops its ranks and Ray (as ComfyUI's SIGTERM does) and
exits, nothing of its session is left: no process, no listening port, no /dev/shm entry, no rendezvous folder.

With ``PATCHRAY_SOAK_MIX_FIGURES=<file>`` the test also writes the run's figures there (cases, faults by kind, time to
error, memory of the driver and the ranks over the steady rounds): ``results/soak/ci.json`` was written so.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

psutil = pytest.importorskip("psutil")

#: resident memory the driver and each rank may gain over the steady rounds (the allocator's noise on CPU ranks is
#: a few MB; holding on to each round's model, latent or payload would add tens of MB per round)
FLAT_MB = 48


def _run_child(tmp: str):
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
    proc = subprocess.Popen([sys.executable, "-c", "from patchray.tests.nodes.soak_mix import main; main()"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, cwd=tmp)
    try:
        out, err = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    lines = [json.loads(ln[5:]) for ln in out.splitlines() if ln.startswith("SOAK ")]
    return proc, lines, err


def _figures(report: dict, cases: list, seconds: float) -> dict:
    mem = report["memory"]
    driver = [m["driver"] / 2**20 for m in mem[1:]]
    ranks = {pid: [m["ranks"][pid] / 2**20 for m in mem[1:] if m["ranks"].get(pid)] for pid in mem[1]["ranks"]}
    return {
        "test": "tests/nodes/test_soak_mix.py", "seconds": round(seconds, 1), "cases": len(cases),
        "passed": sum(1 for c in cases if c["ok"]),
        "faults": {c["kind"]: c["outcome"] for c in cases if c["kind"] not in ("round", "last_round") and not c["kind"].startswith("after")},
        "max_seconds_to_error": max((c.get("seconds_to_error", 0) for c in cases), default=0), "error_bound_s": report["error_bound_s"],
        "messages": sorted({c["message"][:200] for c in cases if c.get("message")}),
        "steady_rounds": len(mem), "driver_rss_mb": [round(d, 1) for d in driver],
        "driver_growth_mb": round(driver[-1] - driver[0], 1),
        "rank_growth_mb": [round(v[-1] - v[0], 1) for v in ranks.values()], "flat_bound_mb": FLAT_MB,
    }


def _left(session: int, pids, ports):
    alive = []
    for p in psutil.process_iter():
        try:
            if (os.getsid(p.pid) == session or p.pid in pids) and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {' '.join(p.cmdline())[:60]}")
        except (OSError, psutil.Error):
            pass
    listening = set()
    for c in psutil.net_connections("inet"):
        if c.status == psutil.CONN_LISTEN:
            listening.add(c.laddr.port)
    return alive, sorted(set(ports) & listening)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts what is left by session id and /proc")
def test_a_short_soak_on_real_ranks_ends_clean():
    tmp = tempfile.mkdtemp(prefix="prsoak-", dir="/tmp")  # short: Ray's socket paths live below it
    try:
        t0 = time.monotonic()
        proc, lines, err = _run_child(tmp)
        reports = [ln["report"] for ln in lines if "report" in ln]
        cases = [ln["case"] for ln in lines if "case" in ln]
        assert proc.returncode == 0 and reports, f"the soak process failed (exit {proc.returncode}):\n{err[-4000:]}"
        report = reports[0]

        failed = [c for c in cases if not c["ok"]]
        assert not failed, json.dumps(failed, indent=1)
        kinds = {c["kind"] for c in cases}
        for kind in ("kill_rank_idle_then_run", "cancel_sampling", "kill_rank_sampling", "kill_raylet_then_run", "kill_gcs_sampling",
                     "rank_oom_decode", "rank_oom_decode_beyond_retries", "nan_latent", "wrong_channels"):
            assert kind in kinds, kind
        # every fault is followed by a case that worked on the ranks
        for prev, nxt in zip(cases, cases[1:]):
            if prev["outcome"] == "error":
                assert nxt["ok"], (prev["kind"], nxt)
        assert max(c.get("seconds_to_error", 0) for c in cases) <= report["error_bound_s"]

        # memory over the steady rounds (the first round loads everything: from the second on)
        mem = report["memory"]
        driver = [m["driver"] for m in mem[1:]]
        assert (driver[-1] - driver[0]) / 2**20 < FLAT_MB, [d >> 20 for d in driver]
        for pid in mem[1]["ranks"]:
            series = [m["ranks"][pid] for m in mem[1:] if m["ranks"].get(pid)]
            assert len(series) == len(mem) - 1, "the steady rounds kept their ranks"
            assert (series[-1] - series[0]) / 2**20 < FLAT_MB, (pid, [s >> 20 for s in series])

        # nothing of the session outlives it (Ray's processes are given 30 s to go)
        deadline = time.monotonic() + 30
        while True:
            alive, ports = _left(proc.pid, set(report["session_pids"]), report["listening_ports"])
            if (not alive and not ports) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not alive, f"processes left: {alive}"
        assert not ports, f"ports still listening: {ports}"
        shm = [n for n in report["dev_shm_held"] if os.path.exists("/dev/shm/" + n)]
        assert not shm, f"/dev/shm entries left: {shm}"
        assert not [n for n in os.listdir(tmp) if n.startswith("patchray-rdzv-")], os.listdir(tmp)
        if os.environ.get("PATCHRAY_SOAK_MIX_FIGURES"):
            with open(os.environ["PATCHRAY_SOAK_MIX_FIGURES"], "w") as f:
                json.dump(_figures(report, cases, time.monotonic() - t0), f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
