"""Turn-taking (one rank's compute measured alone): the baton, the stage records and the modelled latency.

Two real gloo ranks (one spawn) run a known body: three ``all_reduce`` calls separated by compute segments whose
lengths differ per rank (sleeps: the baton's order is what is checked, not arithmetic speed). The arithmetic of
the model is checked on hand-made records.
"""

import math
import time

import pytest
import torch

from patchray.distributed.bench.linkmodel import model_alone, stage_compute_ms, summarise_alone
from patchray.distributed.bench.sample_bench import _alone_steps
from patchray.distributed.spawn import run_ranks
from patchray.distributed.topology.links import LinkProfile, get_profile, transfer_ms

#: seconds each rank computes per stage (rank 1 is the slow one in stages 0 and 2, rank 0 in stage 1 and 3)
SEGMENTS = {0: (0.02, 0.12, 0.02, 0.08), 1: (0.12, 0.02, 0.10, 0.02)}
FLOATS = 1000


def _body(ctx):
    from patchray.distributed.comm import all_reduce, barrier, log_comm
    from patchray.distributed.bench.measure import take_turns

    t = torch.ones(FLOATS)
    spans, concurrent_comm = [], []
    with log_comm() as log:
        with take_turns(ctx) as turns:
            for stage, seconds in enumerate(SEGMENTS[ctx.rank]):
                start = time.monotonic()  # system-wide clock: comparable between the two processes
                time.sleep(seconds)
                spans.append((stage, start, time.monotonic()))
                if stage < 3:
                    all_reduce(t, ctx)
    value = float(t[0])
    # the same body without turns: the fast rank's collective waits for the slow one's compute
    barrier(ctx)
    for seconds in SEGMENTS[ctx.rank][:3]:
        time.sleep(seconds)
        start = time.perf_counter()
        all_reduce(t, ctx)
        concurrent_comm.append(time.perf_counter() - start)
    return {"turns": turns.to_dict(), "spans": spans, "calls": log.total_calls, "value": value,
            "concurrent_comm": concurrent_comm}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_body, 2, timeout_s=120)


def test_ranks_compute_one_at_a_time(ranks):
    spans = {r: {s: (a, b) for s, a, b in ranks[r]["spans"]} for r in (0, 1)}
    for stage in range(4):
        (a0, b0), (a1, b1) = spans[0][stage], spans[1][stage]
        # rank 0 computes first, rank 1 starts only after rank 0 finished that stage
        assert b0 <= a1, f"stage {stage}: rank 1 started at {a1:.4f} before rank 0 ended at {b0:.4f}"
        if stage:
            # and no rank starts stage k before every rank finished stage k-1 (the collective between them)
            assert a0 >= spans[1][stage - 1][1]


def test_stages_collectives_and_bytes_are_recorded(ranks):
    for r in (0, 1):
        turns = ranks[r]["turns"]
        assert len(turns["compute_ms"]) == 4 and len(turns["cpu_ms"]) == 4  # 3 collectives split 4 stages
        assert turns["ops"] == ["all_reduce"] * 3
        # ring all-reduce at N = 2 puts 2(N-1)/N = 1x the buffer on the link
        assert turns["wire_bytes"] == [FLOATS * 4] * 3
        for measured, planned in zip(turns["compute_ms"], SEGMENTS[r]):
            assert planned * 1e3 <= measured < planned * 1e3 + 60  # the sleep, not the peer's turn
        # the baton's barriers bypass the interception layer: only the body's three calls are counted
        assert ranks[r]["calls"] == 3
        assert ranks[r]["value"] == 8.0  # three real sums over two ranks: 1 -> 2 -> 4 -> 8


def test_collectives_are_timed_without_the_peers_compute(ranks):
    # with turns, every rank enters each collective together; without them, the fast rank waits ~0.1 s
    assert max(max(ranks[r]["turns"]["comm_ms"]) for r in (0, 1)) < 50
    assert max(ranks[0]["concurrent_comm"][0], ranks[0]["concurrent_comm"][2]) > 0.05


def test_stage_sum_takes_the_slowest_rank_per_stage(ranks):
    compute = [ranks[r]["turns"]["compute_ms"] for r in (0, 1)]
    total = stage_compute_ms(compute)
    # per stage the slow rank: 120 + 120 + 100 + 80 ms, more than either rank's own total (240 / 260 ms)
    assert 420 <= total < 420 + 4 * 60
    assert total > max(sum(c) for c in compute) + 100


def test_model_alone_arithmetic():
    runs = [
        {"compute_ms": [10.0, 1.0, 5.0], "wire_bytes": [1000, 0], "comm_ms": [0.5, 0.5]},
        {"compute_ms": [2.0, 8.0, 5.0], "wire_bytes": [3000, 10], "comm_ms": [0.7, 0.1]},
    ]
    assert stage_compute_ms([r["compute_ms"] for r in runs]) == 10 + 8 + 5
    p = LinkProfile("t", 1.0, 100.0, False)
    out = model_alone(runs, 2, profiles=[p])
    # per call the slowest rank: 0.1 ms + 3000 B / 1 GB/s, then 0.1 ms + 10 B / 1 GB/s
    expected = 23 + (0.1 + 3000 / 1e9 * 1e3) + (0.1 + 10 / 1e9 * 1e3)
    assert math.isclose(out["t"], round(expected, 3), abs_tol=1e-9)
    host = get_profile("pcie4_x16_no_p2p")
    want = 23 + 2 * host.latency_us / 1e3 + transfer_ms(3000, host) + transfer_ms(10, host)
    assert math.isclose(model_alone(runs, 2, profiles=["pcie4_x16_no_p2p"])["pcie4_x16_no_p2p"], round(want, 3), abs_tol=1e-9)
    # ranks that ran different collectives: no stage alignment, the slowest rank's own total
    assert stage_compute_ms([[1.0, 2.0], [5.0]]) == 5.0
    # one rank: compute only
    assert model_alone([runs[0]], 1, profiles=["10gbe"])["10gbe"] == 16.0


def test_summary_is_labelled_modelled():
    it = {"compute_ms": [4.0, 6.0], "cpu_ms": [4.0, 6.0], "wire_bytes": [100], "comm_ms": [1.0], "ops": ["all_reduce"], "marks": []}
    other = dict(it, compute_ms=[5.0, 1.0], comm_ms=[2.0])
    block = summarise_alone([[it, it], [other, other]], 2)
    assert block["modelled"] is True and block["method"] == "turn-taking"
    assert block["compute_ms"] == 11.0 and block["compute_ms_by_rank"] == [10.0, 6.0]
    assert block["comm_ms_measured"] == 2.0 and block["latency_ms_modelled_measured_comm"] == 13.0
    assert block["stages"] == 2 and block["collectives"] == 1 and set(block["link_model"]) >= {"nvlink", "10gbe"}


def test_sampling_steps_split_at_the_marks():
    a = {"compute_ms": [1.0, 2.0, 3.0, 4.0, 9.0], "marks": [2, 4]}
    b = {"compute_ms": [2.0, 1.0, 1.0, 6.0, 9.0], "marks": [2, 4]}
    # step 0: stages 0-1 (max 2 + max 2), step 1: stages 2-3 (3 + 6); the tail (finalize) is no step
    assert _alone_steps([a, b], 2) == [4.0, 9.0]
    assert _alone_steps([a, None], 2) is None
    assert _alone_steps([a, dict(b, compute_ms=[1.0])], 2) is None


def _object_body(ctx):
    from patchray.distributed.bench.measure import take_turns
    from patchray.distributed.comm import all_gather_object, all_reduce

    t = torch.ones(FLOATS)
    spans = []
    with take_turns(ctx) as turns:
        time.sleep(0.05 * (2 - ctx.rank))  # rank 0 is the slow one before the object gather
        gathered = all_gather_object({"rank": ctx.rank}, ctx)
        start = time.monotonic()
        time.sleep(0.05)
        spans.append((start, time.monotonic()))
        all_reduce(t, ctx)
    return {"gathered": gathered, "turns": turns.to_dict(), "spans": spans, "value": float(t[0])}


def test_an_object_collective_inside_turns_passes_the_baton():
    # The compressed exchange agrees on its codec with all_gather_object in the middle of a sampling step. That call
    # is not a counted operation; its inner all_gathers are. Before the baton passed around them, rank 0 entered
    # the gather while rank 1 waited for its turn at a barrier, and the run hung until the spawn's timeout.
    out = run_ranks(_object_body, 2, timeout_s=60)
    for r in (0, 1):
        assert out[r]["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert out[r]["value"] == 2.0
        # one recorded collective (the all_reduce); the object gather's two inner all_gathers close stages only
        assert out[r]["turns"]["ops"] == ["all_reduce"]
        assert len(out[r]["turns"]["compute_ms"]) == 4
    # after the object gather the ranks still compute one at a time
    (_, b0), (a1, _) = out[0]["spans"][0], out[1]["spans"][0]
    assert b0 <= a1, f"rank 1 started at {a1:.4f} before rank 0 ended at {b0:.4f}"
