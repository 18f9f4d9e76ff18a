"""PatchRay on an existing multi-node Ray cluster: two Ray nodes on this machine, every one on loopback.

The cluster is real (a head and a second raylet, started by ``ray_nodes.py``); PatchRay joins it with
``ClusterConfig(address=...)`` as it joins any cluster, places its ranks with SPREAD, and rendezvouses through
rank 0's TCPStore as across machines. Ray's placement (node ids) shows the ranks really ran on different nodes.
Everything the tests start is stopped by PID, also when a test fails.
"""

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from patchray.distributed.cluster import ClusterConfig, ClusterSetupError, check_cluster, get_cluster, shutdown_cluster

from ..conftest import TEST_PYTHONPATH

HERE = Path(__file__).resolve().parent


def _stop_pids(pids, grace_s=10.0):
    """SIGTERM, then SIGKILL what is left after ``grace_s``: only the processes these tests started."""
    procs = []
    for pid in set(pids):
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


class _Nodes:
    """The launcher process and every process below it, recorded as they appear."""

    def __init__(self, spec: dict):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "ray_nodes.py"), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        self.pids = {self.proc.pid}
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError("the test cluster did not start (see the launcher's stderr above)")
        info = json.loads(line)
        self.address = info["address"]
        self.pids.update(info["pids"])

    def command(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        self.pids.update(json.loads(self.proc.stdout.readline())["pids"])

    def record(self) -> None:
        try:
            self.pids.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.Error:
            pass

    def stop(self) -> None:
        self.record()
        try:
            self.proc.stdin.close()  # the launcher stops its nodes itself ...
            self.proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            pass
        _stop_pids(self.pids)  # ... and whatever is left is stopped here, by PID


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    shutdown_cluster(stop_ray=True)  # this process may have an embedded Ray from earlier tests: leave it
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. a multiprocessing helper
    # the second node's import path starts with a folder the tests fill to make that node differ
    shadow = tmp_path_factory.mktemp("node2-site")
    cluster = _Nodes({"nodes": [{"num_cpus": 1}, {"num_cpus": 1, "env": {"PYTHONPATH": str(shadow)}}]})
    cluster.shadow = shadow
    cluster.earlier = earlier
    try:
        yield cluster
    finally:
        shutdown_cluster(stop_ray=True)
        cluster.stop()


def _config(nodes, **kw):
    kw.setdefault("num_ranks", 2)
    kw.setdefault("strategy", "SPREAD")
    return ClusterConfig(device="cpu", address=nodes.address, extra_pythonpath=(TEST_PYTHONPATH,), **kw)


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_spread_ranks_land_on_two_loopback_nodes_and_pass_the_cluster_check(nodes):
    import ray
    from ray.util import placement_group_table

    report = check_cluster(_config(nodes), nbytes=1 << 16)
    assert report["ready_ranks"] == 2 and report["all_reduce_ok"] and report["p2p_ok"]
    assert report["bandwidth_gbps"]["1->0"] > 0
    alive = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 2 and set(alive.values()) == {"127.0.0.1"}, alive
    # Ray's own placement: bundle r (rank r) sits on a node, and the two nodes differ
    cluster = get_cluster(_config(nodes))
    placed = placement_group_table(cluster._pg)["bundles_to_node_id"]
    assert [placed[r] for r in range(2)] == report["node_of_rank"]
    assert len(set(report["node_of_rank"])) == 2 and set(report["node_of_rank"]) == set(alive)
    # across nodes the ranks meet at rank 0's TCPStore, on rank 0's node address
    assert cluster.rendezvous["host"] == "127.0.0.1" and cluster.rendezvous["port"] > 0


def test_patchray_opens_only_the_rendezvous_listener_and_no_dashboard(nodes):
    cluster = get_cluster(_config(nodes))
    me = psutil.Process()
    rank_pids = {r["pid"] for r in cluster.ranks_info}
    ours = {me.pid} | rank_pids
    listeners = [
        (c.pid, c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    ]
    store_port = cluster.rendezvous["port"]
    outside = [(pid, ip, port) for pid, ip, port in listeners if not _is_loopback(ip)]
    # torch's TCPStore binds every interface (it has no bind address); it is the one listener PatchRay opens
    # itself, on rank 0, while the group lives. Ray's own worker servers and gloo's sockets stay on loopback.
    assert [(port, pid in rank_pids) for pid, _, port in outside] == [(store_port, True)], listeners
    # no dashboard, no process of its own: nothing of ours listens on Ray's dashboard port, and every process
    # below this one belongs to the test cluster (joining a cluster starts no Ray process here)
    assert all(port != 8265 for _, _, port in listeners)
    nodes.record()
    assert not [(p.pid, p.name()) for p in me.children(recursive=True) if p.pid not in nodes.pids | nodes.earlier]


def test_row_decode_across_nodes_equals_the_single_rank_decode(nodes):
    from patchray.distributed.vae import api
    from patchray.distributed.vae.families import FAMILIES, build_vae

    vae = build_vae("kl", size="tiny", seed=3)
    spec = api.VaeSpec(family="kl", config=dict(FAMILIES["kl"].tiny_config),
                       state_dict={k: v.clone() for k, v in vae.state_dict().items()}, key="multinode-kl-seed3")
    z = torch.randn(1, vae.config.latent_channels, 19, 13, generator=torch.Generator().manual_seed(5))
    out = api.distributed_decode(get_cluster(_config(nodes)), spec, z, mode="row")
    with torch.no_grad():
        ref = vae.decode(z).sample
    # fp32 exact row mode: only reduction-order differences (as in test_vae_api.py)
    assert out.shape == ref.shape and (out - ref).abs().max().item() <= 1e-4


def test_patch_parallel_sampling_across_nodes_full_sync_equals_one_rank(nodes):
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import distributed_sample
    from patchray.distributed.sampling.ship import ship_model

    from . import remote_tasks as tasks

    cluster = get_cluster(_config(nodes))
    payload, inp = tasks.make_payload(0), tasks.inputs(steps=3)
    ship_model(cluster, ("tiny-sdxl", 0), lambda: payload, tasks.begin)
    out = distributed_sample(cluster, ("tiny-sdxl", 0), tasks.sample, inp, preset("full_sync", split_batch=False))
    ref = tasks.reference(payload, inp)
    # the tolerance of test_remote_sampling.py: fp32 patch parallelism reorders sums
    assert ((out["latent"] - ref).norm() / ref.norm()).item() < 2e-5


def test_too_many_gpu_ranks_or_nodes_are_refused_at_once(nodes):
    t0 = time.monotonic()
    with pytest.raises(ClusterSetupError, match=r"device is cuda but the Ray cluster has no GPU: set device to cpu"):
        get_cluster(ClusterConfig(num_ranks=2, device="cuda", address=nodes.address))
    with pytest.raises(ClusterSetupError, match=r"STRICT_SPREAD .* 3 ranks .* 2 alive node"):
        get_cluster(_config(nodes, num_ranks=3, strategy="STRICT_SPREAD"))
    assert time.monotonic() - t0 < 30


def test_a_node_without_patchray_is_named(nodes):
    pkg = nodes.shadow / "patchray"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'patchray'\", name='patchray')\n")
    try:
        with pytest.raises(ClusterSetupError) as info:
            get_cluster(_config(nodes, strategy="STRICT_SPREAD"))
    finally:
        (pkg / "__init__.py").unlink()
        pkg.rmdir()
    message = str(info.value)
    assert "could not start: ModuleNotFoundError: No module named 'patchray'" in message, message
    assert "every node needs the same PatchRay, torch, diffusers and Ray" in message


def test_a_node_with_another_diffusers_version_is_named(nodes):
    # what importlib.metadata reports on that node: a diffusers distribution of another version
    meta = nodes.shadow / "diffusers-0.1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: diffusers\nVersion: 0.1.0\n")
    try:
        with pytest.raises(ClusterSetupError) as info:
            get_cluster(_config(nodes, strategy="STRICT_SPREAD"))
    finally:
        (meta / "METADATA").unlink()
        meta.rmdir()
    message = str(info.value)
    import diffusers

    assert f"diffusers 0.1.0 (here {diffusers.__version__})" in message and "node 127.0.0.1" in message, message
    assert "install the same versions on every node" in message


def test_a_cluster_started_with_another_ray_version_is_refused_with_the_fix(nodes):
    import ray

    shutdown_cluster(stop_ray=True)
    nodes.command("ray_version 2.59.0")  # the version the cluster records, which Ray checks on connect
    try:
        t0 = time.monotonic()
        with pytest.raises(ClusterSetupError) as info:
            get_cluster(_config(nodes))
        assert time.monotonic() - t0 < 30
    finally:
        nodes.command("ray_version restore")
    message = str(info.value)
    assert "2.59.0" in message and f"this process has Ray: {ray.__version__}" in message, message
    assert "install the same Ray version" in message
    assert get_cluster(_config(nodes)).run(_rank, timeout_s=60) == [0, 1]  # restored: connects again


def _rank(ctx):
    return ctx.rank


def test_an_unreachable_address_fails_within_the_bound_and_names_the_fix():
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, then closed without listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ClusterSetupError, match=rf"could not reach the Ray cluster at '127.0.0.1:{port}'.*ray start --head --port {port}"):
        get_cluster(ClusterConfig(num_ranks=2, device="cpu", address=f"127.0.0.1:{port}", connect_timeout_s=5))
    assert time.monotonic() - t0 < 10


def test_a_head_started_on_loopback_with_ray_start_works_with_the_probe(tmp_path):
    # The user's steps: `ray start --head --node-ip-address 127.0.0.1`, then the probe with that address, in a
    # fresh process (so nothing from this test process's Ray settings helps). Ray keeps a head on loopback with
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; PatchRay must then connect to 127.0.0.1 as given.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="prx-"))  # Ray's socket paths below it must stay under 107 bytes
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    started = subprocess.run(
        [ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
         "--temp-dir", str(temp), "--include-dashboard", "false", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        probe_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")}
        probe_env["PYTHONPATH"] = TEST_PYTHONPATH
        command = [sys.executable, "-m", "patchray", "probe", "--ranks", "2", "--cpu", "--no-measure", "--json",
                   "--out", str(tmp_path / "report"), "--address", f"127.0.0.1:{port}"]

        # `ray start` turns Ray's token authentication on; a driver given an explicit address uses a token only
        # when told to: without it, one clear message within the bound
        t0 = time.monotonic()
        refused = subprocess.run(command, env=probe_env, capture_output=True, text=True, timeout=150, cwd=str(tmp_path))
        assert time.monotonic() - t0 < 60  # the 30 s default bound, plus starting Python and importing torch
        assert "requires token authentication" in refused.stdout and "RAY_AUTH_MODE=token" in refused.stdout, refused.stdout[-3000:]

        probe_env["RAY_AUTH_MODE"] = "token"  # the token itself is where `ray start` wrote it (~/.ray/auth_token)
        t0 = time.monotonic()
        probe = subprocess.run(command, env=probe_env, capture_output=True, text=True, timeout=150, cwd=str(tmp_path))
        assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-4000:]
        report = json.loads(probe.stdout[probe.stdout.index("{"):])
        assert report["cluster"]["all_reduce_ok"] and report["cluster"]["ready_ranks"] == 2, report["cluster"]
        assert time.monotonic() - t0 < 120
    finally:
        # every process of that head carries its temp dir on its command line; their workers are their children
        pids = set()
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if str(temp) in " ".join(p.info["cmdline"] or []):
                    pids.add(p.pid)
                    pids.update(c.pid for c in p.children(recursive=True))
            except psutil.Error:
                pass
        _stop_pids(pids)
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
