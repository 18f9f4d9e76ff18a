"""The DiT benchmark's bookkeeping on real gloo CPU ranks (tiny configurations), and its random-weight builder.

One run of the Wan preset at N = 1 and 2 (sequence gathered and Ulysses, CFG-parallel) checks what the H200 report
rests on: every case runs and agrees with N = 1 (fp32, 1e-5 relative L2: the sequence modes change only the order of
the softmax sum over keys; CFG-parallel evaluates the very same call), the bytes a rank puts on its link per step
equal the runtime's cost model (``sampling.dit.step_cost`` / ``split.split_cost``, formulas written independently of
the counting), a step is two calls in the sequence modes and one with CFG-parallel, and the modelled figures and
speed-ups are consistent with the measured compute and the reference step.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from patchray.distributed.bench import dit_bench as db


def test_random_build_has_no_meta_no_constant_weights_and_the_constructor_tensors_of_a_normal_build():
    import diffusers

    for preset in db.PRESETS.values():
        model = db.build_random(preset, "tiny", torch.device("cpu"), torch.float32, seed=0)
        params = dict(model.named_parameters())
        assert params and all(p.device.type == "cpu" for p in params.values())
        constant = [n for n, p in params.items() if p.numel() > 1 and bool((p == p.flatten()[0]).all())]
        assert not constant, f"{preset.name}: constant parameters {constant[:3]}"
        # RoPE tables and other constructor tensors equal those of an ordinary build of the same config
        plain = getattr(diffusers, preset.cls)(**preset.tiny)
        mine, ref = db._constructor_tensors(model), db._constructor_tensors(plain)
        assert set(mine) == set(ref)
        for name in ref:
            assert mine[name].device.type == "cpu" and torch.equal(mine[name], ref[name]), name
        # same seed, same weights (every rank builds its copy independently)
        again = db.build_random(preset, "tiny", torch.device("cpu"), torch.float32, seed=0)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
        out = model(**db.make_inputs(preset, "tiny", torch.device("cpu"), torch.float32)[0])[0]
        assert torch.isfinite(out).all() and out.abs().mean() > 0


def test_presets_match_the_cost_model_shapes_and_fit_rule():
    from patchray.distributed.sampling.dit import FULL_SIZE_SHAPES

    for preset in db.PRESETS.values():
        assert db.dit_shape(preset, "full") == FULL_SIZE_SHAPES[preset.shape_key]
    gib = 2**30
    device = int(139.8 * gib)
    assert db.ranks_that_fit(int(26.7 * gib), device, 4) == 4  # Wan 2.1 14B: four full copies
    assert db.ranks_that_fit(int(38.1 * gib), device, 4) == 3  # Qwen-Image: not four
    assert db.ranks_that_fit(int(38.1 * gib), None, 4) == 4  # CPU: no device limit
    wan = db.PRESETS["wan21_14b_480x832x81"]
    assert [c.label for c in db.plan_cases(wan, "tiny", (1, 2, 3))] == [
        "N=1", "cfg N=2", "seq-gathered N=2", "seq-ulysses N=2", "seq-gathered N=3"]  # 4 heads: no Ulysses at 3
    assert db.Case(4, "cfg").label == "cfg x seq2 N=4"
    with pytest.raises(ValueError, match="unknown preset"):
        db.run_dit_bench(["sdxl"], size="tiny", device="cpu", ranks=2)
    with pytest.raises(ValueError, match="between 1 and --ranks"):
        db.run_dit_bench(["flux1_1024"], size="tiny", device="cpu", ranks=2, ns=(1, 4))


def test_wan_tiny_on_two_cpu_ranks(tmp_path):
    out = str(tmp_path / "dit.json")
    report = db.run_dit_bench(["wan21_14b_480x832x81"], ranks=2, ns=(1, 2), size="tiny", device="cpu", warmup=1,
                              iters=1, out=out, timeout_s=120)
    recs = {r["case"]: r for r in report["records"]}
    assert list(recs) == ["N=1", "cfg N=2", "seq-gathered N=2", "seq-ulysses N=2"]
    assert all(r["status"] == "ok" and r["finite"] for r in recs.values())
    ref = recs["N=1"]
    assert ref["calls_per_step"] == 2 and ref["wire_bytes_per_step"] == 0
    assert ref["reference_step_ms"] == pytest.approx(2 * ref["compute_ms_per_call_alone"])
    for label, r in recs.items():
        if label == "N=1":
            continue
        # fp32: only the key order of the softmax sum differs (CFG-parallel: nothing at all)
        assert r["exactness"]["ok"] and r["exactness"]["rel_l2_vs_n1"] <= 1e-5, label
        assert r["wire_bytes_per_step"] == r["cost_model_wire_bytes_per_step"] > 0, label
        assert r["calls_per_step"] == (1 if r["mode"] == "cfg" else 2)
        assert r["reference_step_ms"] == pytest.approx(ref["reference_step_ms"])
        for prof, ms in r["modelled_step_ms"].items():
            assert ms >= r["compute_ms_per_step_alone"] - 1e-6
            assert r["speedup_modelled"][prof] == pytest.approx(r["reference_step_ms"] / ms, abs=1e-3)  # rounded to 3 places
        assert r["peak_metric"] == "process_rss_peak" and all(p and p > 0 for p in r["peak_gib_by_rank"])
    assert recs["cfg N=2"]["exactness"]["rel_l2_by_branch"] == [0.0, 0.0]  # the same call, cond and uncond
    assert recs["seq-ulysses N=2"]["counted_bytes_per_step"].get("all_to_all_single", 0) > 0
    assert "all_to_all_single" not in recs["seq-gathered N=2"]["counted_bytes_per_step"]
    with open(out) as f:
        assert json.load(f)["records"] == json.loads(json.dumps(report["records"], default=float))
    png = db.write_chart(report, str(tmp_path / "dit.png"))
    assert os.path.getsize(png) > 10_000
    assert "seq-ulysses N=2" in db.format_table(report)


def test_estimate_is_labelled_and_follows_the_token_share_and_the_cost_model():
    from patchray.distributed.sampling.dit import FULL_SIZE_SHAPES, step_cost
    from patchray.distributed.topology.links import model_latency_ms

    doc = db.estimate(["wan21_14b_480x832x81", "flux1_1024"], ns=(1, 2, 4))
    assert doc["estimate"] and all(r["estimate"] for r in doc["rows"])
    rows = {(r["preset"], r["case"]): r for r in doc["rows"]}
    wan = FULL_SIZE_SHAPES["wan21_14b_480x832x81"]
    g2 = rows[("wan21_14b_480x832x81", "seq-gathered N=2")]
    cost = step_cost(wan, 2, "gathered")
    assert g2["compute_ms_per_call"] == pytest.approx(3230.0 / 2, abs=0.1)  # 15 of 30 token rows, no text tokens
    assert g2["wire_bytes_per_step"] == 2 * cost["wire_bytes"]  # CFG: cond and uncond, one after the other
    nv = 2 * model_latency_ms(1615.0, cost["wire_bytes"], cost["messages"], "nvlink")
    assert g2["estimated_step_ms"]["nvlink"] == pytest.approx(nv, abs=0.1)
    assert g2["speedup_estimated"]["nvlink"] == pytest.approx(6460.0 / nv, abs=1e-3)
    # Wan at 4 ranks: bands of 8, 8, 7, 7 token rows; FLUX's 512 text tokens split 256/256 (sharded, the sampler's
    # exact modes) or whole on every rank (replicated, which caps the share)
    assert db.token_share(db.PRESETS["wan21_14b_480x832x81"], 4) == pytest.approx(8 / 30)
    assert db.token_share(db.PRESETS["flux1_1024"], 2) == pytest.approx((2048 + 256) / (4096 + 512))
    assert db.token_share(db.PRESETS["flux1_1024"], 2, text_tokens="replicated") == pytest.approx((2048 + 512) / (4096 + 512))
    # 512 over 3 ranks: 171 text tokens on the busiest rank, with a band of 22 of 64 token rows (22 x 64 tokens)
    assert db.token_share(db.PRESETS["flux1_1024"], 3) == pytest.approx((22 * 64 + 171) / (4096 + 512))
    cfg = rows[("flux1_1024", "cfg N=2")]
    assert cfg["reference_step_ms"] == 2 * 172.3 and cfg["calls_per_step"] == 1


def test_turn_taking_bills_a_collective_by_the_size_of_its_own_group():
    from patchray.distributed.accounting import CommCall
    from patchray.distributed.bench.linkmodel import call_wire_bytes
    from patchray.distributed.bench.measure import _group_size

    class Pair:  # a 2-rank subgroup inside a 4-rank turn-taking group (CFG x sequence)
        def size(self):
            return 2

    call = CommCall("all_gather", ([torch.zeros(4), torch.zeros(4)], torch.zeros(4)), {"group": Pair()}, False)
    assert _group_size(call, 4) == 2 and _group_size(CommCall("all_gather", (), {}, False), 4) == 4
    # 2 outputs + 1 input of 16 bytes counted; one input leaves the rank on a pair, three of five would on four ranks
    assert call_wire_bytes(call, _group_size(call, 4)) == 16 and call_wire_bytes(call, 4) == 29
