"""Sequence parallelism on diffusers' own DiT classes (tiny random-weight configs) vs the unsharded forward.

For FLUX.1, Qwen-Image, Wan (per-token timesteps, odd frame count), HunyuanVideo (text padding mask, text after
the image tokens) and LTX-Video: gathered and Ulysses attention at 2 and 3 real gloo ranks (7 or 5 token rows:
uneven bands) equal the stock forward to 1e-5 relative L2 (fp32: only the order of the keys in each softmax sum
differs; see test_sequence.py), the bytes counted by comm equal the modelled cost, and removing the plan restores
the model (same outputs bit for bit, no adapter, hook or forward left, state_dict unchanged).

Text sharding (the default for the joint-attention families): FLUX.1, Qwen-Image and HunyuanVideo shard their 5
text tokens (3 + 2 at N = 2, 2 + 2 + 1 at N = 3: odd and uneven) with the same tolerance, with padded text masks
(Qwen-Image's and HunyuanVideo's default inputs: the mask's validity laid over every rank's keys) and without; 2 text
tokens over 3 ranks
leave rank 2 without text for FLUX.1, while Qwen-Image and HunyuanVideo (whose text RoPE / block split cannot take an
empty text slice) keep them whole. The per-rank text counts are asserted against hand-computed numbers, and the bytes comm
counts against the cost model with each rank's K/V share = its image band + its text slice.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from patchray.distributed.spawn import run_ranks

from .dit_models import FAMILIES, HEAD_DIM, HEADS, build, token_rows

TOL = 1e-5


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _leftovers(model):
    from patchray.distributed.parallel.plan import is_adapted

    left = []
    for name, m in model.named_modules():
        if is_adapted(m) or "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks:
            left.append(name or "<root>")
    return left


#: text-sharding cases beyond each family's default inputs: name -> (family, text tokens, unpadded mask, shard_text)
TEXT_CASES = {
    "qwen-image/full-text": ("qwen-image", 5, True, True),
    "hunyuan-video/full-text": ("hunyuan-video", 5, True, True),
    "flux/2-text": ("flux", 2, True, True),
    "qwen-image/2-text": ("qwen-image", 2, True, True),
    "hunyuan-video/2-text": ("hunyuan-video", 2, True, True),
    "flux/replicated": ("flux", 5, True, False),
}


def _case(name):
    """``(model, inputs, shard_text)`` of a family name or a :data:`TEXT_CASES` name."""
    if name not in TEXT_CASES:
        model, inputs = build(name)
        return model, inputs, True
    fam, text, unpadded, shard_text = TEXT_CASES[name]
    model, inputs = build(fam, text=text)
    for key in ("encoder_hidden_states_mask", "encoder_attention_mask"):
        if unpadded and key in inputs:
            inputs[key] = torch.ones_like(inputs[key])
    return model, inputs, shard_text


def _family_task(ctx, families, modes, extras=False):
    from patchray.distributed.comm import log_comm
    from patchray.distributed.sampling.dit import parallelize_dit

    torch.manual_seed(0)
    res = {}
    for fam in families:
        model, inputs, shard_text = _case(fam)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            ref = model(**inputs, return_dict=False)[0]
        for mode in modes:
            handle = parallelize_dit(model, ctx, mode=mode, shard_text=shard_text)
            with torch.no_grad(), log_comm() as log:
                out = model(**inputs, return_dict=False)[0]
            shards = handle.state.shards
            handle.remove()
            with torch.no_grad():
                after = model(**inputs, return_dict=False)[0]
            res[(fam, mode)] = {
                "err": _rel(out, ref),
                "out_channels": out.numel() // (out.shape[0] * shards.total),
                "shape_ok": out.shape == ref.shape,
                "bytes": dict(log.bytes),
                "calls": dict(log.calls),
                "counts": shards.counts,
                "text_sizes": shards.text_sizes,
                "restored_exactly": torch.equal(after, ref),
                "leftovers": _leftovers(model),
                "state_dict_same": all(torch.equal(state[k], v) for k, v in model.state_dict().items()),
                "traffic": dict(handle.traffic.bytes),
                "mode_calls": dict(handle.state.mode_calls),
            }
    if extras:
        res["displaced"] = _displaced_loop(ctx)
        res["displaced-flux"] = _displaced_loop(ctx, "flux")
        res["backend"] = _backend_task(ctx)
        res["auto_nccl"] = _auto_nccl_task(ctx)
    return res


def _auto_nccl_task(ctx):
    """``auto`` on an NCCL group (this gloo group labelled NCCL: the label is all ``auto`` reads) overlaps the K/V
    gather on a model left at PyTorch's attention, and keeps a kernel the user chose with diffusers'
    ``set_attention_backend`` (gathered through that kernel); both equal the stock forward."""
    import dataclasses

    from patchray.distributed.sampling.dit import parallelize_dit

    res = {}
    for chosen in (None, "_native_math"):
        model, inputs = build("flux")
        if chosen:
            model.set_attention_backend(chosen)
        with torch.no_grad():
            ref = model(**inputs, return_dict=False)[0]
        handle = parallelize_dit(model, dataclasses.replace(ctx, backend="nccl"), mode="auto")
        with torch.no_grad():
            out = model(**inputs, return_dict=False)[0]
        res[chosen or "default"] = {"err": _rel(out, ref), "mode_calls": dict(handle.state.mode_calls)}
        handle.remove()
    return res


def _displaced_loop(ctx, family="wan", steps=3):
    """DISPLACED K/V (Wan; FLUX.1 with its text sharded, the text K/V part of the sharded set): step 0 synchronous
    (exact), later steps read the peers' K/V of the step before."""
    from patchray.distributed.parallel.exchange import DISPLACED
    from patchray.distributed.sampling.dit import parallelize_dit

    model, inputs = build(family)
    t = 0.5 if family == "flux" else 500.0  # FLUX.1 takes timesteps in [0, 1]
    inputs = dict(inputs, timestep=torch.tensor([t, t]))
    g = torch.Generator().manual_seed(3)
    xs = [inputs["hidden_states"] + 0.05 * k * torch.randn(inputs["hidden_states"].shape, generator=g) for k in range(steps)]
    with torch.no_grad():
        exact = [model(**dict(inputs, hidden_states=x), return_dict=False)[0] for x in xs]
    handle = parallelize_dit(model, ctx, mode="gathered", kv=DISPLACED)
    out = []
    traffic = handle.traffic
    per_step = []
    for step, x in enumerate(xs):
        before = dict(traffic.bytes), dict(traffic.async_bytes)
        handle.begin_step(step, sync=step == 0)
        with torch.no_grad():
            out.append(model(**dict(inputs, hidden_states=x), return_dict=False)[0])
        handle.end_step()
        per_step.append((traffic.bytes["kv"] - before[0]["kv"], traffic.async_bytes["kv"] - before[1]["kv"]))
    handle.remove()
    return {"errs": [_rel(o, e) for o, e in zip(out, exact)], "kv": per_step, "leftovers": _leftovers(model),
            "text_sizes": handle.state.shards.text_sizes}


def _cases(n):
    return FAMILIES + tuple(c for c in TEXT_CASES if n == 3 or not c.endswith("2-text"))


@functools.lru_cache(maxsize=None)
def _results(n):
    return run_ranks(_family_task, n, _cases(n), ("gathered", "ulysses", "overlapped", "ring"), extras=n == 2)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_parallel_dit_equals_the_stock_forward(n, family):
    for rank, res in enumerate(_results(n)):
        for mode in ("gathered", "ulysses", "overlapped", "ring"):
            r = res[(family, mode)]
            assert r["shape_ok"] and r["err"] <= TOL, (n, rank, family, mode, r["err"])
            if mode in ("overlapped", "ring"):  # the unmasked calls (FLUX.1, Wan, LTX-Video); masked ones run gathered
                want = {mode} if family in ("flux", "wan", "ltx-video") else {"gathered"}
                assert set(r["mode_calls"]) == want, (family, r["mode_calls"])
            # uneven bands of token rows: the first rows % n ranks one row taller
            rows = token_rows(family)
            assert len(set(r["counts"])) == (1 if rows % n == 0 else 2), r["counts"]


#: self/joint attention layers and text tokens in their sequences, per tiny family config / text case
_ATTENTION = {"flux": (2, 5), "qwen-image": (2, 5), "wan": (2, 0), "hunyuan-video": (2, 5), "ltx-video": (2, 0),
              "qwen-image/full-text": (2, 5), "hunyuan-video/full-text": (2, 5), "flux/2-text": (2, 2),
              "qwen-image/2-text": (2, 2), "hunyuan-video/2-text": (2, 2), "flux/replicated": (2, 5)}

#: output features of the adaLN modulation layers the ranks compute in shares, by hand from the tiny configs
#: (width 48: 6 heads x 8): FLUX.1 and HunyuanVideo one double-stream block (image and text, 6 x 48 each) and one
#: single-stream block (3 x 48); Qwen-Image two double-stream blocks; Wan and LTX-Video none
_MODULATION = {"flux": (288, 288, 144), "hunyuan-video": (288, 288, 144), "qwen-image": (288,) * 4, "wan": (),
               "ltx-video": ()}

#: each rank's text tokens, by hand: contiguous slices, the first T % N ranks one more; () = the text stays whole
#: (no text in the self-attention; Qwen-Image and HunyuanVideo with fewer text tokens than ranks; shard_text off).
#: Qwen-Image's and HunyuanVideo's default inputs carry padded text masks: split too, their masks over every rank's keys
_TEXT_SIZES = {
    2: {"flux": (3, 2), "qwen-image": (3, 2), "wan": (), "hunyuan-video": (3, 2), "ltx-video": (), "qwen-image/full-text": (3, 2),
        "hunyuan-video/full-text": (3, 2), "flux/replicated": ()},
    3: {"flux": (2, 2, 1), "qwen-image": (2, 2, 1), "wan": (), "hunyuan-video": (2, 2, 1), "ltx-video": (),
        "qwen-image/full-text": (2, 2, 1), "hunyuan-video/full-text": (2, 2, 1), "flux/2-text": (1, 1, 0),
        "qwen-image/2-text": (), "hunyuan-video/2-text": (), "flux/replicated": ()},
}


def _image_counts(case, n):
    """Image tokens per rank, by hand: token rows split with the first rows % n ranks one row taller."""
    fam = TEXT_CASES[case][0] if case in TEXT_CASES else case
    frames, cols = {"flux": (1, 3), "qwen-image": (1, 3), "wan": (3, 3), "hunyuan-video": (3, 4), "ltx-video": (3, 4)}[fam]
    rows = token_rows(fam)
    return [frames * cols * (rows // n + (1 if r < rows % n else 0)) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", sorted(set(_cases(2) + _cases(3)) - set(FAMILIES)))
def test_joint_attention_families_shard_their_text_exactly(n, case):
    if case not in _cases(n):
        pytest.skip("fewer text tokens than ranks only at N = 3")
    for rank, res in enumerate(_results(n)):
        for mode in ("gathered", "ulysses", "overlapped", "ring"):
            r = res[(case, mode)]
            assert r["shape_ok"] and r["err"] <= TOL, (n, rank, case, mode, r["err"])
            assert r["text_sizes"] == _TEXT_SIZES[n][case], (n, case, r["text_sizes"])
            assert r["restored_exactly"] and r["leftovers"] == [], (n, case, mode)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_default_inputs_shard_the_text_unless_it_is_padded(n, family):
    for res in _results(n):
        assert res[(family, "gathered")]["text_sizes"] == _TEXT_SIZES[n][family], (n, family)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", sorted(set(_cases(2) + _cases(3))))
def test_counted_bytes_equal_the_modelled_cost(n, case):
    from patchray.distributed.parallel.sequence import attention_cost

    if case not in _cases(n):
        pytest.skip("fewer text tokens than ranks only at N = 3")
    layers, text = _ATTENTION[case]
    texts = _TEXT_SIZES[n][case]
    image = _image_counts(case, n)
    # a rank's K/V share: its image band plus its text slice; replicated text travels only in Ulysses' head gather
    shares = [i + t for i, t in zip(image, texts)] if texts else image
    replicated = 0 if texts else text
    for rank, res in enumerate(_results(n)):
        for mode in ("gathered", "ulysses", "overlapped", "ring"):
            r = res[(case, mode)]
            assert list(r["counts"]) == image, (case, r["counts"], image)
            want = {}
            ran = list(r["mode_calls"])  # overlapped and ring run gathered where a call has a mask
            assert len(ran) == 1, r["mode_calls"]
            cost = attention_cost(ran[0], shares, HEADS, HEAD_DIM, 4, batch=2, replicated=replicated)
            for op, nbytes in cost.counted.items():
                want[op] = want.get(op, 0) + layers * nbytes
            # the output projection's image tokens (the text is dropped before it), gathered once (padded to the
            # largest band): N outputs + the input
            want["all_gather"] = want.get("all_gather", 0) + (n + 1) * 2 * max(image) * r["out_channels"] * 4
            # the modulation layers' shares: each rank ceil(features / N) of every layer, one all-gather per call
            fam = TEXT_CASES[case][0] if case in TEXT_CASES else case
            mod = sum(-(-f // n) for f in _MODULATION[fam])
            if mod:
                want["all_gather"] += (n + 1) * 2 * mod * 4
            assert r["bytes"] == want, (n, rank, case, mode, r["bytes"], want)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_removing_the_plan_restores_the_model(n, family):
    for rank, res in enumerate(_results(n)):
        for mode in ("gathered", "ulysses", "overlapped", "ring"):
            r = res[(family, mode)]
            assert r["restored_exactly"] and r["state_dict_same"] and r["leftovers"] == [], (n, rank, family, mode, r)


def test_an_uncovered_class_is_refused_with_its_name_and_what_is_needed():
    from diffusers import SD3Transformer2DModel

    from patchray.distributed.context import ParallelContext
    from patchray.distributed.sampling.dit import parallelize_dit

    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=8, out_channels=4)
    with pytest.raises(NotImplementedError, match=r"SD3Transformer2DModel.*FluxTransformer2DModel.*positional embedding"):
        parallelize_dit(model, ParallelContext.single())


def test_the_plans_gather_where_diffusers_cp_plan_gathers():
    from patchray.distributed.parallel.seq_styles import GatherTokens
    from patchray.distributed.sampling.dit import DIT_FAMILIES, cp_plan_points

    for fam in FAMILIES:
        model, _ = build(fam)
        row = DIT_FAMILIES[type(model).__name__]
        gathers = [g for g, style in row.layers.items() if isinstance(style, GatherTokens)]
        cp = cp_plan_points(model)
        if cp["gather"]:  # HunyuanVideo carries no _cp_plan in diffusers 0.42
            assert gathers == cp["gather"], (fam, gathers, cp)


@pytest.mark.parametrize("which", ["displaced", "displaced-flux"])
def test_displaced_kv_on_a_dit_is_exact_on_its_synchronous_step_then_one_step_stale(which):
    for rank, res in enumerate(_results(2)):
        d = res[which]
        assert d["text_sizes"] == ((3, 2) if which == "displaced-flux" else ()), d  # FLUX.1: text K/V sharded too
        errs, kv = d["errs"], d["kv"]
        assert errs[0] <= TOL, d  # the synchronous warm-up step is exact
        # later steps use the peers' K/V of the previous (different) input: a small, nonzero error
        assert all(1e-6 < e < 0.1 for e in errs[1:]), d
        assert kv[0][0] > 0 and kv[0][1] == 0, d  # blocking all-gathers on the synchronous step
        assert all(b == kv[0][0] and a == b for b, a in kv[1:]), d  # the same bytes, sent asynchronously
        assert d["leftovers"] == [], d


def test_step_cost_is_what_the_link_model_reads_from_counted_bytes():
    from patchray.distributed.bench.linkmodel import wire_bytes
    from patchray.distributed.sampling.dit import FULL_SIZE_SHAPES, step_cost

    for name, shape in FULL_SIZE_SHAPES.items():
        for n in (2, 3, 4):
            for mode in ("gathered", "ulysses"):
                if mode == "ulysses" and shape.heads % n:
                    continue
                for shard_text in (True, False):
                    c = step_cost(shape, n, mode, shard_text=shard_text)
                    assert abs(wire_bytes(c["counted"], n) - c["wire_bytes"]) <= 8, (name, n, mode)  # integer rounding
    flux = FULL_SIZE_SHAPES["flux1_1024"]
    # gathered, text sharded: each of 57 layers sends this rank's K and V (2048 image + 256 text tokens x 3072 x
    # bf16) to the other rank; the output projection gathers the 2048 image tokens only; the modulation layers (19
    # double-stream blocks x 2 x 6 x 3072 features, 38 single-stream x 3 x 3072) send half their features once
    mod = (19 * 2 * 6 + 38 * 3) * 3072 // 2 * 2
    assert step_cost(flux, 2, "gathered")["wire_bytes"] == 57 * 2 * (2048 + 256) * 3072 * 2 + 2048 * 64 * 2 + mod
    assert step_cost(flux, 2, "gathered")["messages"] == 57 + 1 + 1
    # text replicated: only the image band's K and V travel
    assert step_cost(flux, 2, "gathered", shard_text=False)["wire_bytes"] == 57 * 2 * 2048 * 3072 * 2 + 2048 * 64 * 2 + mod
    # the busiest rank's token share: 2048 + 256 of 4608 sharded (ideal 2x), 2048 + 512 replicated (1.8x); at 3 ranks
    # 22 of 64 token rows (1408 image tokens) + 171 of the 512 text tokens
    from patchray.distributed.sampling.dit import token_share

    assert token_share(flux, 2) == 2304 / 4608 and token_share(flux, 2, shard_text=False) == 2560 / 4608
    assert token_share(flux, 3) == (22 * 64 + 171) / 4608
    # at N = 2 auto keeps gathered (same bytes, fewer messages); at N = 4 Ulysses sends half
    assert step_cost(flux, 2, "auto")["mode"] == "gathered" and step_cost(flux, 4, "auto", link="pcie4_x16_no_p2p")["mode"] == "ulysses"


class _HandWrittenAttention:
    """An attention processor that computes softmax(q k^T) v itself (as flash/sage kernels do, outside SDPA)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(ctx), attn.to_v(ctx)
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return attn.to_out[0](w @ v)


class _SdpaProcessor:
    """LTX-Video's attention written as diffusers' processors were before its attention dispatch (0.35) and as
    hand-written processors still are: ``F.scaled_dot_product_attention`` on ``[batch, heads, tokens, head_dim]``.
    Its encoder mask is ignored (the inputs' mask is all ones)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(ctx)), attn.to_v(ctx)
        if image_rotary_emb is not None and encoder_hidden_states is None:
            q, k = apply_rotary_emb(q, image_rotary_emb), apply_rotary_emb(k, image_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def _refused(fn):
    try:
        fn()
        return "accepted"
    except NotImplementedError as e:
        return str(e)


def _modes_inside_attention(ctx):
    """Torch function modes active while an adapted FLUX.1 attention module projects its q (none: the processor's
    torch calls run at full speed) and routed attention calls per module and call (one)."""
    from torch.overrides import _get_current_function_mode_stack

    from patchray.distributed.sampling.dit import parallelize_dit

    model, inputs = build("flux")
    seen = []
    hooks = [m.to_q.register_forward_hook(lambda mod, i, o: seen.append(len(_get_current_function_mode_stack())))
             for m in (model.transformer_blocks[0].attn, model.single_transformer_blocks[0].attn)]
    handle = parallelize_dit(model, ctx, mode="gathered")
    slot = type(model.transformer_blocks[0].attn.processor)._patchray_slot
    with torch.no_grad():
        model(**inputs)
    calls = slot.calls
    handle.remove()
    for h in hooks:
        h.remove()
    return {"modes": seen, "routed": calls}


def _backend_task(ctx):
    """A processor that computes attention itself: refused when the plan is applied (before any work), and at the
    call when it is set after the plan (the backstop). One processor object shared by every attention module
    (``attn1`` adapted, ``attn2`` not): diffusers' dispatch-calling one and an SDPA-calling one equal the stock
    forward with that processor, and the processor's class comes back after ``remove()``."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

    from patchray.distributed.sampling.dit import parallelize_dit

    res = {}
    model, inputs = build("ltx-video")
    for block in model.transformer_blocks:
        block.attn1.processor = _HandWrittenAttention()
    res["apply"] = _refused(lambda: parallelize_dit(model, ctx, mode="gathered").remove())
    res["apply_leftovers"] = _leftovers(model)
    model, inputs = build("ltx-video")
    handle = parallelize_dit(model, ctx, mode="gathered")
    for block in model.transformer_blocks:
        block.attn1.processor = _HandWrittenAttention()
    with torch.no_grad():
        res["call"] = _refused(lambda: model(**inputs))
    handle.remove()
    res["modes"] = _modes_inside_attention(ctx)
    for name, proc in (("shared-dispatch", LTXVideoAttnProcessor()), ("shared-sdpa", _SdpaProcessor())):
        model, inputs = build("ltx-video")
        model.set_attn_processor(proc)
        with torch.no_grad():
            ref = model(**inputs, return_dict=False)[0]
        original = type(proc)
        handle = parallelize_dit(model, ctx, mode="gathered")
        with torch.no_grad():
            out = model(**inputs, return_dict=False)[0]
        routed_class = type(proc)
        handle.remove()
        with torch.no_grad():
            after = model(**inputs, return_dict=False)[0]
        res[name] = {"err": _rel(out, ref), "rerouted": routed_class is not original, "class_back": type(proc) is original,
                     "restored_exactly": torch.equal(after, ref), "leftovers": _leftovers(model),
                     "same_object": all(b.attn1.processor is proc and b.attn2.processor is proc for b in model.transformer_blocks)}
    return res


def test_an_attention_implementation_that_bypasses_the_dispatch_is_refused():
    for res in _results(2):
        msg = res["backend"]
        for when in ("apply", "call"):
            assert "native" in msg[when] and "attn1" in msg[when] and "F.scaled_dot_product_attention" in msg[when], msg
        assert "_HandWrittenAttention" in msg["apply"], msg  # named, before any work
        assert msg["apply_leftovers"] == [], msg  # the refusal leaves the model as it was


def test_auto_on_nccl_overlaps_unless_the_user_chose_the_attention_kernel():
    for res in _results(2):
        r = res["auto_nccl"]
        assert set(r["default"]["mode_calls"]) == {"overlapped"} and r["default"]["err"] <= TOL, r
        assert set(r["_native_math"]["mode_calls"]) == {"gathered"} and r["_native_math"]["err"] <= TOL, r


def test_no_function_mode_runs_over_an_adapted_attention_module():
    for res in _results(2):
        r = res["backend"]["modes"]
        assert r["modes"] == [0, 0], r  # to_q of a double and of a single block, each projected once per call
        assert r["routed"] == 1, r  # the last module's forward: its one attention call took the route


@pytest.mark.parametrize("which", ["shared-dispatch", "shared-sdpa"])
def test_a_processor_shared_by_adapted_and_unadapted_modules_is_routed_for_the_adapted_ones(which):
    for res in _results(2):
        r = res["backend"][which]
        assert r["err"] <= TOL and r["rerouted"] and r["same_object"], r
        assert r["class_back"] and r["restored_exactly"], r
        assert r["leftovers"] == [], r
