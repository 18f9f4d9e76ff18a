"""Compiled transformer blocks (``sampling/compiled.py``) under sequence parallelism, on real gloo ranks (CPU).

The CPU tests compile with the ``aot_eager`` backend: the same graphs and graph breaks as inductor (the attention
module kept eager, the block before and after it compiled), without code generation, which takes minutes on two
cores. aot_eager runs the same aten operations as eager, so the compiled sequence-parallel output must equal the
stock forward to the same 1e-5 as the eager tests (fp32; the band split changes only GEMM row counts and the order of
the softmax sum over keys). Inductor's fused kernels are measured on the GPU by the DiT benchmark (``--compile``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from patchray.distributed.spawn import run_ranks

from .dit_models import build

TOL = 1e-5


def _task(ctx, families, modes):
    import torch._dynamo

    from patchray.distributed.sampling.compiled import compile_blocks
    from patchray.distributed.sampling.dit import parallelize_dit

    torch.manual_seed(0)
    res = {}
    for fam in families:
        model, inputs = build(fam)
        with torch.no_grad():
            ref = model(**inputs, return_dict=False)[0]
        for mode in modes:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            handle = parallelize_dit(model, ctx, mode=mode)
            compiled = compile_blocks(model, backend="aot_eager")
            with torch.no_grad():
                out = model(**inputs, return_dict=False)[0]
                again = model(**inputs, return_dict=False)[0]
            counters = torch._dynamo.utils.counters
            frames = int(counters["stats"]["unique_graphs"])
            breaks = sum(counters["graph_break"].values())
            blocks = len(compiled.blocks)
            compiled.remove()
            handle.remove()
            with torch.no_grad():
                after = model(**inputs, return_dict=False)[0]
            leftovers = [n for n, m in model.named_modules()
                         if "forward" in m.__dict__ or getattr(m, "_compiled_call_impl", None) is not None]
            res[(fam, mode)] = {"err": ((out - ref).norm() / ref.norm()).item(), "again": torch.equal(out, again),
                                "graphs": frames, "breaks": breaks, "blocks": blocks,
                                "restored": torch.equal(after, ref), "leftovers": leftovers}
    return res


@functools.lru_cache(maxsize=None)
def _results(n):
    # N = 2: a joint-attention family with text before the image (FLUX.1), one with cross-attention (Wan), and
    # Qwen-Image's dual stream; N = 3: FLUX.1's uneven bands (5 token rows) in both attention modes
    fams = ("flux", "wan", "qwen-image") if n == 2 else ("flux",)
    return run_ranks(_task, n, fams, ("gathered", "ulysses"), timeout_s=600)


@pytest.mark.parametrize("n", [2, 3])
def test_compiled_blocks_under_sequence_parallelism_equal_the_stock_forward(n):
    for rank, res in enumerate(_results(n)):
        for (fam, mode), r in res.items():
            where = f"{fam} {mode} N={n} rank {rank}"
            assert r["err"] <= TOL, f"{where}: rel L2 {r['err']:.2e}"
            assert r["again"], f"{where}: a second compiled call differs from the first"
            assert r["blocks"] >= 2 and r["graphs"] >= 2, f"{where}: nothing was compiled ({r})"
            assert r["breaks"] >= 1, f"{where}: no graph break at the attention: the compiler traced the route"
            assert r["restored"] and not r["leftovers"], f"{where}: remove() left {r['leftovers']}"


def test_an_unknown_compile_mode_is_refused_before_anything_changes():
    from patchray.distributed.sampling.compiled import compile_blocks

    model, _ = build("flux")
    with pytest.raises(ValueError, match="compile mode"):
        compile_blocks(model, mode="reduce-overhead")
    assert not any("forward" in m.__dict__ for m in model.modules())
