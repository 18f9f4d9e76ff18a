"""CFG-parallel and batch-parallel sampling (``sampling/split.py``) on real gloo ranks, against the serial loop.

A diffusers-style flow-matching Euler loop with classifier-free guidance runs on a tiny random-weight
``WanTransformer3DModel`` (3 frames, 7 token rows): serially (stock model, every item in turn) and

* CFG-parallel on 2 ranks (cond on one, uncond on the other, one exchange per step);
* batch-parallel on 2 ranks with an uneven batch of 3 latents (2 + 1);
* composed on 4 ranks: 2 CFG groups x 2 sequence-parallel ranks (gathered and Ulysses attention);
* and, in the same 4-rank run, one forward sequence-parallel over all 4 ranks (bands 2, 2, 2, 1).

Every final latent equals the serial one to 1e-5 relative L2 (fp32: each item's model call computes the same
arithmetic as the serial call, except for the key order inside the sequence-parallel softmax; three steps do not
amplify 1e-7 differences beyond ~1e-6). The CFG exchange is one all-gather per step, its bytes as modelled.
"""

from __future__ import annotations

import functools

import pytest
import torch

from patchray.distributed.sampling.split import assign_items, plan_split, split_cost
from patchray.distributed.spawn import run_ranks

from .dit_models import build

TOL = 1e-5
STEPS, CFG = 3, 4.0


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_plan_split_decides_groups_and_notes():
    assert plan_split(4, cfg_scale=5.0) == plan_split(4, cfg_scale=5.0)
    p = plan_split(4, cfg_scale=5.0)
    assert (p.cfg_groups, p.batch_groups, p.sequence, p.note) == (2, 1, 2, "")
    one = plan_split(2, cfg_scale=1.0)
    assert (one.cfg_groups, one.sequence) == (1, 2) and "CFG is 1" in one.note and "skipped" in one.note
    odd = plan_split(3, cfg_scale=5.0)
    assert (odd.cfg_groups, odd.sequence) == (1, 3) and "even number" in odd.note
    b = plan_split(4, cfg_scale=1.0, batch=3, batch_parallel=True)
    assert (b.cfg_groups, b.batch_groups, b.sequence) == (1, 2, 2)
    assert plan_split(8, cfg_scale=3.0, batch=4, batch_parallel=True).groups == 8
    assert assign_items(3, 2) == ((0, 1), (2,)) and assign_items(2, 2) == ((0,), (1,))
    assert assign_items(1, 2, allow_empty=True) == ((0,), ())
    with pytest.raises(ValueError, match="fewer groups"):
        assign_items(1, 2)


def _inputs(batch):
    model, inputs = build("wan")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, *inputs["hidden_states"].shape[1:], generator=g)
    pos = torch.randn(batch, 5, 16, generator=g)
    neg = torch.randn(batch, 5, 16, generator=g)
    return model, x, pos, neg


def _loop(model, x, pos, neg, evaluate, cfg=CFG):
    """Flow-matching Euler with CFG; ``evaluate(fn, conds, x, t)`` returns ``[fn(c, x, t) for c in conds]`` its own
    way (serially, CFG-parallel, batch-parallel)."""
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)

    def fn(cond, x, t):
        return model(hidden_states=x, encoder_hidden_states=cond, timestep=t, return_dict=False)[0]

    for i in range(STEPS):
        t = (sigmas[i] * 1000).expand(x.shape[0])
        if cfg == 1.0:
            (v,) = evaluate(fn, [pos], x, t)
        else:
            v_neg, v_pos = evaluate(fn, [neg, pos], x, t)
            v = v_neg + cfg * (v_pos - v_neg)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def _serial(fn, conds, x, t):
    return [fn(c, x, t) for c in conds]


def _two_rank_task(ctx):
    from patchray.distributed.comm import log_comm
    from patchray.distributed.sampling.comm_manager import Traffic
    from patchray.distributed.sampling.split import RankGroups, batch_parallel, cfg_parallel

    res = {}
    torch.set_grad_enabled(False)
    # CFG-parallel: cond and uncond on different ranks
    model, x, pos, neg = _inputs(2)
    want = _loop(model, x, pos, neg, _serial)
    plan = plan_split(ctx.world_size, cfg_scale=CFG)
    groups = RankGroups(ctx, plan.groups)
    calls = []
    traffic = Traffic()

    def cfg_eval(fn, conds, x, t):
        calls.append(1)
        return cfg_parallel(lambda c: fn(c, x, t), conds, groups.layout, traffic)

    with log_comm() as log:
        got = _loop(model, x, pos, neg, cfg_eval)
    res["cfg"] = {"err": _rel(got, want), "plan": (plan.cfg_groups, plan.sequence), "calls": dict(log.calls),
                  "bytes": dict(log.bytes), "steps": len(calls), "traffic": traffic.bytes["cfg"]}
    res["cfg_cost"] = split_cost(x.shape, 4, 2, 2)
    groups.close()

    # batch-parallel: 3 latents over 2 ranks (2 + 1), CFG 1 (CFG-parallel skipped with a note)
    model, x, pos, neg = _inputs(3)
    want = _loop(model, x, pos, neg, _serial, cfg=1.0)
    plan = plan_split(ctx.world_size, cfg_scale=1.0, batch=3, batch_parallel=True)
    groups = RankGroups(ctx, plan.groups)

    def batch_eval(fn, conds, x, t):
        return [batch_parallel(lambda xb, cb, tb: fn(cb, xb, tb), x, groups.layout, c, t) for c in conds]

    got = _loop(model, x, pos, neg, batch_eval, cfg=1.0)
    res["batch"] = {"err": _rel(got, want), "plan": (plan.cfg_groups, plan.batch_groups), "note": plan.note}
    # one item over two groups (a sampler step that evaluates only the positive prompt): the second group idles
    from patchray.distributed.sampling.split import evaluate_split

    item = torch.arange(6.0).view(2, 3)
    one = evaluate_split(lambda items: item.new_zeros((0, 2, 3)) if not items else item[None] + ctx.rank, 1,
                         groups.layout, allow_empty=True)
    res["one_item"] = one
    groups.close()
    return res


def _composed_task(ctx, modes):
    from patchray.distributed.comm import log_comm
    from patchray.distributed.sampling.dit import parallelize_dit
    from patchray.distributed.sampling.split import RankGroups, cfg_parallel

    torch.set_grad_enabled(False)
    model, x, pos, neg = _inputs(2)
    want = _loop(model, x, pos, neg, _serial)
    plan = plan_split(ctx.world_size, cfg_scale=CFG)
    groups = RankGroups(ctx, plan.groups)
    res = {}
    for mode in modes:
        handle = parallelize_dit(model, groups.layout.inner, mode=mode)
        with log_comm() as log:
            got = _loop(model, x, pos, neg, lambda fn, conds, x, t: cfg_parallel(lambda c: fn(c, x, t), conds, groups.layout))
        handle.remove()
        res[mode] = {"err": _rel(got, want), "plan": (plan.cfg_groups, plan.sequence), "bytes": dict(log.bytes),
                     "kv": handle.traffic.bytes["kv"]}
    groups.close()
    # sequence parallelism over all 4 ranks (7 token rows: bands 2, 2, 2, 1), one forward, 4 heads for Ulysses
    model, inputs = build("wan", heads=4)
    ref = model(**inputs, return_dict=False)[0]
    for mode in ("gathered", "ulysses"):
        handle = parallelize_dit(model, ctx, mode=mode)
        out = model(**inputs, return_dict=False)[0]
        res[("seq4", mode)] = {"err": _rel(out, ref), "rows": handle.state.shards.row_sizes}
        handle.remove()
    return res


@functools.lru_cache(maxsize=None)
def _two():
    return run_ranks(_two_rank_task, 2)


@functools.lru_cache(maxsize=None)
def _composed():
    # 4 ranks: the smallest composition (2 CFG groups x 2 sequence ranks); tiny model, 3 steps
    return run_ranks(_composed_task, 4, ("gathered", "ulysses"))


def test_cfg_parallel_equals_the_serial_loop_with_one_exchange_per_step():
    for rank, res in enumerate(_two()):
        r = res["cfg"]
        assert r["plan"] == (2, 1) and r["err"] <= TOL, (rank, r)
        # one all-gather per step, nothing else; its bytes as modelled
        assert r["calls"] == {"all_gather": STEPS}, r
        assert r["bytes"] == {"all_gather": STEPS * res["cfg_cost"]["counted"]["all_gather"]}, (r, res["cfg_cost"])
        assert r["traffic"] == STEPS * res["cfg_cost"]["wire_bytes"]


def test_batch_parallel_splits_an_uneven_batch_and_equals_the_serial_loop():
    for rank, res in enumerate(_two()):
        r = res["batch"]
        assert r["plan"] == (1, 2) and "CFG is 1" in r["note"], r
        assert r["err"] <= TOL, (rank, r)
        # the item came from group 0 (rank 0 added 0): every rank holds rank 0's result
        assert torch.equal(res["one_item"], torch.arange(6.0).view(1, 2, 3)), res["one_item"]


@pytest.mark.parametrize("mode", ["gathered", "ulysses"])
def test_two_cfg_groups_of_two_sequence_ranks_equal_the_serial_loop(mode):
    for rank, res in enumerate(_composed()):
        r = res[mode]
        assert r["plan"] == (2, 2) and r["err"] <= TOL, (rank, mode, r)
        assert r["kv"] > 0, r  # the sequence ranks did exchange attention
        assert set(r["bytes"]) >= {"all_gather"}, r


@pytest.mark.parametrize("mode", ["gathered", "ulysses"])
def test_four_sequence_ranks_with_uneven_bands_equal_the_stock_forward(mode):
    for rank, res in enumerate(_composed()):
        r = res[("seq4", mode)]
        assert r["rows"] == (2, 2, 2, 1) and r["err"] <= TOL, (rank, mode, r)
