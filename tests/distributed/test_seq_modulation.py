"""The DiTs' per-call modulation computed in shares across real gloo sequence ranks (tiny diffusers models, fp32).

FLUX.1, Qwen-Image and HunyuanVideo: every block's adaLN modulation layer reads the same per-call embedding, so each
rank computes 1/N of every layer's output features and one all-gather per call gives every rank all of them. Checked
against the unsharded forward of the same model on the same inputs (fp32; 1e-5 relative L2: the sequence-parallel
attention's key order is the only other difference, see test_dit.py):

* two calls at different timesteps: the second call must not reuse the first call's modulation;
* the layers actually shared (one shared computation per call, the layer count by hand), and nothing shared when the
  group is disabled (a host whose blocks may be replaced) or the rank is alone;
* a layer with a forward hook (a LoRA-like delta on its output) and one with a forward pre-hook (which changes its
  input): both keep their effect;
* ranks that disagree on how a layer computes (one rank's layer of another class computing the same map: its own
  forward fills its share) still exchange the same layout and agree with the unsharded forward;
* weights stored in another dtype than the compute dtype (diffusers' layerwise casting, bf16 storage, fp32
  compute): the rows are sliced, then cast as the layer's own forward casts them;
* a copy of a shared layer (a deepcopy keeps its adapter) computes its own map;
* blocks compiled with ``torch.compile`` (the layer's call is one opaque operation in the graph), over two runs: the
  second run's new group reuses the compiled graphs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from patchray.distributed.spawn import run_ranks

from .dit_models import build

TOL = 1e-5
#: modulation layers per tiny model, by hand: FLUX.1 and HunyuanVideo one double-stream block (image, text) and one
#: single-stream block; Qwen-Image two double-stream blocks (image, text)
LAYERS = {"flux": 3, "qwen-image": 4, "hunyuan-video": 3}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _calls(model, inputs, timesteps):
    outs = []
    with torch.no_grad():
        for t in timesteps:
            outs.append(model(**dict(inputs, timestep=torch.full_like(inputs["timestep"], t)), return_dict=False)[0])
    return outs


def _timesteps(family):
    return (0.3, 0.8) if family == "flux" else (300.0, 800.0)  # FLUX.1 takes timesteps in [0, 1]


class _SameMap(nn.Linear):
    """Another class computing the same linear map (a host's own layer type: the library leaves it to its forward)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def _lora_like(mod, args, out):
    return out + 0.1 * torch.tanh(out)


def _scale_input(mod, args):
    return (args[0] * 1.1,)


def _task(ctx):
    from patchray.distributed.sampling.compiled import compile_blocks
    from patchray.distributed.sampling.dit import parallelize_dit

    res = {}
    for fam in LAYERS:
        model, inputs = build(fam)
        ts = _timesteps(fam)
        ref = _calls(model, inputs, ts)
        handle = parallelize_dit(model, ctx, mode="gathered")
        group = handle.state.modulation
        out = _calls(model, inputs, ts)
        res[fam] = {"errs": [_rel(o, r) for o, r in zip(out, ref)], "members": len(group.members),
                    "shared_calls": group.shared_calls, "bytes": handle.traffic.bytes.get("modulation", 0)}
        group.enabled = False
        off = _calls(model, inputs, ts[:1])
        res[fam]["disabled"] = {"err": _rel(off[0], ref[0]), "shared_calls": group.shared_calls}
        handle.remove()
        res[fam]["removed"] = not any("_patchray_modulation_group" in m.__dict__ for m in model.modules())

    # hooks on two layers, on every rank and on the reference alike
    model, inputs = build("flux")
    h1 = model.transformer_blocks[0].norm1.linear.register_forward_hook(_lora_like)
    h2 = model.single_transformer_blocks[0].norm.linear.register_forward_pre_hook(_scale_input)
    ref = _calls(model, inputs, (0.5,))
    handle = parallelize_dit(model, ctx, mode="gathered")
    out = _calls(model, inputs, (0.5,))
    res["hooks"] = {"err": _rel(out[0], ref[0]), "shared_calls": handle.state.modulation.shared_calls}
    handle.remove()
    h1.remove(), h2.remove()
    without = _calls(model, inputs, (0.5,))
    res["hooks"]["hooks_matter"] = _rel(without[0], ref[0])

    # rank 1's text modulation of the double-stream block is of another class (the same map)
    model, inputs = build("flux")
    ref = _calls(model, inputs, (0.5,))
    if ctx.rank == 1:
        model.transformer_blocks[0].norm1_context.linear.__class__ = _SameMap
    handle = parallelize_dit(model, ctx, mode="gathered")
    out = _calls(model, inputs, (0.5,))
    res["mixed"] = {"err": _rel(out[0], ref[0]), "shared_calls": handle.state.modulation.shared_calls}
    handle.remove()

    # weights stored in bf16, computed in fp32 (diffusers' layerwise casting): the reference casts the same way
    from diffusers.hooks import apply_layerwise_casting

    model, inputs = build("flux")
    # the model's own enable_layerwise_casting skips modules named "norm*", where FLUX.1's modulation layers sit
    for layer in (model.transformer_blocks[0].norm1.linear, model.transformer_blocks[0].norm1_context.linear,
                  model.single_transformer_blocks[0].norm.linear):
        apply_layerwise_casting(layer, storage_dtype=torch.bfloat16, compute_dtype=torch.float32, skip_modules_pattern=None)
    ref = _calls(model, inputs, (0.5,))
    handle = parallelize_dit(model, ctx, mode="gathered")
    out = _calls(model, inputs, (0.5,))
    res["layerwise"] = {"err": _rel(out[0], ref[0]), "shared_calls": handle.state.modulation.shared_calls,
                        "stored": str(model.transformer_blocks[0].norm1.linear.weight.dtype)}
    handle.remove()

    # a copy of a shared layer (deepcopy keeps its adapter) computes its own map
    import copy

    model, inputs = build("flux")
    handle = parallelize_dit(model, ctx, mode="gathered")
    layer = copy.deepcopy(model.transformer_blocks[0].norm1.linear)
    x = torch.randn(2, layer.in_features)
    with torch.no_grad():
        res["copy"] = _rel(layer(x), F.linear(x, layer.weight, layer.bias))
    handle.remove()

    # compiled blocks: the layer's call is an opaque operation inside each block's graph; two runs (a new group each)
    # with the modulation shared, then two with it whole: the second run compiles as many new graphs either way
    from torch._dynamo.utils import counters

    model, inputs = build("flux")
    ts = _timesteps("flux")
    ref = _calls(model, inputs, ts)
    res["compiled"] = {}
    for share in (True, False):
        torch._dynamo.reset()
        counters.clear()
        graphs, runs = [], []
        for _run in range(2):
            handle = parallelize_dit(model, ctx, mode="gathered", share_modulation=share)
            compiled = compile_blocks(model, backend="aot_eager")
            out = _calls(model, inputs, ts)
            group = handle.state.modulation
            runs.append({"errs": [_rel(o, r) for o, r in zip(out, ref)],
                         "shared_calls": group.shared_calls if group else 0, "graph_calls": group.graph_calls if group else 0})
            compiled.remove()
            handle.remove()
            graphs.append(counters["stats"]["unique_graphs"])
        res["compiled"][share] = {"runs": runs, "graphs": graphs}
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(_task, 2, timeout_s=600)


@pytest.mark.parametrize("family", sorted(LAYERS))
def test_each_call_shares_its_own_modulation_exactly(results, family):
    for rank, res in enumerate(results):
        r = res[family]
        assert max(r["errs"]) <= TOL, (rank, family, r["errs"])
        assert r["members"] == LAYERS[family]
        assert r["shared_calls"] == 2  # one shared computation per model call
        assert r["bytes"] > 0
        assert r["removed"]


@pytest.mark.parametrize("family", sorted(LAYERS))
def test_a_disabled_group_runs_every_layer_whole_and_exactly(results, family):
    for res in results:
        d = res[family]["disabled"]
        assert d["err"] <= TOL and d["shared_calls"] == 2  # no third shared computation


def test_hooked_layers_keep_their_hooks_effect(results):
    for rank, res in enumerate(results):
        r = res["hooks"]
        assert r["hooks_matter"] > 1e-3  # the hooks change the output: the comparison below can fail
        assert r["err"] <= TOL and r["shared_calls"] == 1, (rank, r)


def test_ranks_computing_a_layer_differently_still_agree(results):
    for rank, res in enumerate(results):
        r = res["mixed"]
        assert r["err"] <= TOL and r["shared_calls"] == 1, (rank, r)


def test_weights_stored_in_another_dtype_than_the_compute_agree_with_one_rank(results):
    for rank, res in enumerate(results):
        r = res["layerwise"]
        assert r["stored"] == "torch.bfloat16", r  # the layer holds bf16 between calls: a cast was needed
        assert r["err"] <= TOL and r["shared_calls"] == 1, (rank, r)


def test_a_copied_shared_layer_computes_its_own_map(results):
    for rank, res in enumerate(results):
        assert res["copy"] <= 1e-6, (rank, res["copy"])


def test_compiled_blocks_share_the_modulation_exactly_and_a_new_run_reuses_their_graphs(results):
    for rank, res in enumerate(results):
        for run in res["compiled"][True]["runs"]:
            # compiled (aot_eager) against eager: the same operations, regrouped (fp32 rounding)
            assert max(run["errs"]) <= TOL and run["shared_calls"] == 2, (rank, run)
            assert run["graph_calls"] == 2 * LAYERS["flux"], run  # every layer's call came through the graphs' operation
        assert all(max(run["errs"]) <= TOL and run["shared_calls"] == 0 for run in res["compiled"][False]["runs"])
        shared, whole = res["compiled"][True]["graphs"], res["compiled"][False]["graphs"]
        # the second run's group is a new one: it adds no graphs the whole-modulation runs do not add
        assert shared[1] - shared[0] == whole[1] - whole[0], (shared, whole)
