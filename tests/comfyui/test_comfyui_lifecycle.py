"""Opt-in, real ComfyUI: what a new user's first hour touches beyond the workflows.

* ComfyUI's own "Free model and node cache" (POST /free) also frees the models cached on the ranks;
* the Topology Probe and the Benchmark measure again when a prompt is queued again unchanged (not served from cache);
* too many ranks are refused at once, in the Cluster node's terms; Cancel stops a cluster that is starting;
* SIGTERM to ComfyUI stops the embedded Ray: no Ray process of that server is left and its ports are closed (``ss``).

Runs its own server (the last test stops it with SIGTERM):

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -q -k lifecycle
"""

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from .test_comfyui_server import COMFYUI_DIR, PYTHON, ROOT, _get, _post, _run, serve

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
]


@pytest.fixture(scope="module")
def lifecycle_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy_lifecycle")
    (base / "custom_nodes").mkdir()
    os.symlink(ROOT, base / "custom_nodes" / "PatchRay")
    subprocess.run([PYTHON, str(Path(__file__).with_name("make_models.py")), COMFYUI_DIR, str(base / "models")],
                   check=True, timeout=900, cwd=str(base))
    with serve(base) as (url, proc):
        yield url, base, proc


def _decode_prompt(num_ranks=2):
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": "sdxl_vae.safetensors"}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "3": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": num_ranks, "device": "cpu", "address": "", "gpu_ids": ""}},
        "4": {"class_type": "PatchRayVAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0], "cluster": ["3", 0],
                                                            "mode": "row", "precision": "fp32", "gn_sync": False}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["4", 0]}},
    }


def _rank_processes(server_pid):
    import psutil

    return [p for p in psutil.Process(server_pid).children(recursive=True) if "_RankActor" in " ".join(p.cmdline() or [p.name()])]


def _rss(procs):
    import psutil

    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _log(base):
    return (base / "server.log").read_text(errors="replace")


def test_free_model_and_node_cache_frees_the_ranks_cached_weights(lifecycle_server):
    url, base, proc = lifecycle_server
    _run(url, _decode_prompt())  # the VAE's weights are now cached on both ranks
    ranks = _rank_processes(proc.pid)
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    before = _rss(ranks)
    status, _ = _post(url + "/free", {"unload_models": True, "free_memory": True})
    assert status == 200
    deadline = time.monotonic() + 60  # the prompt worker acts on the flags within a second or so; bounded
    while "freed the ranks' cached models" not in _log(base) and time.monotonic() < deadline:
        time.sleep(0.5)
    line = next(ln for ln in _log(base).splitlines() if "freed the ranks' cached models" in ln)
    counts = json.loads(line.split("(")[-1].split(" entries")[0])
    assert len(counts) == 2 and all(c >= 1 for c in counts), line
    after = _rss(ranks)
    # an SD-layout VAE's fp32 weights are ~330 MB per rank; dropping them returns most of it to the system
    assert before - after > 100 * 2**20, (before, after)
    _run(url, _decode_prompt())  # the next prompt ships the weights again and works


def test_measurement_nodes_measure_again_when_the_prompt_is_queued_again(lifecycle_server):
    url, _, _ = lifecycle_server
    api = {
        "1": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": 2, "device": "cpu", "address": "", "gpu_ids": ""}},
        "2": {"class_type": "PatchRayTopologyProbe", "inputs": {"measure": False, "cluster": ["1", 0]}},
        "3": {"class_type": "PreviewImage", "inputs": {"images": ["2", 0]}},
    }
    _run(url, api)
    second = _run(url, json.loads(json.dumps(api)))  # the same prompt again
    cached = [n for m in second["status"]["messages"] if m[0] == "execution_cached" for n in m[1].get("nodes", [])]
    assert "2" not in cached, cached  # the probe ran again
    assert "1" in cached  # the cluster node (not a measurement) is still served from cache
    assert second["outputs"]["2"]["patchray_topology"][0]["schema"] == 1  # and the probe's fresh report reached the UI


def test_too_many_ranks_are_refused_at_once_in_the_cluster_nodes_terms(lifecycle_server):
    url, _, _ = lifecycle_server
    api = _decode_prompt(num_ranks=64)
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"num_ranks is 64 CPU ranks, but this machine holds at most \d+.*set num_ranks to \d+ or fewer"):
        _run(url, api)
    assert time.monotonic() - t0 < 30  # no rank started (64 ranks used to take two minutes)
    _run(url, _decode_prompt())  # and the next prompt works


def test_cancel_stops_a_cluster_start_and_the_next_prompt_works(lifecycle_server):
    url, _, _ = lifecycle_server
    api = {  # another rank count: the probe, first to use the handle, starts four new ranks (seconds)
        "1": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": 4, "device": "cpu", "address": "", "gpu_ids": ""}},
        "2": {"class_type": "PatchRayTopologyProbe", "inputs": {"measure": False, "cluster": ["1", 0]}},
        "3": {"class_type": "PreviewImage", "inputs": {"images": ["2", 0]}},
    }
    status, body = _post(url + "/prompt", {"prompt": api, "client_id": uuid.uuid4().hex})
    assert status == 200 and not body.get("node_errors"), body
    pid = body["prompt_id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the prompt runs (the VAE loader first, then the cluster)
        running = json.loads(_get(url + "/queue")[1]).get("queue_running", [])
        if any(item[1] == pid for item in running):
            break
        time.sleep(0.2)
    time.sleep(1.5)
    t0 = time.monotonic()
    _post(url + "/interrupt", {})
    while time.monotonic() - t0 < 60:  # a hang check: the start polls Cancel about twice a second
        hist = json.loads(_get(f"{url}/history/{pid}")[1])
        if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
            break
        time.sleep(0.25)
    else:
        raise AssertionError("the interrupted cluster start did not end within 60 s")
    messages = hist[pid]["status"]["messages"]
    interrupted = [m[1] for m in messages if m[0] == "execution_interrupted"]
    assert interrupted, [m[0] for m in messages]
    assert interrupted[0]["node_id"] == "2", interrupted  # it stopped in the probe, while the ranks started
    _run(url, _decode_prompt())  # the next prompt starts its cluster and completes


def _sampling_prompt(steps=2, size=64, num_ranks=2):
    """The checkpoint's UNet (make_models.py) through the Distributed KSampler on CPU ranks."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd_xl_base_1.0.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red boat", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "5": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": num_ranks, "device": "cpu", "address": "", "gpu_ids": ""}},
        "6": {"class_type": "PatchRayKSampler", "inputs": {
            "model": ["1", 0], "seed": 7, "steps": steps, "cfg": 5.0, "sampler_name": "euler", "scheduler": "normal",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0, "cluster": ["5", 0],
            "preset": "full_sync", "warmup_steps": -1, "refresh_every": -1, "k_ratio": 0.25, "block_size": 8,
            "parallelism": "sequence"}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "lifecycle"}},
    }


def _queue_and_wait_until_sampling(url, api, base):
    """Queue ``api`` and return its id once the Distributed KSampler's ranks are sampling (its progress shows)."""
    status, body = _post(url + "/prompt", {"prompt": api, "client_id": uuid.uuid4().hex})
    assert status == 200 and not body.get("node_errors"), body
    pid = body["prompt_id"]
    time.sleep(8)  # 400 steps at 256x256 take minutes on CPU ranks: the prompt is sampling now
    assert pid not in json.loads(_get(f"{url}/history/{pid}")[1]), "the sampling run finished before the test could act"
    return pid


def _ended(url, pid, bound_s=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:  # a hang check: the driver polls the ranks and Cancel twice a second
        hist = json.loads(_get(f"{url}/history/{pid}")[1])
        if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
            return hist[pid]["status"]["messages"]
        time.sleep(0.25)
    raise AssertionError(f"the prompt did not end within {bound_s} s")


def test_a_sampling_run_survives_interrupt_a_killed_rank_and_an_absurd_size(lifecycle_server):
    """What a user meets while sampling: Cancel during a run, a rank process that dies mid-run (a clear error within a
    bound), a size no rank can hold (refused before anything ships); after each the next prompt works. The embedded
    Ray listens on loopback only, with no dashboard HTTP port."""
    import psutil

    url, base, proc = lifecycle_server
    _run(url, _sampling_prompt())  # the cluster is up and the model is on the ranks
    pid = _queue_and_wait_until_sampling(url, _sampling_prompt(steps=400, size=256), base)
    _post(url + "/interrupt", {})
    events = [m[0] for m in _ended(url, pid)]
    assert "execution_interrupted" in events, events
    _run(url, _sampling_prompt())

    pid = _queue_and_wait_until_sampling(url, _sampling_prompt(steps=401, size=256), base)
    ranks = _rank_processes(proc.pid)
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    ranks[-1].kill()
    errors = [m[1] for m in _ended(url, pid) if m[0] == "execution_error"]
    assert errors and errors[0]["node_type"] == "PatchRayKSampler", errors
    text = errors[0]["exception_message"]
    assert "died" in text and "rebuilt on the next call" in text and "ActorID" not in text, text
    _run(url, _sampling_prompt())  # new ranks, the model shipped again

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"latent_image: ComfyUI estimates [\d.]+ GiB for one model call on each rank"):
        _run(url, _sampling_prompt(size=16384))
    assert time.monotonic() - t0 < 60  # refused before the weights ship or a rank allocates
    _run(url, _sampling_prompt())

    listening = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            listening += [c.laddr for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    assert listening and all(a.ip in ("127.0.0.1", "::ffff:127.0.0.1") for a in listening), listening
    assert 8265 not in {a.port for a in listening}  # Ray's dashboard HTTP port: the dashboard is off


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss")
def test_sigterm_stops_comfyui_and_its_embedded_ray(lifecycle_server):
    import psutil

    url, base, proc = lifecycle_server
    _run(url, _decode_prompt())  # the embedded Ray and the ranks are up
    kids = psutil.Process(proc.pid).children(recursive=True)
    ports = set()
    for k in kids:
        try:
            ports |= {c.laddr.port for c in k.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    assert any("raylet" in k.name() or "gcs_server" in k.name() for k in kids) and ports
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = [k.pid for k in kids if psutil.pid_exists(k.pid) and psutil.Process(k.pid).status() != psutil.STATUS_ZOMBIE]
        out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout
        listening = {int(ln.split()[3].rsplit(":", 1)[1]) for ln in out.splitlines() if ln.strip()}
        still = ports & listening
        if not alive and not still:
            break
        time.sleep(0.5)
    assert not alive, f"Ray processes left after SIGTERM: {alive}"
    assert not still, f"ports still listening after SIGTERM: {sorted(still)}"
