"""Calibration of the rig model against published measurements of real multi-GPU rigs.

``python -m patchray plan-rig --calibrate --out results/rig-model/calibration.json --doc docs/rig-model.md``

Design decisions:

* **Predict, do not fit.** Every published figure is compared with what :func:`.rig_model.plan` gives for the same
  configuration (card, ranks, link, model, size, steps, weights, kernels, mode) with nothing tuned to it; the error is
  ``modelled / published - 1``. The model's constants come from the H200 measurements and datasheets only.
* **Like for like.** A published wall time of a whole generation is compared with the modelled steps plus the VAE
  decode on one card (text encoders, model loading and the scheduler are left out, and said so); a published s/it with
  the modelled s/step; a published speed-up with the modelled ratio of the same two configurations.
* **Where a configuration is not PatchRay's,** the nearest PatchRay mode stands in and the entry says which (xDiT's and
  ParaAttention's Ulysses and ring are PatchRay's ``ulysses`` and ``ring``; Wan 2.2's FSDP is ``sharding=blocks``;
  ComfyUI's CFG split is ``cfg``); hybrid meshes (Ulysses x ring on 4 GPUs) and PipeFusion are left out.
* **A sanity column**: the dense tensor throughput each published time implies per card (the transformer's FLOPs,
  :func:`.rig_compute.call_flops`, over the published seconds and the cards), as a fraction of the card's datasheet
  peak. Above 1 the published time cannot be what its configuration says.
* The table in ``results/rig-model/README.md`` and ``docs/rig-model.md`` is generated from the JSON
  (:func:`calibration_table`); the CI test regenerates the JSON's figures and compares.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Dict, List, Optional

from .rig_cards import get_card
from .rig_compute import call_flops, gemm_tflops, get_model, model_shape, describe_rule
from .rig_model import plan

__all__ = ["PUBLISHED", "calibrate", "calibration_table", "write_readme", "update_doc", "TABLE_BEGIN", "TABLE_END"]

_XDIT = ("xDiT docs/performance/flux.md (xdit-project/xDiT): FLUX.1-dev, 28 steps, 1024px, 4 x H100 (NVLink), "
         "latency in seconds")
_PARA = ("ParaAttention README (chengzeyi/ParaAttention), 'Context Parallelism (without First Block Cache)': FLUX.1-dev "
         "on A100-SXM4-80GB, wall time in seconds (its note: wall time includes the text encoder and the VAE decoder)")
_PASA = ("PASA-lab 5090 benchmarking, WAN2.2_14B_Performance_Benchmarks.md (dannywillowliu-uchi/PASA-lab-5090-"
         "Benchmarking, Sept 2025): Wan 2.2 T2V-A14B, 480x832, 81 frames (the default), 20 steps, bf16; generation time "
         "from the log's 'Generating video' to 'Saving generated video' (text encoding and VAE decode included); "
         "interconnect PCIe (NCCL over SHM); the file's versions differ: commit 0a71e30 reports 134 s and 41 s (used "
         "here), another 134 s and 42 s")
_RAYLIGHT = ("raylight README, '5090 vs RTX 2000 ADA' (komikndr/raylight): s/it, average of 5 runs after warm-up, 2 x RTX 2000 Ada with P2P over the "
             "SYS path (cross-socket), no NVLink, fp8 weights")
_COMFY = "ComfyUI PR #7063 (MultiGPU Work Units / CFG split), comments"


def _e(id_, source, config, select, published, measure, note="", ratio_of=None):
    return {"id": id_, "source": source, "config": config, "select": select, "published": published,
            "measure": measure, "note": note, "ratio_of": ratio_of}


def _flux(card, ranks, link, kernels):
    return dict(card=card, ranks=ranks, link=link, model="flux1", height=1024, width=1024, frames=1, steps=28,
                weights="bf16", kernels=kernels)


#: the published measurements: ``measure`` is ``total_s`` (steps + the VAE decode on one card), ``s_per_step``, or
#: ``speedup`` (``ratio_of``: the published and modelled ratio of two entries' figures; else the row's own speed-up)
PUBLISHED: List[dict] = [
    # (a) PASA-lab, 8 x RTX 5090 on PCIe
    _e("pasa_5090_x1", _PASA,
       dict(card="rtx5090", ranks=1, link="pcie5_x16_no_p2p", model="wan22_a14b", height=480, width=832, frames=81,
            steps=20, weights="bf16", kernels="eager"),
       {"mode": "one card"}, 134.0, "total_s",
       "one card with Wan 2.2's --offload_model (the idle expert parked in host memory; one expert fits 32 GB)"),
    _e("pasa_5090_x8", _PASA,
       dict(card="rtx5090", ranks=8, link="pcie5_x16_no_p2p", model="wan22_a14b", height=480, width=832, frames=81,
            steps=20, weights="bf16", kernels="eager", attention="ulysses"),
       {"mode": "sequence", "attention": "ulysses", "sharding": "blocks"}, 41.0, "total_s",
       "--dit_fsdp --t5_fsdp --ulysses_size 8: PatchRay's sequence/ulysses with sharding=blocks stands in"),
    _e("pasa_5090_speedup", _PASA, None, None, 134.0 / 41.0, "speedup", "8 cards over one",
       ratio_of=("pasa_5090_x1", "pasa_5090_x8")),
    # (b) ComfyUI's CFG split, 2 x RTX 4090
    _e("comfy_cfg_4090_x2", _COMFY + ": 2 x RTX 4090, Wan 2.1 I2V 720p, bf16: 'essentially 2x'",
       dict(card="rtx4090", ranks=2, link="pcie4_x16_no_p2p", model="wan21_14b", height=720, width=1280, frames=81,
            steps=20, weights="bf16", kernels="eager"),
       {"mode": "cfg"}, 2.0, "speedup",
       "ComfyUI's CFG split = PatchRay's cfg; 81 frames and 20 steps assumed (the speed-up does not depend on them); "
       "the bf16 weights do not fit 24 GB: both sides stream the excess from host memory"),
    _e("comfy_cfg_b580_x2", _COMFY + " (bedovyy, 2025-03-18): 2 x Arc B580, Wan 2.1 I2V 480P, fp8_e5m2, 15.44 -> "
       "8.39 s/it",
       dict(card="arc_b580", ranks=2, link="pcie4_x8_no_p2p", model="wan21_14b", height=512, width=512, frames=33,
            steps=20, weights="fp8-storage", kernels="eager"),
       {"mode": "cfg"}, 15.44 / 8.39, "speedup",
       "size assumed (ComfyUI's I2V example, 512x512x33); Intel XMX through IPEX, not CUDA kernels"),
    # xDiT, 4 x H100 (NVLink), FLUX.1-dev
] + [
    _e(f"xdit_h100_{kern}_{label}", _XDIT, _flux("h100_sxm", ranks, "nvlink", kern), select, value, "total_s",
       ("PyTorch (eager) column, " if kern == "eager" else "torch.compile column, ")
       + ("one GPU" if label == "1gpu" else label.replace("u", "Ulysses-").replace("r", "Ring-")))
    for kern, figures in (("eager", {"1gpu": 6.71, "u2": 4.38, "r2": 5.31, "u4": 4.24, "r4": 5.11}),
                          ("compiled", {"1gpu": 4.30, "u2": 2.68, "r2": 2.60, "u4": 1.63, "r4": 1.98}))
    for label, value in figures.items()
    for ranks, select in [({"1gpu": 1, "u2": 2, "r2": 2, "u4": 4, "r4": 4}[label],
                           {"mode": "one card"} if label == "1gpu" else
                           {"mode": "sequence", "attention": "ulysses" if label[0] == "u" else "ring", "sharding": "none"})]
] + [
    _e(f"xdit_h100_{kern}_{label}_speedup", _XDIT, None, None, None, "speedup", f"{label} over one GPU",
       ratio_of=(f"xdit_h100_{kern}_1gpu", f"xdit_h100_{kern}_{label}"))
    for kern in ("eager", "compiled") for label in ("u2", "r2", "u4", "r4")
] + [
    # ParaAttention, A100-SXM4-80GB (NVLink 3), FLUX.1-dev
    _e("para_a100_eager_1gpu", _PARA, _flux("a100_80gb", 1, "nvlink_a100", "eager"), {"mode": "one card"}, 13.843,
       "total_s", "Baseline (diffusers, eager)"),
    _e("para_a100_compiled_1gpu", _PARA, _flux("a100_80gb", 1, "nvlink_a100", "compiled"), {"mode": "one card"}, 9.997,
       "total_s", "torch.compile"),
    _e("para_a100_eager_r2", _PARA, _flux("a100_80gb", 2, "nvlink_a100", "eager"),
       {"mode": "sequence", "attention": "ring", "sharding": "none"}, 8.307, "total_s", "para-attn (ring), 2 GPUs"),
    _e("para_a100_compiled_r2", _PARA, _flux("a100_80gb", 2, "nvlink_a100", "compiled"),
       {"mode": "sequence", "attention": "ring", "sharding": "none"}, 5.775, "total_s",
       "para-attn (ring) + torch.compile, 2 GPUs"),
    _e("para_a100_eager_r2_speedup", _PARA, None, None, None, "speedup", "ring-2 over one GPU, eager",
       ratio_of=("para_a100_eager_1gpu", "para_a100_eager_r2")),
    _e("para_a100_compiled_r2_speedup", _PARA, None, None, None, "speedup", "ring-2 over one GPU, compiled",
       ratio_of=("para_a100_compiled_1gpu", "para_a100_compiled_r2")),
    # raylight, 2 x RTX 2000 Ada
    _e("raylight_2000ada_flux_x1", _RAYLIGHT,
       dict(card="rtx2000_ada", ranks=1, link="pcie4_x8_p2p", model="flux1", height=1024, width=1024, frames=1, steps=28,
            weights="fp8-storage", kernels="eager"), {"mode": "one card"}, 2.22, "s_per_step",
       "Flux fp8 1024^2, one card; fp8 weights upcast per layer (ComfyUI's default)"),
    _e("raylight_2000ada_flux_u2", _RAYLIGHT,
       dict(card="rtx2000_ada", ranks=2, link="pcie4_x8_p2p", model="flux1", height=1024, width=1024, frames=1, steps=28,
            weights="fp8-storage", kernels="eager"),
       {"mode": "sequence", "attention": "ulysses", "sharding": "none"}, 1.26, "s_per_step", "Ulysses=2"),
    _e("raylight_2000ada_flux_speedup", _RAYLIGHT, None, None, None, "speedup", "Ulysses=2 over one card",
       ratio_of=("raylight_2000ada_flux_x1", "raylight_2000ada_flux_u2")),
    _e("raylight_2000ada_wan_x1", _RAYLIGHT,
       dict(card="rtx2000_ada", ranks=1, link="pcie4_x8_p2p", model="wan21_14b", height=480, width=480, frames=33,
            steps=20, weights="fp8-storage", kernels="eager", calls_per_step=1), {"mode": "one card"}, 9.23, "s_per_step",
       "Wan2.1 14B fp8 480x480x33, one card; the calls per step are not stated: with two (CFG) the published s/it would "
       "need 1.14x the card's dense peak, so one is modelled (CFG 1, as the raylight README says its Wan + LoRA runs use)"),
    _e("raylight_2000ada_wan_u2", _RAYLIGHT,
       dict(card="rtx2000_ada", ranks=2, link="pcie4_x8_p2p", model="wan21_14b", height=480, width=480, frames=33,
            steps=20, weights="fp8-storage", kernels="eager", calls_per_step=1),
       {"mode": "sequence", "attention": "ulysses", "sharding": "none"}, 5.18, "s_per_step", "Ulysses=2, one call per step"),
    _e("raylight_2000ada_wan_speedup", _RAYLIGHT, None, None, None, "speedup", "Ulysses=2 over one card",
       ratio_of=("raylight_2000ada_wan_x1", "raylight_2000ada_wan_u2")),
]


_SHARD = ("results/h200/sharding/README.md (PatchRay's tools/dev/shard_memory.py on one H200, ranks sharing it under gloo; "
          "torch.cuda.max_memory_allocated per rank, bf16; the forward ran 2 blocks per stack, whose transient is any "
          "block's)")
_PASA_MEM = ("PASA-lab 5090 benchmarking (as above): peak GPU memory sampled with nvidia-smi every 0.5 s, in GB of "
             "1000 MiB (32.6 GB = the card's 32,607 MiB); converted to GiB here")


def _mem(id_, source, card, ranks, model, size, select, value, measure, note, attention="gathered"):
    h, w, f = size
    return _e(id_, source, dict(card=card, ranks=ranks, link="pcie4_x16_no_p2p" if card == "h200" else "pcie5_x16_no_p2p",
                                model=model, height=h, width=w, frames=f, steps=20, weights="bf16", kernels="eager",
                                attention=attention), select, value, measure, note)


#: per-rank memory measurements: ``memory_allocated_gib`` (torch's peak allocated: the model's total less the 1 GiB
#: context) or ``memory_nvidia_smi_gib`` (the whole card's use: the model's total). The activation term of the model is
#: the H200's measured transient (in-sample for the dit_bench peaks, so those are not listed) and its 3 blocks in
#: flight were chosen with the sharding bench's figures in view: the first six rows are in-sample.
MEMORY: List[dict] = [
    _mem("mem_h200_wan_n2_blocks", _SHARD, "h200", 2, "wan21_14b", (480, 832, 81),
         {"mode": "sequence", "sharding": "blocks"}, 19.05, "memory_allocated_gib", "in-sample"),
    _mem("mem_h200_wan_n4_blocks", _SHARD, "h200", 4, "wan21_14b", (480, 832, 81),
         {"mode": "sequence", "sharding": "blocks"}, 11.68, "memory_allocated_gib", "in-sample (ranks 2-3, clean)"),
    _mem("mem_h200_flux_n2_blocks", _SHARD, "h200", 2, "flux1", (1024, 1024, 1),
         {"mode": "sequence", "sharding": "blocks"}, 14.28, "memory_allocated_gib", "in-sample (clean second call)"),
    _mem("mem_h200_flux_n2_none", _SHARD, "h200", 2, "flux1", (1024, 1024, 1),
         {"mode": "sequence", "attention": "gathered", "sharding": "none"}, 22.50, "memory_allocated_gib", "in-sample"),
    _mem("mem_h200_flux_n2_offload", _SHARD, "h200", 2, "flux1", (1024, 1024, 1),
         {"mode": "sequence", "sharding": "blocks+offload"}, 3.28, "memory_allocated_gib", "in-sample"),
    _mem("mem_h200_wan_n2_offload", _SHARD, "h200", 2, "wan21_14b", (480, 832, 81),
         {"mode": "sequence", "sharding": "blocks+offload"}, 5.61, "memory_allocated_gib", "in-sample"),
    _mem("mem_pasa_5090_x1", _PASA_MEM, "rtx5090", 1, "wan22_a14b", (480, 832, 81), {"mode": "one card"},
         round(32.6 * 1000 / 1024, 2), "memory_nvidia_smi_gib", "one card, peak (the whole card: ran at its limit)"),
    _mem("mem_pasa_5090_x8", _PASA_MEM, "rtx5090", 8, "wan22_a14b", (480, 832, 81),
         {"mode": "sequence", "sharding": "blocks"}, round(4.2 * 1000 / 1024, 2), "memory_nvidia_smi_gib",
         "8 cards, FSDP + Ulysses-8, per-card peak (~4.0-4.2 GB)", attention="ulysses"),
]


def _select(doc: dict, select: dict) -> dict:
    rows = [doc["one_card"]] + doc["rows"]
    for r in rows:
        if all(r.get(k) == v for k, v in select.items()) and r.get("preset") is None and r.get("s_per_step") is not None:
            return r
    raise LookupError(f"no row {select} in the plan")


def _figure(doc: dict, row: dict, measure: str) -> float:
    if measure == "memory_allocated_gib":
        return row["memory"]["total_gib"] - row["memory"]["context_gib"]
    if measure == "memory_nvidia_smi_gib":
        return row["memory"]["total_gib"]
    if measure == "total_s":
        return row["total_s"] + doc["vae_decode_s_one_card"]
    if measure == "s_per_step":
        return row["s_per_step"]
    return row["speedup"]


def _implied(c: dict, measure: str, seconds: float) -> Optional[float]:
    """The fraction of the card's dense GEMM peak a time implies (the transformer's FLOPs over the time and the cards;
    a whole run's time also holds the VAE decode and text encoding, so this is a lower bound there)."""
    if measure not in ("total_s", "s_per_step"):
        return None
    model = get_model(c["model"])
    shape = model_shape(model, c["height"], c["width"], c["frames"])
    lin, att = call_flops(model, shape)
    steps = c["steps"] if measure == "total_s" else 1
    flops = (lin + att) * (c.get("calls_per_step") or model.calls_per_step) * steps
    card = get_card(c["card"])
    return flops / (seconds * c["ranks"]) / (gemm_tflops(card, c["weights"]) * 1e12)


def calibrate() -> dict:
    """Every :data:`PUBLISHED` entry with the model's figure for it and the error (``modelled / published - 1``)."""
    by_id: Dict[str, dict] = {}
    out = []
    for e in PUBLISHED + MEMORY:
        rec = {k: e[k] for k in ("id", "source", "measure", "note")}
        if e["ratio_of"]:
            a, b = (by_id[i] for i in e["ratio_of"])
            rec["published"] = round(a["published"] / b["published"], 3)
            rec["modelled"] = round(a["modelled"] / b["modelled"], 3)
            rec["config"] = {"ratio_of": list(e["ratio_of"])}
        else:
            cfg = dict(e["config"])
            doc = plan(**cfg)
            row = _select(doc, e["select"])
            rec["config"] = cfg
            rec["row"] = {k: row.get(k) for k in ("mode", "attention", "sharding", "ranks")}
            rec["published"] = e["published"]
            rec["modelled"] = round(_figure(doc, row, e["measure"]), 3)
            if e["measure"] == "total_s":
                rec["modelled_parts"] = {"steps_s": row["total_s"], "vae_decode_s": doc["vae_decode_s_one_card"]}
            implied = _implied(cfg, e["measure"], e["published"])
            if implied is not None:
                rec["published_implies_fraction_of_dense_peak"] = round(implied, 3)
                rec["modelled_implies_fraction_of_dense_peak"] = round(_implied(cfg, e["measure"], rec["modelled"]), 3)
            rec["fits"] = row["memory"]["fits"]
        rec["error"] = round(rec["modelled"] / rec["published"] - 1, 3)
        by_id[e["id"]] = rec
        out.append(rec)
    times = [r for r in out if r["measure"] in ("total_s", "s_per_step")]
    absolute = [abs(r["error"]) for r in times]
    speed = [abs(r["error"]) for r in out if r["measure"] == "speedup"]
    dc = [abs(r["error"]) for r in times if r["config"]["card"] in ("h100_sxm", "a100_80gb")]
    consumer = [abs(r["error"]) for r in times if r["config"]["card"] not in ("h100_sxm", "a100_80gb")]
    memory = [abs(r["error"]) for r in out if r["measure"].startswith("memory")]
    return {
        "MODELLED": True,
        "command": "python -m patchray plan-rig --calibrate --out results/rig-model/calibration.json --doc docs/rig-model.md",
        "error_definition": "modelled / published - 1 (positive: the model is slower than the published rig)",
        "compute_scaling_rule": describe_rule(),
        "like_for_like": ("total_s: modelled steps + the VAE decode on one card (text encoders, loading, scheduler left "
                          "out); s_per_step: one sampling step; speedup: the ratio of two configurations' figures "
                          "(published and modelled alike), or the row's modelled speed-up over one card"),
        "summary": {
            "median_abs_error_absolute_times": round(statistics.median(absolute), 3),
            "median_abs_error_absolute_times_h100_a100": round(statistics.median(dc), 3) if dc else None,
            "median_abs_error_absolute_times_other_cards": round(statistics.median(consumer), 3) if consumer else None,
            "median_abs_error_speedups": round(statistics.median(speed), 3),
            "median_abs_error_memory": round(statistics.median(memory), 3),
            "entries": len(out),
        },
        "entries": out,
    }


TABLE_BEGIN = "<!-- calibration-table:begin (generated by plan-rig --calibrate from results/rig-model/calibration.json) -->"
TABLE_END = "<!-- calibration-table:end -->"


def _fmt(x: float, measure: str) -> str:
    return f"{x:.2f}x" if measure == "speedup" else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def calibration_table(cal: dict) -> str:
    """The calibration table (markdown) from a :func:`calibrate` document."""
    unit = {"total_s": "s (whole run)", "s_per_step": "s/step", "speedup": "speed-up",
            "memory_allocated_gib": "GiB/rank (allocated)", "memory_nvidia_smi_gib": "GiB/card (nvidia-smi)"}
    lines = ["| id | configuration | measure | published | MODELLED | error | dense peak implied: published / MODELLED |",
             "|---|---|---|---|---|---|---|"]
    for r in cal["entries"]:
        c = r["config"]
        if "ratio_of" in c:
            what = f"{c['ratio_of'][0]} / {c['ratio_of'][1]}"
        elif r["measure"] == "speedup":
            what = (f"{c['ranks']} x {c['card']}, {c['link']}, {c['model']} {c['height']}x{c['width']}"
                    + (f"x{c['frames']}" if c["frames"] > 1 else "") + f", {c['weights']}, {r['row']['mode']} vs one card")
        else:
            row = r["row"]
            mode = row["mode"] + (f" / {row['attention']}" if row.get("attention") else "") + (
                f" / {row['sharding']}" if row.get("sharding") not in (None, "none") else "")
            what = (f"{c['ranks']} x {c['card']}, {c['link'] if c['ranks'] > 1 else 'one card'}, {c['model']} "
                    f"{c['height']}x{c['width']}" + (f"x{c['frames']}" if c["frames"] > 1 else "")
                    + f", {c['steps']} steps, {c['weights']}, {c['kernels']}, {mode}")
        implied = r.get("published_implies_fraction_of_dense_peak")
        implied = "-" if implied is None else f"{implied:.2f} / {r['modelled_implies_fraction_of_dense_peak']:.2f}"
        lines.append(f"| {r['id']} | {what} | {unit[r['measure']]} | {_fmt(r['published'], r['measure'])} | "
                     f"{_fmt(r['modelled'], r['measure'])} | {r['error'] * 100:+.1f}% | {implied} |")
    s = cal["summary"]
    lines.append("")
    lines.append(f"Median absolute error: whole-run and per-step times {s['median_abs_error_absolute_times'] * 100:.1f}% "
                 f"(H100/A100 {s['median_abs_error_absolute_times_h100_a100'] * 100:.1f}%, other cards "
                 f"{s['median_abs_error_absolute_times_other_cards'] * 100:.1f}%); speed-ups "
                 f"{s['median_abs_error_speedups'] * 100:.1f}%; memory per rank {s['median_abs_error_memory'] * 100:.1f}% "
                 f"({s['entries']} entries).")
    return "\n".join(lines)


def write_readme(cal: dict, path: str) -> None:
    """``results/rig-model/README.md``: what the file holds, the command, the rule, the table, the sources."""
    sources = []
    for r in cal["entries"]:
        if r["source"] not in sources:
            sources.append(r["source"])
    text = f"""# The rig model's calibration (MODELLED against published measurements)

`calibration.json` holds every published multi-GPU measurement the rig model was checked against, the model's
figure for the same configuration, and the error (`modelled / published - 1`; positive: the model is slower than the
published rig). Nothing was tuned to these figures: the model's constants come from the H200 measurements in
`results/h200/dit/` and the vendors' datasheets (`distributed/bench/rig_cards.py`). The model itself:
[docs/rig-model.md](../../docs/rig-model.md).

Command (seconds, no device):

    {cal['command']}

Compute-scaling rule: {cal['compute_scaling_rule']}

Like for like: {cal['like_for_like']}.

{calibration_table(cal)}

Sources:

""" + "\n".join(f"- {s}" for s in sources) + "\n"
    with open(path, "w") as f:
        f.write(text)


def update_doc(cal: dict, path: str) -> bool:
    """Replace the table between :data:`TABLE_BEGIN` and :data:`TABLE_END` in ``path``; False when the markers are
    missing."""
    text = open(path).read()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return False
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    with open(path, "w") as f:
        f.write(head + TABLE_BEGIN + "\n" + calibration_table(cal) + "\n" + TABLE_END + tail)
    return True


def write(out: str, doc_path: Optional[str] = None) -> dict:
    cal = calibrate()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(cal, f, indent=1)
        f.write("\n")
    write_readme(cal, os.path.join(os.path.dirname(out) or ".", "README.md"))
    if doc_path:
        update_doc(cal, doc_path)
    return cal
