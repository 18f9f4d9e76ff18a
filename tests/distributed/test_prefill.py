"""The prefilled GPU clock of turn-taking and the launch bound of the link model.

The model's arithmetic is checked on hand-made records with hand-computed answers (CPU CI); the spin's
calibration and the prefilled clock itself need a CUDA device and are skipped without one.
"""

import math

import pytest
import torch

from patchray.distributed.bench.linkmodel import effective_compute, model_alone, summarise_alone
from patchray.distributed.bench.turns import Prefill, resolve_clock
from patchray.distributed.bench.sample_bench import _alone_steps
from patchray.distributed.topology.links import LinkProfile


def _run(compute, launch, syncs=None, queued=None, wire=(), clock="gpu-prefilled", marks=()):
    n = len(compute)
    return {"clock": clock, "compute_ms": list(compute), "cpu_ms": list(launch), "launch_ms": list(launch),
            "spin_ms": [5.0] * n, "queued": list(queued if queued is not None else [True] * n),
            "host_syncs": list(syncs if syncs is not None else [0] * n), "comm_ms": [0.5] * len(wire),
            "wire_bytes": list(wire), "ops": ["all_gather"] * len(wire), "marks": list(marks)}


def test_gpu_bound_call_uses_the_gpu_time():
    a = _run([3.0, 4.0, 2.0], [1.0, 1.0, 1.0], wire=[100, 100])
    b = _run([2.0, 5.0, 1.0], [1.5, 0.5, 1.0], wire=[100, 100])
    eff = effective_compute([a, b])
    # GPU per stage the slowest rank: 3 + 5 + 2 = 10; issue per stage the slowest: 1.5 + 1 + 1 = 3.5 < 10
    assert eff["gpu_ms"] == 10.0 and eff["launch_ms"] == 3.5
    assert eff["compute_ms"] == 10.0 and eff["launch_bound"] is False
    assert eff["queued_stages"] == 3 and eff["host_sync_stages"] == 0


def test_launch_bound_call_uses_the_cpu_issue_time():
    # small stages: 1 ms of GPU work each, 2.5-3 ms to issue from Python
    a = _run([1.0, 1.0, 1.0, 1.0], [2.5, 3.0, 2.5, 2.5], wire=[10, 10, 10])
    b = _run([1.2, 0.8, 1.0, 0.9], [2.6, 2.4, 2.8, 2.5], wire=[10, 10, 10])
    eff = effective_compute([a, b])
    # GPU: 1.2 + 1.0 + 1.0 + 1.0 = 4.2; issue: 2.6 + 3.0 + 2.8 + 2.5 = 10.9 > 4.2: the CPU's time is the model's
    assert math.isclose(eff["gpu_ms"], 4.2) and math.isclose(eff["launch_ms"], 10.9)
    assert math.isclose(eff["compute_ms"], 10.9) and eff["launch_bound"] is True
    p = LinkProfile("t", 1.0, 100.0, False)  # 1 GB/s, 100 us per message
    # 10.9 + 3 x (0.1 ms + 10 B / 1 GB/s)
    assert math.isclose(model_alone([a, b], 2, profiles=[p])["t"], round(10.9 + 3 * (0.1 + 1e-5), 3), abs_tol=1e-9)


def test_host_synchronising_stages_count_with_their_gpu_time():
    # stage 1 waits on the device inside (its issue time holds the wait): it counts with its GPU time only;
    # stages 0 and 2: GPU 1 + 1 = 2 against issue time 2 + 2 = 4: launch-bound there
    a = _run([1.0, 6.0, 1.0], [2.0, 9.0, 2.0], syncs=[0, 1, 0], queued=[True, False, True])
    eff = effective_compute([a])
    assert eff["gpu_ms"] == 8.0 and eff["launch_ms"] == 4.0
    assert eff["compute_ms"] == 6.0 + 4.0 and eff["launch_bound"] is True
    assert eff["host_sync_stages"] == 1 and eff["queued_stages"] == 2


def test_stages_not_queued_count_with_their_gpu_time():
    # stage 1 was not fully queued before the GPU reached it (its issuing overlapped its GPU work: a full launch
    # queue or a spin too short), so its issue time holds waits: its GPU time counts, its issue time does not
    a = _run([1.0, 9.0, 1.0], [1.5, 12.0, 1.5], queued=[True, False, True])
    b = _run([1.0, 8.0, 1.0], [1.0, 11.0, 1.0], queued=[True, True, True])
    eff = effective_compute([a, b])
    # queued stages 0 and 2: GPU 1 + 1 = 2, issue time 1.5 + 1.5 = 3: launch-bound there; stage 1: GPU 9
    assert eff["gpu_ms"] == 11.0 and eff["launch_ms"] == 3.0
    assert eff["compute_ms"] == 9.0 + 3.0 and eff["launch_bound"] is True
    assert eff["queued_stages"] == 2 and eff["host_sync_stages"] == 0


def test_other_clocks_have_no_launch_rule():
    idle = _run([1.0, 1.0], [5.0, 5.0], clock="idle-start")
    cpu = {"compute_ms": [1.0, 1.0], "cpu_ms": [1.0, 1.0], "comm_ms": [0.1], "wire_bytes": [0], "ops": ["x"], "marks": []}
    for run in (idle, cpu):
        eff = effective_compute([run])
        assert eff["compute_ms"] == 2.0 and eff["launch_ms"] is None and eff["launch_bound"] is False


def test_summary_reports_gpu_issue_and_the_clock():
    a = _run([1.0, 1.0], [3.0, 2.0], wire=[0])
    b = _run([2.0, 0.5], [1.0, 1.0], wire=[0])
    block = summarise_alone([[a, a], [b, b]], 2)
    assert block["clock"] == "gpu-prefilled" and block["modelled"] is True
    # GPU 2 + 1 = 3; issue time 3 + 2 = 5: launch-bound, the compute is 5
    assert block["gpu_ms"] == 3.0 and block["launch_ms"] == 5.0 and block["compute_ms"] == 5.0
    assert block["launch_bound"] is True and block["launch_bound_iterations"] == 2
    assert block["launch_ms_by_rank"] == [5.0, 2.0] and block["compute_ms_by_rank"] == [2.0, 2.5]
    assert "prefilled" in block["note"]


def test_sampling_steps_apply_the_launch_bound_per_step():
    # step 0 = stages 0-1 (GPU 2 + 2 = 4, issue time 1 + 1 = 2: GPU-bound), step 1 = stages 2-3 (GPU 1 + 1, issue time 3 + 3)
    a = _run([2.0, 2.0, 1.0, 1.0, 9.0], [1.0, 1.0, 3.0, 3.0, 1.0], marks=[2, 4])
    assert _alone_steps([a], 2) == [4.0, 6.0]
    detail = _alone_steps([a], 2, detail=True)
    assert [d["launch_bound"] for d in detail] == [False, True]


def test_spin_sizes_follow_the_previous_run_and_the_cap():
    p = Prefill()
    # nothing seen yet: 1.5 x the initial 5 ms + 1 ms; then the longest stage so far in this run
    assert p.spin_ms(0) == 1.5 * 5.0 + 1.0
    assert p.spin_ms(3, longest_so_far=8.0) == 1.5 * 8.0 + 1.0
    p.update(0, 2.0, host_syncs=0)
    assert p.spin_ms(0, longest_so_far=50.0) == 1.5 * 2.0 + 1.0  # the same stage's previous issue time wins
    p.update(1, 30.0, host_syncs=2)  # a stage that waits on the device: no spin can cover it, keep it short
    assert p.spin_ms(1) == 1.0
    p.update(2, 500.0, host_syncs=0)
    assert p.spin_ms(2) == Prefill.CAP_MS


def test_clock_names():
    assert resolve_clock(torch.device("cpu"), "prefilled") == "cpu-wall"
    assert resolve_clock(torch.device("cpu"), "idle") == "cpu-wall"
    assert resolve_clock(torch.device("cuda", 0), "prefilled") == "gpu-prefilled"
    assert resolve_clock(torch.device("cuda", 0), "idle") == "idle-start"
    with pytest.raises(ValueError, match="alone clock"):
        resolve_clock(torch.device("cpu"), "gpu")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_spin_calibration_matches_cuda_events():
    from patchray.distributed.bench.turns import GpuSpin

    dev = torch.device("cuda", torch.cuda.current_device())
    assert GpuSpin.cycles_per_ms(dev) > 1e5  # a GPU clock above 100 MHz
    for ms in (2.0, 20.0):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        GpuSpin.enqueue(dev, ms)
        end.record()
        end.synchronize()
        # the SM clock may move between the calibration and the spin (boost, power): 25% is far below the
        # factor 1.5 the spin's length carries over the CPU's issue time
        assert abs(start.elapsed_time(end) / ms - 1.0) < 0.25


@cuda
def test_prefilled_clock_times_the_gpu_without_launch_gaps():
    """Many tiny kernels: from an idle GPU the stage takes about the CPU's issue time; behind a spin, far less."""
    from patchray.distributed.bench.turns import take_turns
    from patchray.distributed.context import ParallelContext

    ctx = ParallelContext.single(torch.device("cuda", torch.cuda.current_device()))
    x = torch.ones(16, device=ctx.device)

    def work():
        y = x
        for _ in range(400):
            y = y + 1.0
        return y

    work()
    results = {}
    for clock in ("idle", "prefilled"):
        best = None
        for _ in range(3):
            with take_turns(ctx, clock=clock) as turns:
                work()
            run = turns.to_dict()
            best = run if best is None or run["compute_ms"][0] < best["compute_ms"][0] else best
        results[clock] = best
    pre, idle = results["prefilled"], results["idle"]
    assert pre["clock"] == "gpu-prefilled" and idle["clock"] == "idle-start"
    assert pre["queued"] == [True] and pre["host_syncs"] == [0]
    # 400 tiny kernels: a few us each on the GPU, ~5-10 us each to launch from Python
    assert pre["compute_ms"][0] < 0.7 * idle["compute_ms"][0]
    assert pre["launch_ms"][0] > pre["compute_ms"][0]
