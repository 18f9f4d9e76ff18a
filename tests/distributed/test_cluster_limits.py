"""How many ranks a machine holds: refused before Ray starts, in the Cluster node's terms; a start that can be
cancelled; the ranks' cached models freed on request. Real Ray and gloo CPU ranks where ranks run."""

import time

import pytest

from patchray.distributed.cluster import ClusterSetupError, free_rank_caches, get_cluster
from patchray.distributed.cluster.limits import CPU_RANK_BYTES, Machine, check_rank_count, max_cpu_ranks, this_machine

from ..conftest import TEST_PYTHONPATH
from . import cluster_tasks as tasks

GiB = 2**30
TWO_CORES = Machine(cores=2, available_bytes=20 * GiB, gpus=0, platform="linux")


def ClusterConfig(**kw):  # noqa: N802 - the library's config, with this test package importable on the ranks
    from patchray.distributed.cluster import ClusterConfig as _Config

    return _Config(extra_pythonpath=(TEST_PYTHONPATH,), **kw)


def test_cpu_ranks_are_bounded_by_cores_with_a_reason_in_widget_terms():
    assert check_rank_count(4, "cpu", machine=TWO_CORES) == "cpu"
    assert check_rank_count(3, "auto", machine=TWO_CORES) == "cpu"  # auto without a GPU: CPU ranks
    with pytest.raises(ClusterSetupError) as err:
        check_rank_count(64, "cpu", machine=TWO_CORES)
    text = str(err.value)
    assert "num_ranks is 64" in text and "2 CPU core(s)" in text and "set num_ranks to 4 or fewer" in text
    assert "--" not in text  # widget names, not CLI flags


def test_cpu_ranks_are_bounded_by_free_memory():
    small = Machine(cores=16, available_bytes=3 * GiB, gpus=0, platform="linux")
    limit = max_cpu_ranks(small)
    assert limit == 3 * GiB // CPU_RANK_BYTES == 6  # idle rank processes at 512 MiB each
    with pytest.raises(ClusterSetupError, match=r"3\.0 GiB free memory.*set num_ranks to 6 or fewer"):
        check_rank_count(8, "cpu", machine=small)
    # a platform that does not report memory is bounded by cores only
    assert max_cpu_ranks(small._replace(available_bytes=None)) == 32


def test_gpu_ranks_are_bounded_by_the_gpus_present():
    four = Machine(cores=32, available_bytes=100 * GiB, gpus=4, platform="linux")
    assert check_rank_count(4, "cuda", machine=four) == "cuda" == check_rank_count(2, "auto", machine=four)
    with pytest.raises(ClusterSetupError, match=r"num_ranks is 8, but this machine has 4 GPU\(s\).*at most 4.*device to cpu"):
        check_rank_count(8, "auto", machine=four)
    with pytest.raises(ClusterSetupError, match=r"gpu_ids lists GPU\(s\) \[5\].*numbered 0 to 3"):
        check_rank_count(2, "cuda", gpu_ids=(1, 5), machine=four)


def test_no_impossible_advice_without_a_gpu():
    with pytest.raises(ClusterSetupError) as err:
        check_rank_count(1, "cuda", machine=TWO_CORES)
    assert "set device to cpu" in str(err.value) and "num_ranks" not in str(err.value)


def test_native_windows_refuses_gpu_ranks_with_the_supported_route_and_allows_cpu_ranks():
    windows = Machine(cores=8, available_bytes=32 * GiB, gpus=2, platform="win32")
    with pytest.raises(ClusterSetupError, match=r"NCCL.*WSL2.*device to cpu"):
        check_rank_count(2, "cuda", machine=windows)
    assert check_rank_count(2, "cpu", machine=windows) == "cpu"


def test_an_existing_ray_cluster_is_left_to_ray_placement():
    assert check_rank_count(64, "cpu", embedded=False, machine=TWO_CORES) == "cpu"


def test_this_machine_reports_something_sane():
    m = this_machine()
    assert m.cores >= 1 and m.gpus >= 0 and (m.available_bytes is None or m.available_bytes > 0)


@pytest.mark.usefixtures("ray_session")
def test_too_many_cpu_ranks_are_refused_before_ray_starts_anything():
    too_many = max_cpu_ranks(this_machine()) + 1
    t0 = time.monotonic()
    with pytest.raises(ClusterSetupError, match=f"num_ranks is {too_many} CPU ranks"):
        get_cluster(ClusterConfig(num_ranks=too_many, device="cpu"))
    assert time.monotonic() - t0 < 5  # no rank was started (64 ranks took minutes)


@pytest.mark.usefixtures("ray_session")
def test_a_cluster_start_can_be_cancelled_and_the_next_start_works():
    class Interrupted(Exception):
        pass

    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        if calls["n"] >= 3:  # the first call comes before Ray; the next ones while the ranks are placed and start
            raise Interrupted("user pressed cancel")

    from patchray.distributed.cluster import shutdown_cluster

    shutdown_cluster()  # a fresh start is what is cancelled
    cfg = ClusterConfig(num_ranks=2, device="cpu")  # the configuration the next tests reuse
    with pytest.raises(Interrupted):
        get_cluster(cfg, cancel_check=cancel)
    assert calls["n"] == 3
    cluster = get_cluster(cfg)  # the next start is unaffected
    assert cluster.run(tasks.refuse, 2) == [2, 2]


@pytest.mark.usefixtures("ray_session")
def test_free_rank_caches_drops_the_ranks_cached_models_and_keeps_the_ranks():
    cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    assert cluster.run(tasks.cache_put, "weights", 1 << 16) == [1, 1]
    assert free_rank_caches() == [1, 1]
    assert cluster.run(tasks.cache_len) == [0, 0]
    assert get_cluster(ClusterConfig(num_ranks=2, device="cpu")) is cluster  # same ranks, no restart


def test_ranks_per_gpu_is_checked_in_the_users_terms():
    from patchray.distributed.cluster import ClusterConfig

    assert ClusterConfig(num_ranks=4, device="cuda", ranks_per_gpu=2).ranks_per_gpu == 2
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="ranks_per_gpu must be an integer >= 1"):
            ClusterConfig(num_ranks=2, ranks_per_gpu=bad)
    with pytest.raises(ValueError, match="device is 'cpu'"):
        ClusterConfig(num_ranks=2, device="cpu", ranks_per_gpu=2)
    with pytest.raises(ValueError, match="use one of the two"):
        ClusterConfig(num_ranks=2, device="cuda", gpu_ids=(0, 1), ranks_per_gpu=2)
