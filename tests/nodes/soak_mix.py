"""A short soak of PatchRay's cluster and bridge on real CPU Ray ranks, without ComfyUI (the CI version of the soak).

Run in a process of its own by ``test_soak_mix.py`` (so its embedded Ray, its ranks and whatever they leave can be
counted after it exits): ``python -c "from patchray.tests.nodes.soak_mix import main; main()"``. It prints one JSON
line per case and a final JSON report, after stopping the ranks and the embedded Ray as ComfyUI's SIGTERM does.

The mix, on 2 CPU ranks (gloo, real Ray, no mocks), every PatchRay result held to its one-process twin:

* steady rounds: the Distributed VAE Decode node, the Parallel VAE's decode and a full_sync sampling run
  (``distributed/sampling/remote.py`` with the tiny diffusers UNet of ``tests/distributed/remote_tasks.py``), with
  the driver's and the ranks' resident memory sampled after each round;
* faults, each followed by a run that must work: malformed node inputs (refused before any rank starts), a rank
  process SIGKILLed between calls and during a sampling run, a cancel mid-run (the cluster's ``cancel_check``), the
  embedded Ray's raylet SIGKILLed between calls and its GCS SIGKILLed during a run (the process must survive both),
  and a per-rank memory cap (``ClusterConfig.rank_memory_mb``) that a decode and a sampling run pass.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

import torch

#: a fault's error must reach the caller within this many seconds of the fault
ERROR_BOUND_S = 60.0
#: the CPU ranks' sampling run the cancel and the kill land in: long enough to be caught in the middle
_LONG_STEPS = 400


def _emit(record: dict) -> None:
    print("SOAK " + json.dumps(record, default=str), flush=True)


def _rss(pid: int):
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


class _Mix:
    def __init__(self):
        from patchray.distributed.cluster import ClusterConfig

        from ..distributed import remote_tasks as tasks
        from .test_vae_nodes import _kl_vae

        self.tasks = tasks
        self.gpu = os.environ.get("PATCHRAY_SOAK_DEVICE", "cpu") == "cuda"  # two ranks sharing one GPU
        dev = dict(device="cuda", ranks_per_gpu=2) if self.gpu else dict(device="cpu")
        self.config = ClusterConfig(num_ranks=2, **dev)
        self.capped = ClusterConfig(num_ranks=2, rank_memory_mb=8, **dev)
        # the one-process twins run on this process's CPU; GPU ranks convolve in TF32 (PyTorch's default on a GPU)
        self.decode_bound, self.sample_bound = (4 / 255, 5e-3) if self.gpu else (1 / 255, 2e-5)
        self.vae = _kl_vae(4)  # ComfyUI's VAE shape (tests/nodes/comfy_shapes.py), spatial ratio 8
        self.payload = tasks.make_payload(0)
        self.key = ("soak-tiny-unet", 0)
        self.records = []
        self.memory = []

    # -- the runs, each against its one-process twin

    def cluster(self, config=None):
        from patchray.distributed.cluster import get_cluster

        return get_cluster(config or self.config)

    def decode_node(self, z, config=None):
        from patchray.nodes.vae import PatchRayVAEDecode

        out = PatchRayVAEDecode.execute(samples={"samples": z}, vae=self.vae, cluster=config or self.config, mode="row",
                                        precision="fp32", gn_sync=False)
        image = out.args[0]
        # fp32 row decode: within one 8-bit level of the one-process decode (README)
        return float((image - self.vae.decode(z)).abs().max()), (out.ui.value if out.ui is not None else None)

    def decode_parallel_vae(self, z):
        from patchray.nodes.bridge.parallel_vae import parallel_vae

        pv = parallel_vae(self.vae, self.config, mode="row", precision="fp32").value
        return float((pv.decode(z) - self.vae.decode(z)).abs().max())

    def sample(self, steps=None, cancel_check=None, config=None):
        from patchray.distributed.sampling.config import preset
        from patchray.distributed.sampling.remote import distributed_sample
        from patchray.distributed.sampling.ship import ship_model

        cluster = self.cluster(config)
        ship_model(cluster, self.key, lambda: self.payload, self.tasks.begin, cancel_check=cancel_check)
        inp = self.tasks.inputs(steps=steps or 3)
        out = distributed_sample(cluster, self.key, self.tasks.sample, inp, preset("full_sync", split_batch=False),
                                 cancel_check=cancel_check)
        if steps and steps > 20:
            return None
        ref = self.tasks.reference(self.payload, inp)
        return float((out["latent"] - ref).norm() / ref.norm())

    def round(self, tag: str) -> dict:
        z = torch.randn(1, 4, 8, 10, generator=torch.Generator().manual_seed(len(self.records)))
        node, note = self.decode_node(z)
        pv = self.decode_parallel_vae(z)
        rel = self.sample()
        ok = node <= self.decode_bound and pv <= self.decode_bound and rel < self.sample_bound and note is None
        return {"decode_node_max_abs": node, "parallel_vae_max_abs": pv, "sampling_rel_l2": rel, "ok": ok}

    def memory_sample(self, index: int) -> None:
        cluster = self.cluster()
        gc.collect()
        entry = {"index": index, "driver": _rss(os.getpid()), "ranks": {r["pid"]: _rss(r["pid"]) for r in cluster.ranks_info}}
        if self.gpu:
            entry["gpu_used_mb"] = _gpu_used_mb()
            entry["rank_gpu_reserved_mb"] = cluster.run(_rank_gpu_reserved_mb)
        self.memory.append(entry)

    # -- one case

    def case(self, kind: str, fn, *, expect_error=None, words=None) -> dict:
        t0 = time.monotonic()
        rec = {"index": len(self.records), "kind": kind}
        try:
            result = fn(rec)
            rec["outcome"] = "success"
            if isinstance(result, dict):
                rec.update(result)
        except Exception as exc:  # noqa: BLE001 - a fault's error is the case's result
            rec["outcome"] = "error"
            rec["error_type"] = type(exc).__name__
            rec["message"] = str(exc)[:600]
        rec["seconds"] = round(time.monotonic() - t0, 2)
        t_fault = rec.pop("t_fault", None)
        if t_fault is not None:
            rec["seconds_to_error"] = round(time.monotonic() - t_fault, 2)
        elif rec["outcome"] == "error":
            rec["seconds_to_error"] = rec["seconds"]
        why = []
        if expect_error is None and rec["outcome"] != "success":
            why.append(f"failed: {rec.get('error_type')}: {rec.get('message')}")
        if expect_error is not None:
            if rec["outcome"] != "error":
                why.append("no error")
            elif not any(rec["error_type"] == e for e in expect_error):
                why.append(f"{rec['error_type']}, expected {expect_error}")
            if words and rec["outcome"] == "error" and not any(w in rec["message"] for w in words):
                why.append(f"the message does not name the cause ({words})")
            for noise in ("Traceback", "\x1b[", "ray::", "actor_id", "RayTaskError"):
                if noise in rec.get("message", ""):
                    why.append(f"the message carries {noise!r}")
        if rec.get("seconds_to_error", 0) > ERROR_BOUND_S:
            why.append(f"{rec['seconds_to_error']} s to the error")
        if rec.get("ok") is False:
            why.append("differs from its one-process twin")
        rec["ok"] = not why
        if why:
            rec["why"] = why
        self.records.append(rec)
        _emit({"case": rec})
        return rec

    # -- faults

    def rank_pids(self):
        return [r["pid"] for r in self.cluster().ranks_info]

    def kill_during(self, delay_s: float, target, rec: dict) -> None:
        def fire():
            rec["t_fault"] = time.monotonic()
            target()

        threading.Timer(delay_s, fire).start()


class _Cancelled(Exception):
    """What ComfyUI's cancel check raises (``comfy.model_management.InterruptProcessingException``), in miniature."""


def _gpu_used_mb():
    """The GPU's memory in use by every process (NVIDIA's management library), in MiB; ``None`` without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return round(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20, 1)
    except Exception:  # noqa: BLE001 - no NVIDIA library or GPU: not measured
        return None


def _rank_gpu_reserved_mb(ctx):
    """What a rank's caching allocator holds on its GPU, in MiB."""
    return round(torch.cuda.memory_reserved(ctx.device) / 2**20, 1)


def _ray_process(name: str) -> int:
    import ray

    node = ray._private.worker.global_worker.node
    return node.all_processes[name][0].process.pid


def run() -> dict:
    from patchray.distributed.cluster import RankFailure, shutdown_cluster

    gpu_before = _gpu_used_mb() if os.environ.get("PATCHRAY_SOAK_DEVICE") == "cuda" else None
    mix = _Mix()
    t_start = time.monotonic()
    steady = 5
    for i in range(steady):  # steady rounds on one cluster: the results, and the memory
        mix.case("round", lambda rec: mix.round("steady"))
        mix.memory_sample(i)

    # malformed node inputs: refused in the node's terms, before any rank starts
    def bad(samples, vae=None):
        def go(rec):
            from patchray.nodes.vae import PatchRayVAEDecode

            PatchRayVAEDecode.execute(samples=samples, vae=vae or mix.vae, cluster=mix.config, mode="row", precision="fp32", gn_sync=False)
        return go

    mix.case("nan_latent", bad({"samples": torch.full((1, 4, 8, 8), float("nan"))}), expect_error=("ValueError",), words=("NaN",))
    mix.case("wrong_channels", bad({"samples": torch.randn(1, 16, 8, 8)}), expect_error=("ValueError",), words=("latent channels",))
    mix.case("video_latent", bad({"samples": torch.randn(1, 4, 3, 8, 8)}), expect_error=("ValueError",), words=("video latent",))
    mix.case("not_a_latent", bad("a latent"), expect_error=("ValueError", "TypeError"), words=("samples", "LATENT", "latent"))
    mix.case("not_a_vae", bad({"samples": torch.randn(1, 4, 8, 8)}, vae="a vae"), expect_error=("ValueError", "TypeError"),
             words=("vae", "VAE"))

    def bad_options(rec):
        from patchray.nodes.bridge.sampling_options import SamplingOptions

        SamplingOptions(mix.config, preset="fast")

    mix.case("bad_widget", bad_options, expect_error=("ValueError",), words=("preset",))
    mix.case("after_malformed", lambda rec: mix.round("after"))

    # a rank process SIGKILLed between calls: the next call starts new ranks and works
    def kill_idle(rec):
        os.kill(mix.rank_pids()[1], signal.SIGKILL)
        time.sleep(1.0)
        return mix.round("after kill")

    mix.case("kill_rank_idle_then_run", kill_idle)

    # a cancel mid-run: every rank stops, the caller's exception propagates
    def cancel(rec):
        mix.sample(steps=3)  # the model on the ranks
        calls = {"n": 0}

        def check():
            calls["n"] += 1
            if calls["n"] == 4:  # polled about twice a second while the ranks sample: ~1.5 s in
                rec["t_fault"] = time.monotonic()
            if calls["n"] >= 4:
                raise _Cancelled("cancelled by the user")

        mix.sample(steps=_LONG_STEPS, cancel_check=check)

    mix.case("cancel_sampling", cancel, expect_error=("_Cancelled",), words=("cancelled",))
    mix.case("after_cancel", lambda rec: mix.round("after"))

    # a rank process SIGKILLed while the ranks sample
    def kill_busy(rec):
        mix.sample(steps=3)
        pid = mix.rank_pids()[0]
        mix.kill_during(1.5, lambda: os.kill(pid, signal.SIGKILL), rec)
        mix.sample(steps=_LONG_STEPS)

    mix.case("kill_rank_sampling", kill_busy, expect_error=("RankFailure",), words=("died",))
    mix.case("after_kill", lambda rec: mix.round("after"))

    # the embedded Ray's raylet SIGKILLed between calls: this process survives, the next call starts a fresh Ray
    def kill_raylet(rec):
        os.kill(_ray_process("raylet"), signal.SIGKILL)
        time.sleep(2.0)
        return mix.round("after raylet")

    mix.case("kill_raylet_then_run", kill_raylet)

    # the GCS SIGKILLed during a run: the run fails naming it within the bound; this process survives Ray's 60 s
    def kill_gcs(rec):
        mix.sample(steps=3)
        gcs = _ray_process("gcs_server")
        mix.kill_during(1.5, lambda: os.kill(gcs, signal.SIGKILL), rec)
        mix.sample(steps=_LONG_STEPS)

    mix.case("kill_gcs_sampling", kill_gcs, expect_error=("RankFailure",), words=("GCS",))
    mix.case("after_gcs", lambda rec: mix.round("after"))

    # a per-rank memory cap: the decode retries in row tiles and says so; sampling past the cap fails naming it
    def capped_decode(rec):
        z = torch.randn(1, 4, 32, 16, generator=torch.Generator().manual_seed(1))
        err, note = mix.decode_node(z, config=mix.capped)
        retried = note is not None and "ran out of memory" in note and "row-tiled" in note
        return {"note": note, "ok": retried}

    mix.case("rank_oom_decode", capped_decode)

    def capped_beyond_retries(rec):
        z = torch.randn(1, 4, 96, 48, generator=torch.Generator().manual_seed(2))  # no row-tiled split fits 8 MiB
        mix.decode_node(z, config=mix.capped)

    mix.case("rank_oom_decode_beyond_retries", capped_beyond_retries, expect_error=("OutOfMemoryError", "RankFailure"),
             words=("out of memory",))
    mix.case("after_oom", lambda rec: mix.round("after"))
    mix.case("last_round", lambda rec: mix.round("last"))

    pids = mix.rank_pids()
    held = _session_resources()
    shutdown_cluster(stop_ray=True)  # as ComfyUI's SIGTERM handler does
    report = {"records": mix.records, "memory": mix.memory, "last_rank_pids": pids, "seconds": round(time.monotonic() - t_start, 1),
              "error_bound_s": ERROR_BOUND_S, **held}
    if mix.gpu:
        time.sleep(3.0)  # the ranks' processes end and their CUDA contexts with them
        report["gpu_used_mb_before"], report["gpu_used_mb_after"] = gpu_before, _gpu_used_mb()
    return report


def _session_resources() -> dict:
    """What this process's session (the test starts it as a session of its own) holds now: its processes, their
    listening ports and the /dev/shm entries they map or keep open; the test checks that none outlives the process."""
    import psutil

    me = os.getpid()
    procs = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == os.getsid(me) and p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except (OSError, psutil.Error):
            pass
    ports, shm = set(), set()
    for p in procs:
        try:
            ports |= {c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
        try:
            for line in open(f"/proc/{p.pid}/maps"):
                if "/dev/shm/" in line:
                    shm.add(line.split("/dev/shm/", 1)[1].strip().replace(" (deleted)", ""))
        except OSError:
            pass
    return {"session_pids": [p.pid for p in procs if p.pid != me], "listening_ports": sorted(ports), "dev_shm_held": sorted(shm)}


def main() -> None:
    import importlib.util

    if importlib.util.find_spec("comfy_api") is None:  # the nodes' schema stand-in, as tests/nodes/conftest.py does
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin"))
    report = run()
    _emit({"report": report})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
