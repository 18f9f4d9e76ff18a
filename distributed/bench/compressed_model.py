"""``python -m patchray.distributed.bench.compressed_model``: MODELLED bytes per step and speed-ups of the
low-traffic sampling presets (displaced, compressed 4/2/1-bit, otil) on PCIe 4.0 x16 without P2P, 10 GbE and NVLink.

Everything this module outputs is MODELLED (labelled so in the JSON and the chart):

* **SDXL** (UNet, 1024x1024): the bytes per step of ``full_sync`` and ``displaced`` are the ones the sampling
  benchmark *counted* on an H200 (``results/h200/sdxl-1024-n{2,4}-shared-*.json``); the compressed presets' bytes
  are derived from displaced's streamed halo and K/V bytes by the packing of ``comm_manager`` (exact for slots whose
  size is a multiple of the 256-element group: ``(256 b / 8 + 4) / (256 itemsize)`` of the fp16 bytes), the rest of
  the step (GroupNorm statistics, output gather, warm-up steps) unchanged.
* **DiTs** (FLUX.1 1024x1024, Wan 2.1 14B 480x832x81, Qwen-Image 1328x1328): bytes from
  ``sampling.dit.step_cost`` (the cost model the CI tests check against the counted bytes), gathered K/V.
* **Compute per step**: per-rank compute measured alone when a JSON from ``dit_bench``/``sample_bench`` with
  ``--timing alone`` is given; otherwise the *ideal* share of the one-rank reference step (reference x the busiest
  rank's rows / total: a lower bound of the real per-rank compute; labelled ``compute: ideal``), plus the codec
  (quantise + dequantise) cost, modelled as memory traffic: 5 passes over the fp16 K/V/halo bytes at 2 TB/s.
* **Step time** (the sampling benchmark's formula): ``compute + messages x latency + sync_bytes / bw +
  max(0, async_bytes / bw - compute)``, transfers doubled when staged through host memory; a run is ``warmup``
  synchronous steps (all bytes blocking, as full_sync) and ``steps - warmup`` asynchronous ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Dict, Optional

__all__ = ["model_run", "sdxl_rows", "dit_rows", "main"]

from ..topology.preset_cost import CODEC_GBPS, CODEC_PASSES, packing  # the runtime's preset=auto uses the same codec cost

PROFILES = ("pcie4_x16_no_p2p", "10gbe", "nvlink")


def step_ms(compute: float, sync_bytes: float, async_bytes: float, messages: float, profile: str) -> float:
    from ..topology.links import get_profile

    p = get_profile(profile)
    per_byte = 1e3 / (p.bandwidth_gbps * 1e9) * (2 if p.via_host else 1)
    return compute + messages * p.latency_us / 1e3 + sync_bytes * per_byte + max(0.0, async_bytes * per_byte - compute)


def model_run(ref_step_ms: float, compute_ms: float, sync_step: dict, async_step: Optional[dict], steps: int, warmup: int,
              profile: str) -> dict:
    """MODELLED run time and speed-up: ``warmup`` synchronous steps, the rest asynchronous (``async_step`` None:
    every step synchronous, full_sync)."""
    t_sync = step_ms(compute_ms, sync_step["sync"], 0.0, sync_step["messages"], profile)
    if async_step is None:
        total = steps * t_sync
    else:
        t_async = step_ms(compute_ms + async_step.get("codec_ms", 0.0), async_step["sync"], async_step["async"],
                          async_step["messages"], profile)
        total = warmup * t_sync + (steps - warmup) * t_async
    return {"run_ms": total, "speedup": steps * ref_step_ms / total}


def _sdxl_case(path: str, name: str) -> Optional[dict]:
    d = json.load(open(path))
    for c in d["cases"]:
        if c["case"] == name:
            return c
    return None


def sdxl_rows(n: int, path: str, ref_step_ms: float, steps: int = 50, warmup: int = 4, split: bool = False) -> Dict[str, dict]:
    """SDXL 1024x1024 at ``n`` ranks from the counted bytes of the displaced case in ``path``.

    ``split``: the CFG batch split (``split_batch``): ``n / 2`` patch ranks per CFG half, from the counted bytes of an
    ``n / 2``-rank run without split (``path``) halved (halos and K/V scale with the batch, 2 -> 1), plus the CFG
    pair exchange of the completed half (one latent half per step, counted as synchronous)."""
    disp = _sdxl_case(path, "displaced")
    scale = 0.5 if split else 1.0
    last = len(disp["bytes_per_step_total"]) - 1
    cfg_pair = 4 * 128 * 128 * 2 if split else 0  # one CFG half of the 1024x1024 latent, fp16, to the pair peer
    sync_bytes_warm = disp["bytes_per_step_total"][0] * scale + cfg_pair
    warm = {"sync": sync_bytes_warm, "messages": disp["collectives_per_step"][0] + (1 if split else 0)}
    streamed = disp["async_bytes_per_step"][last] * scale  # halos, K/V, GroupNorm statistics (fp16)
    gn = disp["mean_bytes_per_step"].get("groupnorm", 0.0) * scale
    layer = streamed - gn  # halo + K/V
    sync_async_step = disp["bytes_per_step_total"][last] * scale - streamed + cfg_pair  # the output gather (+ CFG pair)
    compute = ref_step_ms / n
    rows = {"full_sync": {"bytes_per_step": sync_bytes_warm, "async_bytes_per_step": 0, "warm": warm, "step": None}}
    for name, bits in (("displaced", 0), ("compressed", 4), ("compressed_2bit", 2), ("compressed_1bit", 1)):
        a = layer * (packing(bits) if bits else 1.0) + gn
        codec = CODEC_PASSES * layer / (CODEC_GBPS * 1e9) * 1e3 if bits else 0.0
        rows[name] = {"bytes_per_step": a + sync_async_step, "async_bytes_per_step": a, "warm": warm,
                      "step": {"sync": sync_async_step, "async": a, "messages": disp["collectives_per_step"][last] + (1 if split else 0), "codec_ms": codec}}
    out = {}
    for name, r in rows.items():
        out[name] = {"bytes_per_step": r["bytes_per_step"], "async_bytes_per_step": r["async_bytes_per_step"],
                     "modelled": {p: {w: model_run(ref_step_ms, compute, r["warm"], r["step"], steps, w, p)["speedup"] for w in (warmup, 2)}
                                  for p in PROFILES}}
    return out


def dit_rows(shape_key: str, n: int, ref_step_ms: Optional[float], compute_ms: Optional[float], steps: int, warmup: int,
             calls_per_step: int = 1, cfg_groups: int = 1) -> Dict[str, dict]:
    """A full-size DiT at ``n`` ranks: bytes from ``step_cost`` (gathered K/V); speed-ups when a reference is known.

    ``cfg_groups=2`` (cfg+sequence): two CFG groups of ``n / 2`` sequence ranks, each evaluating one of the
    ``calls_per_step`` (2) calls; the groups exchange their outputs once per step (``split.split_cost``: one output)."""
    from ..parallel.exchange import DISPLACED, EXACT, compressed
    from ..sampling.dit import FULL_SIZE_SHAPES, step_cost

    shape = FULL_SIZE_SHAPES[shape_key]
    ref_total = ref_step_ms
    if cfg_groups > 1:
        n //= cfg_groups
        calls_per_step //= cfg_groups
        if ref_step_ms:
            ref_step_ms = ref_step_ms / cfg_groups  # the per-rank denominator below is the group's share
    cfg_out = (cfg_groups - 1) * shape.frames * shape.rows * shape.cols * shape.out_features * 2 if cfg_groups > 1 else 0
    exact = step_cost(shape, n, "gathered", kv=EXACT)
    out_gather = (n - 1) * max(shape.frames * math.ceil(shape.rows / n) * shape.cols, 1) * shape.out_features * 2
    kv_bytes = exact["wire_bytes"] - out_gather
    warm = {"sync": calls_per_step * exact["wire_bytes"] + cfg_out, "messages": calls_per_step * exact["messages"] + (cfg_groups > 1)}
    rows = {"full_sync": (warm["sync"], 0.0, None)}
    for name, kv in (("displaced", DISPLACED), ("compressed", compressed(4)), ("compressed_2bit", compressed(2)), ("compressed_1bit", compressed(1))):
        c = step_cost(shape, n, "gathered", kv=kv) if name != "displaced" else exact
        a = calls_per_step * (c["wire_bytes"] - out_gather)
        codec = CODEC_PASSES * calls_per_step * kv_bytes / (CODEC_GBPS * 1e9) * 1e3 if name.startswith("compressed") else 0.0
        rows[name] = (calls_per_step * out_gather + a + cfg_out, a, {"sync": calls_per_step * out_gather + cfg_out, "async": a,
                                                                      "messages": calls_per_step + (cfg_groups > 1), "codec_ms": codec})
    res = {}
    for name, (tot, a, st) in rows.items():
        e = {"bytes_per_step": tot, "async_bytes_per_step": a}
        if ref_step_ms:
            comp = compute_ms if compute_ms else ref_step_ms / n
            e["modelled"] = {p: {w: model_run(ref_total, comp, warm, st, steps, w, p)["speedup"] for w in (warmup, 2)} for p in PROFILES}
        res[name] = e
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdxl-n2", default="results/h200/sdxl-1024-n2-shared-50steps.json")
    ap.add_argument("--sdxl-n4", default="results/h200/sdxl-1024-n4-shared-20steps.json")
    ap.add_argument("--sdxl-ref-ms", type=float, default=None, help="one-rank reference step (default: the N=2 file's median)")
    ap.add_argument("--dit-ref", action="append", default=[], help="KEY=MS one-rank reference step of a full-size DiT (measured)")
    ap.add_argument("--dit-alone", action="append", default=[], help="KEY:N=MS per-rank compute per step measured alone (dit_bench)")
    ap.add_argument("--out", default="results/compressed/compressed-model.json")
    a = ap.parse_args(argv)
    ref2 = json.load(open(a.sdxl_n2))["reference"]["per_step_ms"]
    sdxl_ref = a.sdxl_ref_ms or sorted(ref2)[len(ref2) // 2]
    doc = {"MODELLED": True, "note": __doc__, "profiles": list(PROFILES), "sdxl_ref_step_ms": sdxl_ref,
           "sdxl": {"2": sdxl_rows(2, a.sdxl_n2, sdxl_ref), "4": sdxl_rows(4, a.sdxl_n4, sdxl_ref),
                    "4_cfgsplit": sdxl_rows(4, a.sdxl_n2, sdxl_ref, split=True)}, "dit": {}}
    refs = dict(kv.split("=") for kv in a.dit_ref)
    alone = {tuple(k.split(":")): float(v) for k, v in (kv.split("=") for kv in a.dit_alone)}
    for key, steps in (("flux1_1024", 28), ("wan21_14b_480x832x81", 50), ("qwen_image_1328", 50)):
        ref = float(refs[key]) if key in refs else None
        cps = 1 if key == "flux1_1024" else 2  # FLUX.1-dev: guidance distilled, one call per step; the others CFG
        doc["dit"][key] = {str(n): dit_rows(key, n, ref, None, steps, 4, calls_per_step=cps) for n in (2, 4)}
        if cps == 2:
            doc["dit"][key]["4_cfgseq"] = dit_rows(key, 4, ref, None, steps, 4, calls_per_step=cps, cfg_groups=2)
        for n in (2, 4):
            if (key, str(n)) in alone:
                doc["dit"][key][f"{n}_alone"] = dit_rows(key, n, ref, alone[(key, str(n))], steps, 4, calls_per_step=cps)
                doc["dit"][key][f"{n}_alone_compute_ms"] = alone[(key, str(n))]
        doc["dit"][key]["steps"] = steps
        doc["dit"][key]["calls_per_step"] = cps
        doc["dit"][key]["ref_step_ms"] = ref
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    _chart(doc, a.out.replace(".json", ".png"))
    for n in ("2", "4", "4_cfgsplit"):
        for name, r in doc["sdxl"][n].items():
            sp = " ".join(f"{p}={r['modelled'][p][4]:.2f}x(w4)/{r['modelled'][p][2]:.2f}x(w2)" for p in PROFILES)
            print(f"SDXL N={n} {name:16s} {r['bytes_per_step'] / 1e6:8.1f} MB/step  MODELLED {sp}")
    for key, per in doc["dit"].items():
        for n in ("2", "4", "4_cfgseq", "2_alone", "4_alone"):
            for name, r in per.get(n, {}).items():
                sp = "" if "modelled" not in r else " ".join(f"{p}={r['modelled'][p][4]:.2f}x(w4)/{r['modelled'][p][2]:.2f}x(w2)" for p in PROFILES)
                print(f"{key} N={n} {name:16s} {r['bytes_per_step'] / 1e6:9.1f} MB/step {sp}")
    return 0


def _chart(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - charts are optional
        return
    modes = ["full_sync", "displaced", "compressed", "compressed_2bit", "compressed_1bit"]
    fig, axes = plt.subplots(1, 2, figsize=(16, 5))
    ax = axes[0]
    cases = [("SDXL", doc["sdxl"][n], n) for n in ("2", "4")] + [(k.split("_")[0], v[n], n) for k, v in doc["dit"].items() for n in ("2", "4")]
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ax.bar([j + i * width for j in range(len(cases))], [c[1][m]["bytes_per_step"] / 1e6 for c in cases], width, label=m)
    ax.set_xticks([j + 0.4 for j in range(len(cases))], [f"{c[0]}\nN={c[2]}" for c in cases])
    ax.set_yscale("log")
    ax.set_ylabel("MB sent per rank per step (async steps)")
    ax.set_title("MODELLED bytes per step")
    ax.legend(fontsize=7)
    ax = axes[1]
    groups = [("SDXL N=2", doc["sdxl"]["2"]), ("SDXL N=4", doc["sdxl"]["4"]), ("SDXL N=4\ncfg split", doc["sdxl"]["4_cfgsplit"])]
    for key, per in doc["dit"].items():
        for n in ("2", "4", "4_cfgseq"):
            if n in per and "modelled" in per[n]["displaced"]:
                groups.append((f"{key.split('_')[0]} N={n[0]}" + ("\ncfg+seq" if "cfg" in n else ""), per[n]))
    for i, m in enumerate(modes):
        ax.bar([j + i * width for j in range(len(groups))], [g[m]["modelled"]["pcie4_x16_no_p2p"]["4"] if "4" in g[m]["modelled"]["pcie4_x16_no_p2p"]
                                                           else g[m]["modelled"]["pcie4_x16_no_p2p"][4] for _, g in groups], width, label=m)
    ax.axhline(1.9, color="k", ls=":", lw=0.8)
    ax.axhline(3.0, color="k", ls="--", lw=0.8)
    ax.set_xticks([j + 0.4 for j in range(len(groups))], [g for g, _ in groups], fontsize=7)
    ax.set_ylabel("speed-up vs one rank (4 exact warm-up steps)")
    ax.set_title("MODELLED, PCIe 4.0 x16 without P2P, ideal compute share")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
