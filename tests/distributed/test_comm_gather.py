"""``comm.all_gather_padded``: one flat all-gather straight into the result when the ranks' pieces are consecutive
in memory, the list form otherwise; the same result and the same counted bytes either way (real gloo ranks)."""

from __future__ import annotations

import functools

import pytest
import torch

from patchray.distributed.spawn import run_ranks


def _piece(rank: int, shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000.0 * rank


def _task(ctx):
    from patchray.distributed.comm import all_gather_padded, intercept, log_comm

    n, r = ctx.world_size, ctx.rank
    out = {}
    cases = {
        "flat": ((1, 4, 2, 3), 1, [4] * n),      # batch 1, equal extents: consecutive pieces
        "uneven": ((1, 4 + r, 2, 3), 1, [4 + q for q in range(n)]),
        "batch2": ((2, 4, 3), 1, [4] * n),       # a non-unit dim before the gathered one
        "dim0": ((3, 5), 0, [3] * n),
    }
    for name, (shape, dim, sizes) in cases.items():
        raw = []

        def seen(call, proceed):
            raw.append(call.op)
            return proceed()

        with intercept(seen), log_comm() as log:
            got = all_gather_padded(_piece(r, shape), ctx, dim=dim, sizes=sizes)
        pieces = [_piece(q, shape[:dim] + (sizes[q],) + shape[dim + 1:]) for q in range(n)]
        out[name] = {"equal": torch.equal(got, torch.cat(pieces, dim=dim)), "ops": dict(log.bytes),
                     "calls": int(log.total_calls), "raw": raw, "piece_bytes": max(p.numel() for p in pieces) * 4}
    return out


@functools.lru_cache(maxsize=None)
def _results(n):
    return run_ranks(_task, n)


@pytest.mark.parametrize("n", [2, 3])
def test_flat_and_list_gathers_give_the_concatenation_and_count_the_same_bytes(n):
    for rank, res in enumerate(_results(n)):
        for name, r in res.items():
            assert r["equal"], f"{name} N={n} rank {rank}: not the concatenation of the ranks' pieces"
            assert r["calls"] == 1, f"{name}: {r['calls']} collectives (one expected, no metadata exchange)"
            flat = name in ("flat", "dim0")
            assert r["raw"] == ["all_gather_into_tensor" if flat else "all_gather"], f"{name}: {r['raw']}"
            # both forms are logged as an all-gather of the input once and the N received pieces (the padded extent)
            assert r["ops"] == {"all_gather": (n + 1) * r["piece_bytes"]}, f"{name} N={n}: {r['ops']}"
