"""The rig model (``python -m patchray plan-rig``): CPU, no device, a few seconds.

Numbers asserted here are derived in the test from the datasheet figures typed below and from the measurement files
under ``results/h200/dit/`` read directly (with the test's own kernel classification), never taken from the code under
test; the other checks are internal consistency (more ranks, faster links, fp8) and the calibration's regeneration.
"""

import contextlib
import io
import json
import math
import re
import statistics
from pathlib import Path

import pytest

from patchray.distributed.bench import rig_cli
from patchray.distributed.bench.rig_calibration import TABLE_BEGIN, TABLE_END, calibrate, calibration_table
from patchray.distributed.bench.rig_cards import CARDS
from patchray.distributed.bench.rig_compute import H200_BASIS, MODELS
from patchray.distributed.bench.rig_links import RIG_LINKS, effective_link
from patchray.distributed.bench.rig_model import plan
from patchray.distributed.topology.links import LINK_PROFILES

ROOT = Path(__file__).resolve().parents[2]
DIT = ROOT / "results" / "h200" / "dit"

# datasheet figures, typed from the sources rig_cards.py names (dense tensor TFLOP/s, GB/s)
H200_BF16, H200_BW = 989.5, 4800.0
RTX4090_BF16, RTX4090_FP8, RTX4090_BW = 165.2, 330.3, 1008.0
RTX3090_BF16, RTX3090_BW = 71.0, 936.0
PCIE_EFF = 55.3 / 63.0  # pinned copies measured on the H200 host (topology/links.py)


def _load(path):
    return json.loads((DIT / path).read_text())


def _median(xs):
    return statistics.median(xs)


def _parts_from_profile(path):
    """The test's own split of a profiled call: GEMM kernels with wide tiles, fused attention kernels, the rest."""
    d = _load(path)
    gemm = sum(k["ms"] for k in d["top"] if k["class"] == "gemm" and not re.search(r"_\d+x(8|16)_", k["name"])
               and "splitKreduce" not in k["name"])
    att = sum(k["ms"] for k in d["top"] if "sdpa" in k["name"] or "flash_fwd" in k["name"] or "fmha" in k["name"])
    return gemm, att, d["gpu_ms_without_spin"] - gemm - att


def _flux_eager_parts():
    return _parts_from_profile("issue/prof/flux1_1024_N=1_r0.json")


def _rows(doc):
    return {(r["mode"], r.get("attention"), r.get("preset"), r.get("sharding")): r for r in doc["rows"]
            if r.get("s_per_step") is not None}


# ------------------------------------------------------------------------------------------------- the measured basis


def test_basis_is_what_the_h200_files_hold():
    flux = H200_BASIS["flux1"]
    km = {r["case"]: max(r["kernel_ms_per_call_by_rank"]) for r in _load("issue/kernel_model_eager.json")["rows"]}
    assert flux["eager"]["n1_ms"] == km["N=1"]
    assert flux["eager"]["ranks_ms"] == {2: km["seq-gathered N=2"], 4: km["seq-gathered N=4"]}
    kc = {r["case"]: max(r["kernel_ms_per_call_by_rank"])
          for r in _load("modulation/call3/kernel_model_after.json")["rows"]}
    assert flux["compiled"]["n1_ms"] == kc["N=1"]
    assert flux["compiled"]["ranks_ms"] == {2: kc["seq-overlapped N=2"], 4: kc["seq-overlapped N=4"]}
    for kernels, path in (("eager", "issue/prof/flux1_1024_N=1_r0.json"),
                          ("compiled", "modulation/call3/prof_after/flux1_1024_N=1_r0.json")):
        gemm, att, mem = _parts_from_profile(path)
        p = flux[kernels]["parts"]
        assert (p["gemm"], p["attention"], p["memory"]) == pytest.approx((gemm, att, mem), abs=0.01)
    issue = {r["preset"]: _median(r["block_issue_ms"]) for r in _load("issue_time.json")["records"]}
    assert flux["eager"]["issue_ms"] == issue["flux1_1024"]
    assert H200_BASIS["qwen_image"]["eager"]["issue_ms"] == issue["qwen_image_1328"]

    wan = {r["case"]: r for r in _load("dit_wan.json")["records"]}
    w = H200_BASIS["wan21_14b"]["eager"]
    assert w["n1_ms"] == wan["N=1"]["compute_ms_per_call_alone"]
    assert w["ranks_ms"] == {2: wan["seq-ulysses N=2"]["compute_ms_per_call_alone"],
                             4: wan["seq-ulysses N=4"]["compute_ms_per_call_alone"]}
    assert H200_BASIS["wan21_14b"]["peak_gib"] == {1: max(wan["N=1"]["peak_gib_by_rank"]),
                                                   2: max(wan["seq-ulysses N=2"]["peak_gib_by_rank"]),
                                                   4: max(wan["seq-ulysses N=4"]["peak_gib_by_rank"])}
    qwen = {r["case"]: r for r in _load("issue/dit_qwen_issue.json")["records"]}
    q = H200_BASIS["qwen_image"]["eager"]
    assert q["n1_ms"] == qwen["N=1"]["gpu_ms_per_call_alone"]
    assert q["ranks_ms"] == {2: qwen["seq-gathered N=2"]["gpu_ms_per_call_alone"]}
    fl = {r["case"]: r for r in _load("issue/dit_flux_issue.json")["records"]}
    assert H200_BASIS["flux1"]["peak_gib"] == {1: max(fl["N=1"]["peak_gib_by_rank"]),
                                               2: max(fl["seq-gathered N=2"]["peak_gib_by_rank"]),
                                               4: max(fl["seq-gathered N=4"]["peak_gib_by_rank"])}


def test_parameter_counts_are_the_released_configs():
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from patchray.distributed.bench.dit_models import PRESETS

    for key, preset in (("flux1", "flux1_1024"), ("wan21_14b", "wan21_14b_480x832x81"), ("qwen_image", "qwen_image_1328")):
        p = PRESETS[preset]
        with torch.device("meta"):
            m = getattr(diffusers, p.cls)(**p.full)
        blocks = [b for a in ("transformer_blocks", "single_transformer_blocks", "blocks") for b in getattr(m, a, [])]
        count = lambda mod: sum(x.numel() for x in mod.parameters())  # noqa: E731
        assert MODELS[key].params == count(m)
        assert MODELS[key].block_params == sum(count(b) for b in blocks)
        assert MODELS[key].largest_block_params == max(count(b) for b in blocks)


# ------------------------------------------------------------------------------------------------- cards and links


def test_cards_are_dense_datasheet_rows():
    for c in CARDS.values():
        assert c.source and c.bf16_tflops > 0 and c.bandwidth_gbps > 0 and c.memory_gib > 0
        assert c.fp8_tflops is None or math.isclose(c.fp8_tflops, 2 * c.bf16_tflops, rel_tol=0.02)  # L40S prints 733 vs 2 x 362.05
    # the task's list is covered
    for key in ("rtx3090", "rtx4090", "rtx5090", "rtx_a6000", "rtx6000_ada", "rtx_pro6000", "l40s", "a100_40gb",
                "a100_80gb", "h100_pcie", "h100_sxm", "h200"):
        assert key in CARDS
    assert CARDS["rtx4090"].bf16_tflops == RTX4090_BF16 and CARDS["h200"].bandwidth_gbps == H200_BW


def test_links_are_one_table_and_derived_by_hand():
    for name, p in LINK_PROFILES.items():
        assert RIG_LINKS[name] is p  # the runtime's profiles, not copies
    # PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 / 8 bits = 63.0 GB/s (PCI-SIG), x the measured 0.88
    assert RIG_LINKS["pcie5_x16_p2p"].bandwidth_gbps == pytest.approx(63.0 * PCIE_EFF, abs=0.05)
    assert RIG_LINKS["pcie3_x16_no_p2p"].bandwidth_gbps == pytest.approx(15.75 * PCIE_EFF, abs=0.05)
    assert RIG_LINKS["pcie4_x8_p2p"].bandwidth_gbps == pytest.approx(15.75 * PCIE_EFF, abs=0.05)
    assert RIG_LINKS["pcie3_x16_no_p2p"].via_host and not RIG_LINKS["pcie3_x16_p2p"].via_host
    assert RIG_LINKS["25gbe"].bandwidth_gbps == pytest.approx(25 / 8 * 1448 / 1538, abs=0.005)
    assert RIG_LINKS["nvlink_a100"].bandwidth_gbps == pytest.approx(600 / 2 * 0.8, abs=0.05)
    # a card bounds its link
    p, notes = effective_link(CARDS["rtx4090"], "pcie5_x16_p2p", 2)
    assert p.bandwidth_gbps == pytest.approx(31.5 * PCIE_EFF, abs=0.05) and len(notes) == 2
    with pytest.raises(ValueError, match="no nvlink link; valid links for it: .*pcie4_x16_no_p2p"):
        effective_link(CARDS["rtx4090"], "nvlink", 2)
    with pytest.raises(ValueError, match="bridge joins two cards"):
        effective_link(CARDS["rtx3090"], "nvlink_bridge_ampere", 4)


# ------------------------------------------------------------------------------------------------- figures by hand


def test_one_card_compute_by_hand():
    gemm, att, mem = _flux_eager_parts()
    by_hand = gemm * H200_BF16 / RTX4090_BF16 + att * H200_BF16 / RTX4090_BF16 + mem * H200_BW / RTX4090_BW
    d = plan("rtx4090", 1, "pcie4_x16_no_p2p", "flux1", 1024, 1024)
    assert d["compute"]["card_call_gpu_ms"] == pytest.approx(by_hand, abs=0.01)
    assert d["one_card"]["s_per_step"] == pytest.approx(by_hand / 1e3, abs=1e-4)  # above the CPU's 141 ms
    # fp8 GEMMs on the card's FP8 tensor cores: the GEMM part at the fp8 rate, the rest unchanged
    d8 = plan("rtx4090", 1, "pcie4_x16_no_p2p", "flux1", 1024, 1024, weights="fp8")
    assert d8["compute"]["card_call_gpu_ms"] == pytest.approx(
        gemm * H200_BF16 / RTX4090_FP8 + att * H200_BF16 / RTX4090_BF16 + mem * H200_BW / RTX4090_BW, abs=0.01)
    # an RTX 3090 has no FP8 tensor cores: bf16 GEMMs, plus the cast of 11.9 B fp8 weights (3 bytes each) per call
    d3 = plan("rtx3090", 1, "pcie4_x16_no_p2p", "flux1", 1024, 1024, weights="fp8")
    cast = 3 * 11901408320 / (RTX3090_BW * 1e9) * 1e3
    assert d3["compute"]["card_call_gpu_ms"] == pytest.approx(
        (gemm + att) * H200_BF16 / RTX3090_BF16 + mem * H200_BW / RTX3090_BW + cast, abs=0.01)


def test_sequence_row_by_hand():
    """2 x RTX 4090, PCIe 4.0 x16 without P2P, FLUX.1 1024x1024, gathered attention."""
    gemm, att, mem = _flux_eager_parts()
    whole = (gemm + att) * H200_BF16 / RTX4090_BF16 + mem * H200_BW / RTX4090_BW
    km = {r["case"]: max(r["kernel_ms_per_call_by_rank"]) for r in _load("issue/kernel_model_eager.json")["rows"]}
    # 4,096 image + 512 text tokens; at N = 2 the busiest rank has 32 of 64 token rows and 256 of the text: share 1/2
    overhead = km["seq-gathered N=2"] / (km["N=1"] * 0.5)
    rank = whole * 0.5 * overhead
    # per call: 57 K/V all-gathers of 2 x 2304 tokens x 24 heads x 128 x 2 bytes to the one peer, the output (2048
    # tokens x 64 features x 2 bytes) and the modulation shares (half of every adaLN layer's features, 2 bytes)
    kv = 57 * 2 * 2304 * 24 * 128 * 2
    out = 2048 * 64 * 2
    mod = (38 * 18432 + 38 * 9216) // 2 * 2
    bandwidth = round(31.5 * PCIE_EFF, 1)  # PCIe 4.0 x16: 27.6 GB/s, staged through host memory: counted twice
    link = 2 * (kv + out + mod) / (bandwidth * 1e9) * 1e3 + (57 + 2) * 0.020
    d = plan("rtx4090", 2, "pcie4_x16_no_p2p", "flux1", 1024, 1024)
    row = _rows(d)[("sequence", "gathered", None, "none")]
    assert row["s_per_step"] == pytest.approx((rank + link) / 1e3, abs=2e-4)
    assert row["comm"]["wire_gb_per_call"] == pytest.approx((kv + out + mod) / 1e9, abs=1e-4)
    # overlapped: the gather hides behind the rank's attention to its own keys (half its attention at N = 2)
    hidden = att * H200_BF16 / RTX4090_BF16 * 0.5 * overhead / 2
    row = _rows(d)[("sequence", "overlapped", None, "none")]
    kv_ms = 2 * kv / (bandwidth * 1e9) * 1e3 + 57 * 0.020
    assert row["s_per_step"] == pytest.approx((rank + link - min(hidden, kv_ms)) / 1e3, abs=2e-4)


def test_eager_calls_wait_for_the_cpu():
    """4 x H100 SXM on NVLink, FLUX.1 eager: a rank's GPU time is below the 141 ms the H200 host's CPU needs to issue
    a call, so a step takes the issue time (what xDiT's eager figures show: 4.38 s and 4.24 s for 2 and 4 GPUs)."""
    issue = _median(next(r for r in _load("issue_time.json")["records"] if r["preset"] == "flux1_1024")["block_issue_ms"])
    d = plan("h100_sxm", 4, "nvlink", "flux1", 1024, 1024)
    for att in ("gathered", "ulysses", "ring", "overlapped"):
        assert _rows(d)[("sequence", att, None, "none")]["s_per_step"] == pytest.approx(issue / 1e3, abs=1e-4)
    compiled = plan("h100_sxm", 4, "nvlink", "flux1", 1024, 1024, kernels="compiled")
    assert all(r["s_per_step"] < issue / 1e3 for k, r in _rows(compiled).items()
               if k[0] == "sequence" and k[2] is None and k[3] == "none")


def test_cfg_split_by_hand():
    """2 x RTX 4090, Wan 2.1 14B 480x832x81: each rank one whole call per step, then one output (21 x 30 x 52 tokens x
    64 features x 2 bytes) to its peer through host memory."""
    d = plan("rtx4090", 2, "pcie4_x16_no_p2p", "wan21_14b", 480, 832, 81)
    one = d["one_card"]
    row = _rows(d)[("cfg", None, None, "none")]
    exchange = 2 * (21 * 30 * 52 * 64 * 2) / (27.6e9) * 1e3 + 0.020
    assert row["s_per_step"] == pytest.approx(one["call_ms"] / 1e3 + exchange / 1e3, abs=1e-4)
    assert one["s_per_step"] == pytest.approx(2 * one["call_ms"] / 1e3, abs=1e-4)


# ------------------------------------------------------------------------------------------------- consistency


@pytest.mark.parametrize("model,size", [("flux1", (1024, 1024, 1)), ("wan21_14b", (480, 832, 81)),
                                        ("qwen_image", (1328, 1328, 1))])
def test_more_ranks_never_increase_weight_memory_under_blocks(model, size):
    last = {}
    for n in range(2, 9):
        rows = _rows(plan("rtx5090", n, "pcie5_x16_no_p2p", model, *size))
        for sh in ("blocks", "blocks+offload"):
            r = next(v for k, v in rows.items() if k[0] == "sequence" and k[3] == sh)
            w = r["memory"]["weights_gib"]
            assert w <= last.get(sh, math.inf) + 1e-9
            last[sh] = w
    for n in (2, 4, 8):  # and the whole rank's memory falls with the powers of two
        r = next(v for k, v in _rows(plan("rtx5090", n, "pcie5_x16_no_p2p", model, *size)).items() if k[3] == "blocks")
        assert r["memory"]["total_gib"] <= last.get(("total", model), math.inf)
        last[("total", model)] = r["memory"]["total_gib"]


@pytest.mark.parametrize("card,n,model,size,slow,fast", [
    ("rtx4090", 2, "flux1", (1024, 1024, 1), "pcie4_x16_no_p2p", "pcie4_x16_p2p"),
    ("rtx4090", 4, "wan21_14b", (480, 832, 81), "pcie3_x16_no_p2p", "pcie4_x16_no_p2p"),
    ("rtx5090", 8, "qwen_image", (1328, 1328, 1), "10gbe", "25gbe"),
    ("rtx5090", 2, "flux1", (1024, 1024, 1), "25gbe", "100gbe"),
    ("h100_sxm", 4, "flux1", (1024, 1024, 1), "pcie5_x16_p2p", "nvlink"),
    ("rtx3090", 2, "wan21_14b", (480, 832, 81), "pcie4_x16_p2p", "nvlink_bridge_ampere"),
    ("l40s", 4, "wan21_14b", (720, 1280, 81), "pcie4_x8_no_p2p", "pcie4_x16_no_p2p"),
])
def test_a_faster_link_never_slows_a_mode(card, n, model, size, slow, fast):
    a = _rows(plan(card, n, slow, model, *size))
    b = _rows(plan(card, n, fast, model, *size))
    common = set(a) & set(b)
    assert len(common) >= 8
    for key in common:
        assert b[key]["s_per_step"] <= a[key]["s_per_step"] + 1e-9, key


def test_fp8_halves_weight_bytes():
    for model, size in (("flux1", (1024, 1024, 1)), ("wan22_a14b", (480, 832, 81)), ("qwen_image", (1328, 1328, 1))):
        bf = plan("rtx4090", 4, "pcie4_x16_no_p2p", model, *size)
        f8 = plan("rtx4090", 4, "pcie4_x16_no_p2p", model, *size, weights="fp8")
        fs = plan("rtx4090", 4, "pcie4_x16_no_p2p", model, *size, weights="fp8-storage")
        assert f8["model"]["weights_gib"] == pytest.approx(bf["model"]["weights_gib"] / 2, abs=0.01)
        assert fs["model"]["weights_gib"] == f8["model"]["weights_gib"]
        for key, r in _rows(bf).items():
            assert _rows(f8)[key]["memory"]["weights_gib"] == pytest.approx(r["memory"]["weights_gib"] / 2, abs=0.01)
        # the bytes moved by blocks sharding halve too
        blk = lambda d: next(v for k, v in _rows(d).items() if k[3] == "blocks")["comm"]  # noqa: E731
        assert blk(f8)["weight_gather_gb_per_call"] == pytest.approx(blk(bf)["weight_gather_gb_per_call"] / 2, abs=0.002)


def test_every_figure_is_labelled_modelled():
    d = plan("rtx5090", 4, "pcie5_x16_no_p2p", "wan22_a14b", 480, 832, 81, steps=20)
    assert d["MODELLED"] is True
    for r in [d["one_card"]] + d["rows"]:
        assert r["label"] == "MODELLED"
        if r.get("s_per_step") is not None:
            assert r["from"]
            assert r["total_s"] == pytest.approx(r["s_per_step"] * 20, abs=0.02)
    modes = {(r["mode"], r.get("preset"), r.get("sharding")) for r in d["rows"]}
    for want in [("sequence", None, "none"), ("cfg+sequence", None, "none"), ("batch", None, "none"),
                 ("sequence", "displaced", "none"), ("sequence", "compressed", "none"),
                 ("sequence", "compressed_2bit", "none"), ("sequence", "compressed_1bit", "none"),
                 ("sequence", None, "blocks"), ("sequence", None, "blocks+offload")]:
        assert want in modes
    assert {r.get("attention") for r in d["rows"] if r["mode"] == "sequence" and not r.get("preset")} >= {
        "gathered", "overlapped", "ring", "ulysses"}


# ------------------------------------------------------------------------------------------------- the command


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = rig_cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


BASE = ["--card", "rtx4090", "--ranks", "2", "--link", "pcie4_x16_no_p2p", "--model", "flux1", "--height", "1024",
        "--width", "1024"]


def test_command_json_and_text():
    rc, out, _ = _run(BASE + ["--json"])
    assert rc == 0
    doc = json.loads(out)
    assert doc["MODELLED"] and doc["card"]["key"] == "rtx4090" and doc["rows"]
    rc, out, _ = _run(BASE)
    assert rc == 0 and "MODELLED" in out and "overlapped" in out
    rc, out, _ = _run(["--list"])
    assert rc == 0 and "rtx_pro6000" in out and "pcie5_x16_no_p2p" in out and "wan22_a14b" in out
    from patchray.distributed.cli import COMMANDS

    assert COMMANDS["plan-rig"][:2] == ("patchray.distributed.bench.rig_cli", "main")


@pytest.mark.parametrize("flag,value,names", [
    ("--card", "rtx4080", "valid cards: rtx3090, rtx4090"),
    ("--link", "pcie6_x16", "valid links: nvlink, pcie4_x16_p2p"),
    ("--model", "sd3", "valid models: flux1, wan21_14b, wan22_a14b, qwen_image"),
    ("--weights", "int4", "valid: bf16, fp8, fp8-storage"),
    ("--link", "nvlink", "valid links for it: "),
    ("--height", "1000", "multiples of 16"),
])
def test_bad_arguments_name_the_valid_choices(flag, value, names):
    argv = list(BASE)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    rc, _, err = _run(argv)
    assert rc == 2 and names in err, err


def test_missing_arguments_are_named():
    rc, _, err = _run(["--card", "rtx4090"])
    assert rc == 2 and "--ranks" in err and "--model" in err


# ------------------------------------------------------------------------------------------------- the calibration


def test_calibration_json_is_what_the_command_computes_now():
    committed = json.loads((ROOT / "results" / "rig-model" / "calibration.json").read_text())
    now = calibrate()
    assert [e["id"] for e in now["entries"]] == [e["id"] for e in committed["entries"]]
    for a, b in zip(now["entries"], committed["entries"]):
        assert (a["published"], a["modelled"], a["error"]) == (b["published"], b["modelled"], b["error"]), a["id"]
        assert a["error"] == round(a["modelled"] / a["published"] - 1, 3)
    assert now["summary"] == committed["summary"]
    assert now["compute_scaling_rule"] == committed["compute_scaling_rule"]
    # the two published points the task names are in it
    ids = {e["id"]: e for e in now["entries"]}
    assert ids["pasa_5090_x1"]["published"] == 134.0 and ids["pasa_5090_x8"]["published"] == 41.0
    assert ids["comfy_cfg_4090_x2"]["published"] == 2.0


def test_doc_and_readme_tables_match_the_json():
    committed = json.loads((ROOT / "results" / "rig-model" / "calibration.json").read_text())
    table = calibration_table(committed)
    doc = (ROOT / "docs" / "rig-model.md").read_text()
    block = doc.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip()
    assert block == table.strip()
    assert table in (ROOT / "results" / "rig-model" / "README.md").read_text()


def test_shapes_are_the_cost_models_at_the_measured_sizes():
    from patchray.distributed.bench.rig_compute import model_shape
    from patchray.distributed.sampling.dit_traffic import FULL_SIZE_SHAPES

    for key, full in (("flux1", "flux1_1024"), ("wan21_14b", "wan21_14b_480x832x81"), ("qwen_image", "qwen_image_1328")):
        assert model_shape(MODELS[key], *MODELS[key].base) == FULL_SIZE_SHAPES[full]
