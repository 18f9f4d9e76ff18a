"""The rank cluster on real Ray with CPU ranks and a real gloo process group (no mocks)."""

import time

import pytest
import torch

from patchray.distributed.cluster import ClusterSetupError, RankFailure, caused_by, check_cluster, get_cluster

from ..conftest import TEST_PYTHONPATH
from . import cluster_tasks as tasks

pytestmark = pytest.mark.usefixtures("ray_session")


def ClusterConfig(**kw):  # noqa: N802 - the library's config, with this test package importable on the ranks
    from patchray.distributed.cluster import ClusterConfig as _Config

    return _Config(extra_pythonpath=(TEST_PYTHONPATH,), **kw)


@pytest.mark.parametrize("n", [2, 3])
def test_group_forms_and_all_reduces(n):
    cluster = get_cluster(ClusterConfig(num_ranks=n, device="cpu"))
    who = cluster.run(tasks.whoami)
    assert [w["rank"] for w in who] == list(range(n))
    assert all(w["world_size"] == n and w["backend"] == "gloo" and w["device"] == "cpu" for w in who)
    assert len({w["pid"] for w in who}) == n  # one process per rank
    out = cluster.run(tasks.all_reduce_random, 7)
    expect = sum(local for local, _ in out)
    for _, reduced in out:
        # float64 sums of n terms in possibly different order: a few ulps
        torch.testing.assert_close(reduced, expect, rtol=1e-12, atol=1e-12)


def test_neighbour_exchange_uneven_bands():
    cluster = get_cluster(ClusterConfig(num_ranks=3, device="cpu"))
    rows = [4, 2, 5]
    halos = [(0, 2), (1, 2), (2, 0)]  # rank 1 needs 1 row from rank 0 and 2 from rank 2, ...
    out = cluster.run(tasks.neighbour_exchange, rows, halos)
    bands = [b for b, _, _ in out]
    for r, (_, before, after) in enumerate(out):
        need_before, need_after = halos[r]
        if r == 0:
            assert before is None
        else:
            assert torch.equal(before, bands[r - 1][-need_before:])
        if r == 2:
            assert after is None
        else:
            assert torch.equal(after, bands[r + 1][:need_after])


def test_comm_counts_exact_for_known_sequence():
    cluster = get_cluster(ClusterConfig(num_ranks=3, device="cpu"))
    logs = cluster.run(tasks.known_sequence)
    for r, log in enumerate(logs):
        # all_reduce x2, all_gather x1 (equal extents along dim 0: the flat form, logged as an all-gather),
        # batch_isend_irecv x1, broadcast x1: five API calls on every rank
        assert log["calls"] == {"all_reduce": 2, "all_gather": 1, "batch_isend_irecv": 1, "broadcast": 1}
        assert log["total_calls"] == 5
        neighbours = (r > 0) + (r < 2)
        # the sends/receives inside batch_isend_irecv are labelled batched: bytes, no calls
        assert log["batched_calls"] == {"isend": neighbours, "irecv": neighbours}
        assert log["bytes"]["all_reduce"] == 2 * 32
        assert log["bytes"]["all_gather"] == 3 * 24 + 24  # output (3 pieces) + input tensor
        assert log["bytes"]["isend"] == log["bytes"]["irecv"] == neighbours * 8
        assert log["bytes"]["batch_isend_irecv"] == 0  # a list of P2POps is no tensor buffer
        assert log["bytes"]["broadcast"] == 16


def test_second_call_reuses_the_cluster():
    cfg = ClusterConfig(num_ranks=2, device="cpu")
    c1 = get_cluster(cfg)
    pids1 = [w["pid"] for w in c1.run(tasks.whoami)]
    t0 = time.perf_counter()
    c2 = get_cluster(cfg)
    assert c2 is c1
    assert [w["pid"] for w in c2.run(tasks.whoami)] == pids1


def test_refusal_is_raised_and_the_group_survives():
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    with pytest.raises(ValueError, match="value must be >= 0"):
        cluster.run(tasks.refuse, -1)
    assert cluster.run(tasks.refuse, 5) == [5, 5]
    assert get_cluster(ClusterConfig(num_ranks=2, device="cpu")) is cluster


def test_dead_rank_raises_within_bound_and_next_call_works():
    cfg = ClusterConfig(num_ranks=3, device="cpu")
    cluster = get_cluster(cfg)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        cluster.run(tasks.die_on, 1, timeout_s=120)
    assert 1 in info.value.ranks and "rank 1" in str(info.value)
    assert time.monotonic() - t0 < 60  # death is noticed by Ray, not by the call's 120 s bound
    fresh = get_cluster(cfg)
    assert fresh is not cluster
    assert fresh.run(tasks.refuse, 1) == [1, 1, 1]


def test_hung_rank_becomes_an_error_within_the_bound():
    cfg = ClusterConfig(num_ranks=2, device="cpu")
    cluster = get_cluster(cfg)
    with pytest.raises(RankFailure, match="did not finish") as info:
        cluster.run(tasks.hang_on, 0, timeout_s=5)
    assert 0 in info.value.ranks
    assert get_cluster(cfg).run(tasks.refuse, 2) == [2, 2]


def test_an_overrun_reports_the_bound_the_call_was_given():
    # the config's call_timeout_s (1800 s by default) is not the bound of a call made with timeout_s=4
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    with pytest.raises(RankFailure, match=r"within 4 s") as info:
        cluster.run(tasks.hang_on, 1, timeout_s=4)
    assert "1800" not in str(info.value)


def test_cancel_check_stops_every_rank():
    cfg = ClusterConfig(num_ranks=2, device="cpu")
    cluster = get_cluster(cfg)

    class Interrupted(Exception):
        pass

    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        if calls["n"] > 2:
            raise Interrupted("user pressed cancel")

    with pytest.raises(Interrupted):
        cluster.run(tasks.hang_on, 1, timeout_s=120, cancel_check=cancel)
    assert cluster.broken
    assert get_cluster(cfg).run(tasks.refuse, 3) == [3, 3]


def test_gpu_ranks_on_a_machine_without_gpu_fail_at_once_naming_the_device_widget():
    t0 = time.monotonic()
    with pytest.raises(ClusterSetupError, match=r"device is cuda but PyTorch sees no GPU.*set device to cpu") as err:
        get_cluster(ClusterConfig(num_ranks=2, device="cuda"))
    assert "num_ranks" not in str(err.value)  # lowering num_ranks cannot help: it is not suggested
    assert time.monotonic() - t0 < 5  # refused before Ray is asked for anything


def test_check_cluster_reports_three_ready_ranks():
    report = check_cluster(ClusterConfig(num_ranks=3, device="cpu"), nbytes=1 << 16)
    assert report["ranks"] == 3 and report["ready_ranks"] == 3
    assert report["all_reduce_ok"] and report["p2p_ok"]
    assert report["backend"] == "gloo"
    assert set(report["bandwidth_gbps"]) == {"1->0", "2->1"}
    assert all(v > 0 for v in report["bandwidth_gbps"].values())


def test_config_validation_names_the_field():
    from patchray.distributed.cluster import ClusterConfig

    with pytest.raises(ValueError, match="num_ranks"):
        ClusterConfig(num_ranks=0)
    with pytest.raises(ValueError, match="device"):
        ClusterConfig(device="tpu")
    with pytest.raises(ValueError, match="strategy"):
        ClusterConfig(strategy="RANDOM")


def test_gpu_ids_validation_names_the_fix():
    from patchray.distributed.cluster import ClusterConfig

    assert ClusterConfig(num_ranks=2, device="cuda", gpu_ids=[1, 3]).gpu_ids == (1, 3)
    with pytest.raises(ValueError, match="one GPU per rank"):
        ClusterConfig(num_ranks=2, gpu_ids=(0,))
    with pytest.raises(ValueError, match="distinct"):
        ClusterConfig(num_ranks=2, gpu_ids=(0, 0))
    with pytest.raises(ValueError, match="device is 'cpu'"):
        ClusterConfig(num_ranks=1, device="cpu", gpu_ids=(0,))
    with pytest.raises(ValueError, match="embedded cluster only"):
        ClusterConfig(num_ranks=1, address="auto", gpu_ids=(0,))


def test_progress_reported_by_rank_0_reaches_the_driver():
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    seen = []
    # each value stays up 1.2 s; the driver polls rank 0 about twice a second
    assert cluster.run(tasks.report_steps, 3, 1.2, progress=lambda d, t: seen.append((d, t))) == [0, 1]
    assert seen == [(1, 3), (2, 3), (3, 3)], seen
    # a call shorter than the poll interval still ends with its final figure (fetched once every rank returned)
    quick = []
    assert cluster.run(tasks.report_steps, 4, 0.0, progress=lambda d, t: quick.append((d, t))) == [0, 1]
    assert quick and quick[-1] == (4, 4), quick


_RAY_NOISE = ("\x1b[", "RayTaskError", "actor_id", "ray::", "pid=", "patchray-import", "Traceback")


def _assert_clean(message):
    for noise in _RAY_NOISE:
        assert noise not in message, f"{noise!r} in the user's message: {message!r}"


def test_a_rank_error_reaches_the_user_as_rank_type_and_message(caplog):
    cluster = get_cluster(ClusterConfig(num_ranks=3, device="cpu"))
    with caplog.at_level("ERROR", logger="patchray.distributed.cluster"):
        with pytest.raises(RankFailure) as info:
            cluster.run(tasks.raise_while_peers_wait, 2, 0.2, timeout_s=120)
    err = info.value
    message = str(err)
    _assert_clean(message)
    # the root cause first: the rank, the original type and message; then who was left waiting
    assert message.startswith("rank 2 raised ValueError: the real cause on rank 2: bad band height 7"), message
    assert "ranks [0, 1] were left waiting" in message
    assert err.ranks[0] == 2 and set(err.ranks) == {0, 1, 2}
    assert caused_by(err, ValueError) and isinstance(err.cause, ValueError)
    # the full trace stays available: on the exception and in the log
    assert "raise_while_peers_wait" in err.trace and "Traceback" in err.trace
    assert any("raise_while_peers_wait" in r.getMessage() for r in caplog.records)


def test_the_root_cause_comes_first_when_the_peers_errors_arrive_earlier():
    cluster = get_cluster(ClusterConfig(num_ranks=3, device="cpu"))
    with pytest.raises(RankFailure) as info:
        cluster.run(tasks.peers_time_out_before_the_cause, 1, 4.0, timeout_s=120)
    message = str(info.value)
    _assert_clean(message)
    assert message.startswith("rank 1 raised ValueError: the root cause: latent height 7 is not divisible by 2"), message
    assert info.value.ranks[0] == 1
    assert caused_by(info.value, ValueError)
    # the peers' own errors are secondary: named after the root cause, never instead of it
    assert "ranks [0, 2] failed after it" in message, message


def test_a_refusal_raised_on_every_rank_is_the_original_exception():
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    with pytest.raises(ValueError) as info:
        cluster.run(tasks.refuse, -1)
    assert type(info.value) is ValueError  # not Ray's RayTaskError(ValueError) subclass
    assert str(info.value) == "value must be >= 0 (got -1); pass a non-negative value"
    assert "refuse" in info.value.trace


def test_a_library_imported_under_another_root_name_is_refused_with_the_fix(tmp_path):
    # The ranks import the library as `patchray`; a driver that imported it under another name could not start
    # the rank actor there (its class would be looked up under that name), so it is refused before Ray starts.
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "OtherRoot").symlink_to(Path(__file__).resolve().parents[2])
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import OtherRoot.distributed.cluster as c\n"
        "try:\n"
        "    c.get_cluster(c.ClusterConfig(num_ranks=2, device='cpu'))\n"
        "except c.ClusterSetupError as exc:\n"
        "    import ray; print('ray started:', ray.is_initialized()); print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd="/")
    assert "ray started: False" in out.stdout, out.stdout + out.stderr
    assert "imported as 'OtherRoot.distributed'" in out.stdout and "import it as 'patchray'" in out.stdout, out.stdout


def test_the_embedded_cluster_starts_its_own_ray_beside_a_head_started_with_ray_start(tmp_path):
    # A user who ran `ray start --head` on this machine (docs/multinode.md), or whose environment sets RAY_ADDRESS,
    # and then asks for the embedded cluster (no address): Ray's ray.init() would join that head (its address is in
    # <tmp>/ray/ray_current_cluster) and refuse the embedded settings ("num_cpus and num_gpus must not be
    # provided"). The embedded cluster starts its own Ray. A dead address stands in for the head here: joining it
    # could only fail.
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    temp = Path(tempfile.mkdtemp(prefix="prh-"))  # Ray's socket paths below it must stay under 107 bytes
    (temp / "ray").mkdir()
    (temp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")
    env = dict(os.environ, TMPDIR=str(temp), RAY_ADDRESS="127.0.0.1:9")
    code = (
        "from patchray.distributed.cluster import ClusterConfig, get_cluster, shutdown_cluster\n"
        "from patchray.tests.distributed import cluster_tasks\n"
        "cluster = get_cluster(ClusterConfig(num_ranks=2, device='cpu', extra_pythonpath=(sys.argv[1],)))\n"
        "print('ranks:', [r['rank'] for r in cluster.run(cluster_tasks.whoami)])\n"
        "shutdown_cluster(stop_ray=True)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", "import sys\n" + code, TEST_PYTHONPATH], capture_output=True, text=True,
                             timeout=240, cwd=str(tmp_path), env=env)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert out.returncode == 0 and "ranks: [0, 1]" in out.stdout, (out.stdout + out.stderr)[-3000:]


def test_a_failure_names_the_task_in_words_and_an_expected_one_is_not_a_warning(caplog):
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    for expected in (False, True):
        caplog.clear()
        with caplog.at_level("DEBUG", logger="patchray.distributed.cluster"):
            with pytest.raises(RankFailure) as info:
                cluster.run(tasks.labelled_failure, 1, expected, timeout_s=120)
        message = str(info.value)
        # the task's own words, not its function name
        assert "(while doing the labelled work)" in message and "labelled_failure" not in message, message
        warnings = [r for r in caplog.records if r.levelname == "WARNING" and "no cached weights" in r.getMessage()]
        logged = [r for r in caplog.records if "no cached weights" in r.getMessage()]
        assert logged, "the failure is in the log either way"
        # an error the caller expects (and recovers from) is logged below warning level; any other as a warning
        assert bool(warnings) is not expected, [(r.levelname, r.getMessage()[:80]) for r in logged]
    assert cluster.run(tasks.labelled_failure, -1, False) == [0, 1]  # the group is usable afterwards
