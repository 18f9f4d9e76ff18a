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


def test_ranks_at_once_are_timed_beside_the_model_on_cpu_ranks(tmp_path):
    """``concurrent``: after the turn-taking calls every case runs with the ranks at once; the record holds the
    slowest rank's wall time per call, the step and speed-up derived from it, and each model's error against it
    (what a multi-GPU run compares). The ring and overlapped modes run as themselves (their calls are counted) and
    agree with N = 1 (fp32: only the order of the log-sum-exp merge differs)."""
    import statistics

    report = db.run_dit_bench(["flux1_1024"], ranks=2, ns=(1, 2), modes=("gathered", "ring", "overlapped"), size="tiny",
                              device="cpu", warmup=1, iters=2, timeout_s=120, concurrent=True)
    assert report["concurrent"] and report["placement"] == "CPU ranks" and report["backend"] == "gloo"
    assert "records[].measured_step_ms" in report["measured"]
    recs = {r["case"]: r for r in report["records"]}
    assert list(recs) == ["N=1", "seq-gathered N=2", "seq-ring N=2", "seq-overlapped N=2"]
    ref = recs["N=1"]
    assert ref["speedup_measured"] == 1.0 and ref["measured_step_ms"] > 0
    for label in ("seq-gathered N=2", "seq-ring N=2", "seq-overlapped N=2"):
        r = recs[label]
        assert r["status"] == "ok" and r["exactness"]["ok"] and r["exactness"]["rel_l2_vs_n1"] <= 1e-5, label
        mode = label.split("-")[1].split()[0]
        assert set(r["attention_calls_by_mode"]) == {mode}, (label, r["attention_calls_by_mode"])
        walls = r["measured_ms_per_call_iterations"]
        assert len(walls) == 2 and all(w > 0 for w in walls)
        assert r["measured_step_ms"] == pytest.approx(r["calls_per_step"] * statistics.median(walls), rel=1e-3)
        assert r["speedup_measured"] == pytest.approx(ref["measured_step_ms"] / r["measured_step_ms"], abs=1e-3)  # 3 places
        errs = r["model_error_vs_measured"]
        assert set(errs) >= {"nvlink", "pcie4_x16_no_p2p", "measured_collectives"}
        assert errs["nvlink"] == pytest.approx(r["modelled_step_ms"]["nvlink"] / r["measured_step_ms"] - 1, abs=1e-3)
        assert r["modelled_step_ms_measured_collectives"] >= r["compute_ms_per_step_alone"]
    table = db.format_table(report)
    assert "MEASURED with the ranks at once (CPU ranks, gloo)" in table and "seq-ring N=2" in table
    assert os.path.getsize(db.write_chart(report, str(tmp_path / "dit.png"))) > 10_000


def test_placements_that_cannot_give_the_figures_asked_for_are_refused_before_any_rank_starts():
    from patchray.distributed.spawn import run_ranks

    with pytest.raises(ValueError, match="ranks sharing one GPU measures the ranks competing for it"):
        db.run_dit_bench(["flux1_1024"], size="tiny", device="cuda", ranks=2, ns=(1, 2), concurrent=True)
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        db.run_dit_bench(["flux1_1024"], size="tiny", device="cuda", ranks=2, ns=(1, 2), backend="nccl")
    with pytest.raises(ValueError, match="--gpu-per-rank needs --device cuda"):
        db.run_dit_bench(["flux1_1024"], size="tiny", device="cpu", ranks=2, ns=(1, 2), gpu_per_rank=True)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"one GPU per rank needs {visible + 1} GPUs; this machine shows {visible}"):
        run_ranks(print, visible + 1, device="cuda", gpu_per_rank=True)


def test_shared_modulation_sends_each_ranks_share_of_the_adaln_layers_once_per_call():
    """``modulation="whole"`` (every rank computes the blocks' adaLN layers in full) against the default ``shared``:
    both equal N = 1, and the shared run sends exactly the modulation's share more per step. Tiny FLUX.1 (width 32:
    4 heads x 8): one double-stream block (image and text, 6 x 32 features each) and one single-stream block
    (3 x 32); at N = 2 a rank sends its half, 96 + 96 + 48 features, fp32, batch 1, one call per step, to one peer."""
    recs = {}
    for modulation in ("whole", "shared"):
        report = db.run_dit_bench(["flux1_1024"], ranks=2, ns=(1, 2), modes=("gathered",), size="tiny", device="cpu",
                                  warmup=1, iters=1, timeout_s=120, modulation=modulation)
        assert report["modulation"] == modulation
        recs[modulation] = {r["case"]: r for r in report["records"]}["seq-gathered N=2"]
    for modulation, r in recs.items():
        assert r["status"] == "ok" and r["exactness"]["rel_l2_vs_n1"] <= 1e-5, modulation
        assert r["modulation"] == modulation
        assert r["wire_bytes_per_step"] == r["cost_model_wire_bytes_per_step"], modulation
    assert recs["shared"]["wire_bytes_per_step"] - recs["whole"]["wire_bytes_per_step"] == (96 + 96 + 48) * 4
    assert recs["shared"]["collectives_per_step"] == recs["whole"]["collectives_per_step"] + 1
    with pytest.raises(ValueError, match="modulation must be"):
        db.run_dit_bench(["flux1_1024"], size="tiny", device="cpu", ranks=2, ns=(1, 2), modulation="half")
