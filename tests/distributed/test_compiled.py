"""Compiled transformer blocks (``sampling/compiled.py``) under sequence parallelism, on real gloo ranks (CPU).

The CPU tests compile with the ``aot_eager`` backend: the same graphs and graph breaks as inductor (with
``attention="compiled"``, the default, the attention modules' projections compiled and the routed attention call one
opaque operation; with ``"eager"``, the attention module kept eager and the block before and after it compiled),
without code generation, which takes minutes on two
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


def _task(ctx, families, modes, scopes=("compiled",)):
    import torch._dynamo

    from patchray.distributed.sampling.compiled import compile_blocks
    from patchray.distributed.sampling.dit import parallelize_dit

    torch.manual_seed(0)
    res = {}
    for fam in families:
        model, inputs = build(fam)
        with torch.no_grad():
            ref = model(**inputs, return_dict=False)[0]
        for mode, scope in [(m, s) for m in modes for s in scopes]:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            handle = parallelize_dit(model, ctx, mode=mode)
            compiled = compile_blocks(model, backend="aot_eager", attention=scope)
            with torch.no_grad():
                out = model(**inputs, return_dict=False)[0]
                again = model(**inputs, return_dict=False)[0]
            counters = torch._dynamo.utils.counters
            frames = int(counters["stats"]["unique_graphs"])
            captured = int(counters["stats"]["calls_captured"])
            recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
            breaks = sum(counters["graph_break"].values())
            blocks = len(compiled.blocks)
            compiled.remove()
            handle.remove()
            with torch.no_grad():
                after = model(**inputs, return_dict=False)[0]
            leftovers = [n for n, m in model.named_modules()
                         if "forward" in m.__dict__ or getattr(m, "_compiled_call_impl", None) is not None]
            res[(fam, mode, scope)] = {"err": ((out - ref).norm() / ref.norm()).item(), "again": torch.equal(out, again),
                                "graphs": frames, "breaks": breaks, "blocks": blocks, "captured": captured,
                                "recompiles": recompiles,
                                "restored": torch.equal(after, ref), "leftovers": leftovers}
    return res


@functools.lru_cache(maxsize=None)
def _results(n):
    # N = 2: a joint-attention family with text before the image (FLUX.1), one with cross-attention (Wan), and
    # Qwen-Image's dual stream, attention compiled; N = 3: FLUX.1's uneven bands (5 token rows) in both attention
    # modes, with the attention compiled and kept eager
    if n == 2:
        return run_ranks(_task, n, ("flux", "wan", "qwen-image"), ("gathered", "ulysses"), timeout_s=600)
    return run_ranks(_task, n, ("flux",), ("gathered", "ulysses"), ("compiled", "eager"), timeout_s=600)


@pytest.mark.parametrize("n", [2, 3])
def test_compiled_blocks_under_sequence_parallelism_equal_the_stock_forward(n):
    for rank, res in enumerate(_results(n)):
        for (fam, mode, scope), r in res.items():
            where = f"{fam} {mode} attention {scope} N={n} rank {rank}"
            assert r["err"] <= TOL, f"{where}: rel L2 {r['err']:.2e}"
            assert r["again"], f"{where}: a second compiled call differs from the first"
            assert r["blocks"] >= 2 and r["graphs"] >= 2, f"{where}: nothing was compiled ({r})"
            assert r["breaks"] >= 1, f"{where}: no graph break at the attention: the compiler traced the route"
            assert r["restored"] and not r["leftovers"], f"{where}: remove() left {r['leftovers']}"
            # one rerouted processor class per processor class: every block's attention reuses one graph
            assert r["recompiles"] == 0, f"{where}: {r['recompiles']} recompilations"


def test_compiled_attention_puts_the_attention_modules_projections_into_the_graphs():
    res = _results(3)[0]
    for mode in ("gathered", "ulysses"):
        inside, outside = res[("flux", mode, "compiled")]["captured"], res[("flux", mode, "eager")]["captured"]
        # FLUX.1's attention modules project q, k, v (and the text's), normalise and rotate them: with the attention
        # compiled the graphs hold those operations too (eager: about half as many operations captured)
        assert inside > 1.5 * outside, f"{mode}: {inside} operations captured with the attention compiled, {outside} without"


def test_an_unknown_compile_mode_is_refused_before_anything_changes():
    from patchray.distributed.sampling.compiled import compile_blocks

    model, _ = build("flux")
    with pytest.raises(ValueError, match="compile mode"):
        compile_blocks(model, mode="reduce-overhead")
    with pytest.raises(ValueError, match="compile attention"):
        compile_blocks(model, attention="partly")
    assert not any("forward" in m.__dict__ for m in model.modules())
