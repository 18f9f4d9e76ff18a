"""``python -m patchray.distributed.bench.compressed_model``: MODELLED bytes per step and speed-ups of the
low-traffic sampling presets (displaced, compressed 4/2/1-bit, otil) on PCIe 4.0 x16 without P2P, 10 GbE and NVLink.

Everything this module outputs is MODELLED (labelled so in the JSON and the chart):

* **SDXL** (UNet, 1024x1024): the bytes per step of ``full_sync`` and ``displaced`` are the ones the sampling
  benchmark *counted* on an H200 (``results/h200/sdxl-1024-n{2,4}-shared-*.json``); the compressed presets' bytes
  are derived from displaced's streamed halo and K/V bytes by the packing of ``comm_manager`` (exact for slots whose
  size is a multiple of the 256-element group: ``(256 b / 8 + 4) / (256 itemsize)`` of the fp16 bytes), the rest of
  the step (GroupNorm statistics, output gather, warm-up steps) unchanged.
* **DiTs** (FLUX.1 1024x1024, Wan 2.1 14B 480x832x81, Qwen-Image 1328x1328): bytes from
  ``sampling.dit.step_cost`` (the cost model the CI tests check against the counted bytes), per kind of step as
  ``parallelize_dit`` runs them: ``full_sync`` exact every step with its text sharded and the attention ``auto`` on
  the link; a stale preset's warm-up steps before the last by the cheapest exact attention on the link (Ulysses
  where the heads divide and it moves fewer bytes), its last warm-up step a gathered exact step that fills the stale
  memory, then asynchronous steps. Joint-attention DiTs are modelled with the text whole (the stale presets'
  default) and sharded (``shard_text=True``); 1, 2 and 4 warm-up steps (``--warmup`` adds more).
* **Compute per step**: per-rank compute measured alone when given (``--dit-alone``); otherwise for SDXL the *ideal*
  share of the one-rank reference step (reference / ranks: a lower bound of the real per-rank compute), for DiTs the
  reference times the busiest rank's share of a call's tokens (``token_share``: its image band plus its text slice,
  or plus the whole text when it stays whole: FLUX.1 at N = 2 computes 2,560 / 4,608 of a call with the text whole);
  plus the codec (quantise + dequantise) cost, modelled as memory traffic: 5 passes over the fp16 K/V/halo bytes at
  2 TB/s.
* **Step time** (the sampling benchmark's formula): ``compute + messages x latency + sync_bytes / bw +
  max(0, async_bytes / bw - compute)``, transfers doubled when staged through host memory.
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


def codec_ms(wire_bytes: float, n: int, bits: int, codec: Optional[dict] = None) -> float:
    """Codec time per step of a rank whose uncompressed exchange puts ``wire_bytes`` on its link ((N - 1) x its own
    streamed bytes). ``codec``: ``{bits: (encode_ms_per_gb, apply_ms_per_gb)}`` measured by ``tools/dev/codec_bench.py`` (the
    rank encodes its own bytes once and applies each of the N - 1 peers' residuals); None: the ASSUMED memory-traffic
    figure (``CODEC_PASSES`` passes over the wire bytes at ``CODEC_GBPS``)."""
    if not bits:
        return 0.0
    if codec is None:
        return CODEC_PASSES * wire_bytes / (CODEC_GBPS * 1e9) * 1e3
    enc, app = codec[bits]
    own_gb = wire_bytes / max(n - 1, 1) / 1e9
    return own_gb * (enc + (n - 1) * app)


def load_codec(path: str, codec: str = "eager") -> dict:
    """``{bits: (encode_ms_per_gb, apply_ms_per_gb)}`` of ``codec`` from a ``tools/dev/codec_bench.py`` JSON: per width, its
    largest chunk (the exchange's chunks are large: 60 slots of K/V each)."""
    best: Dict[int, dict] = {}
    for r in json.load(open(path))["rows"]:
        kind = r.get("codec") or ("compiled" if r.get("compiled") else "eager")  # older files: a compiled flag
        if "error" in r or kind != codec:
            continue
        if r["bits"] not in best or r["numel"] > best[r["bits"]]["numel"]:
            best[r["bits"]] = r
    return {b: (r["encode_ms_per_gb"], r["apply_ms_per_gb"]) for b, r in best.items()}


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


def sdxl_rows(n: int, path: str, ref_step_ms: float, steps: int = 50, warmup: int = 4, split: bool = False,
              codec_table: Optional[dict] = None) -> Dict[str, dict]:
    """SDXL 1024x1024 at ``n`` ranks from the counted bytes of the displaced case in ``path``.

    ``split``: the CFG batch split (``split_batch``): ``n / 2`` patch ranks per CFG half, from the counted bytes of an
    ``n / 2``-rank run without split (``path``) halved (halos and K/V scale with the batch, 2 -> 1), plus the CFG
    pair exchange of the completed half (one latent half per step, counted as synchronous). ``codec_table``: see
    :func:`codec_ms`."""
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
        codec = codec_ms(layer, n // 2 if split else n, bits, codec_table)
        rows[name] = {"bytes_per_step": a + sync_async_step, "async_bytes_per_step": a, "warm": warm,
                      "step": {"sync": sync_async_step, "async": a, "messages": disp["collectives_per_step"][last] + (1 if split else 0), "codec_ms": codec}}
    out = {}
    for name, r in rows.items():
        out[name] = {"bytes_per_step": r["bytes_per_step"], "async_bytes_per_step": r["async_bytes_per_step"],
                     "modelled": {p: {w: model_run(ref_step_ms, compute, r["warm"], r["step"], steps, w, p)["speedup"] for w in (warmup, 2)}
                                  for p in PROFILES}}
    return out


#: the warm-up counts every DiT row is modelled with (the presets' default is 4)
WARMUPS = (1, 2, 4)
#: text layouts of the joint-attention DiTs under the stale presets (``parallelize_dit(shard_text=...)``)
TEXT_LAYOUTS = ("whole", "sharded")


def dit_run(ref_total_ms: float, compute_ms: float, warm: dict, fill: dict, step: Optional[dict], steps: int, warmup: int,
            profile: str) -> dict:
    """MODELLED run of a DiT preset: ``warmup - 1`` exact warm-up steps that leave the stale memory alone (``warm``:
    the cheapest exact attention on the link), the last warm-up step gathering K/V into the memory (``fill``), then
    ``steps - warmup`` asynchronous steps (``step``; ``None``: every step is ``warm``, full_sync)."""
    t_warm = step_ms(compute_ms, warm["sync"], 0.0, warm["messages"], profile)
    if step is None:
        total = steps * t_warm
    else:
        t_fill = step_ms(compute_ms, fill["sync"], 0.0, fill["messages"], profile)
        t_async = step_ms(compute_ms + step.get("codec_ms", 0.0), step["sync"], step["async"], step["messages"], profile)
        total = (warmup - 1) * t_warm + t_fill + (steps - warmup) * t_async
    return {"run_ms": total, "speedup": steps * ref_total_ms / total}


def dit_rows(shape_key: str, n: int, ref_step_ms: Optional[float], compute_ms: Optional[float], steps: int,
             warmups=WARMUPS, calls_per_step: int = 1, cfg_groups: int = 1, text: str = "whole",
             codec_table: Optional[dict] = None) -> Dict[str, dict]:
    """A full-size DiT at ``n`` ranks, as ``parallelize_dit`` runs it: bytes from ``step_cost`` per kind of step.

    * ``full_sync``: every step exact, text sharded (the exact modes' default), attention ``auto`` on the link
      (Ulysses where the heads divide and it is cheaper there: FLUX.1 and Qwen-Image at N = 4 on PCIe).
    * the stale presets (``text``: ``"whole"``, their default, or ``"sharded"``): warm-up steps before the last by the
      cheapest exact attention on the link, the last one a gathered exact step that fills the stale memory, then
      asynchronous steps (displaced K/V, or their 4/2/1-bit residuals), the output gathered every step.
    * compute per step: ``compute_ms`` when measured alone, else the reference times the busiest rank's share of a
      call's tokens (``token_share``: its image band plus its text slice, or the whole text when it stays whole), so
      text kept whole costs what it costs. The same compute on every kind of step; the codec on the compressed
      steps.

    ``cfg_groups=2`` (cfg+sequence): two CFG groups of ``n / 2`` sequence ranks, each evaluating one of the
    ``calls_per_step`` (2) calls; the groups exchange their outputs once per step (``split.split_cost``: one output)."""
    from ..parallel.exchange import DISPLACED, EXACT, compressed
    from ..sampling.dit import FULL_SIZE_SHAPES, step_cost, token_share

    shape = FULL_SIZE_SHAPES[shape_key]
    ref_total = ref_step_ms
    if cfg_groups > 1:
        n //= cfg_groups
        calls_per_step //= cfg_groups
    cfg_out = (cfg_groups - 1) * shape.frames * shape.rows * shape.cols * shape.out_features * 2 if cfg_groups > 1 else 0
    out_gather = (n - 1) * max(shape.frames * math.ceil(shape.rows / n) * shape.cols, 1) * shape.out_features * 2
    cps, extra_msg = calls_per_step, int(cfg_groups > 1)

    def sync_step(cost):
        return {"sync": cps * cost["wire_bytes"] + cfg_out, "messages": cps * cost["messages"] + extra_msg, "mode": cost["mode"]}

    layouts = {"full_sync": True}
    rows = {}
    for name, kv in (("full_sync", None), ("displaced", DISPLACED), ("compressed", compressed(4)),
                     ("compressed_2bit", compressed(2)), ("compressed_1bit", compressed(1))):
        sharded = layouts.get(name, text == "sharded")
        per_profile = {}
        for prof in PROFILES:
            warm = sync_step(step_cost(shape, n, "auto", link=prof, shard_text=sharded))
            if kv is None:
                per_profile[prof] = (warm, None, None)
                continue
            fill = sync_step(step_cost(shape, n, "gathered", shard_text=sharded))
            c = step_cost(shape, n, "gathered", kv=kv, shard_text=sharded)
            kv_exact = step_cost(shape, n, "gathered", shard_text=sharded)["wire_bytes"] - out_gather
            a = cps * (c["wire_bytes"] - out_gather)
            codec = codec_ms(cps * kv_exact, n, kv.bits, codec_table)
            per_profile[prof] = (warm, fill, {"sync": cps * out_gather + cfg_out, "async": a, "messages": cps + extra_msg,
                                              "codec_ms": codec})
        warm, fill, st = per_profile["pcie4_x16_no_p2p"]
        e = {"text": "none" if not shape.text else "sharded" if sharded else "whole", "token_share": token_share(shape, n, sharded),
             "warm_bytes_per_step": warm["sync"], "warm_mode_pcie4_x16_no_p2p": warm["mode"],
             "fill_bytes": fill["sync"] if fill else None,
             "bytes_per_step": warm["sync"] if st is None else st["sync"] + st["async"],
             "async_bytes_per_step": 0.0 if st is None else st["async"]}
        if ref_step_ms:
            comp = compute_ms if compute_ms else ref_total / cfg_groups * token_share(shape, n, sharded)
            e["compute_ms"] = comp
            e["compute"] = "measured alone" if compute_ms else "token share"
            e["modelled"] = {p: {w: dit_run(ref_total, comp, *per_profile[p], steps, w, p)["speedup"] for w in warmups}
                             for p in PROFILES}
        rows[name] = e
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdxl-n2", default="results/h200/sdxl-1024-n2-shared-50steps.json")
    ap.add_argument("--sdxl-n4", default="results/h200/sdxl-1024-n4-shared-20steps.json")
    ap.add_argument("--sdxl-ref-ms", type=float, default=None, help="one-rank reference step (default: the N=2 file's median)")
    ap.add_argument("--dit-ref", action="append", default=[], help="KEY=MS one-rank reference step of a full-size DiT (measured)")
    ap.add_argument("--dit-alone", action="append", default=[],
                    help="KEY:N[:TEXT]=MS per-rank compute per step measured alone (dit_bench; TEXT whole or sharded: "
                         "for that text layout only)")
    ap.add_argument("--codec", default=None, help="tools/dev/codec_bench.py JSON: the measured codec cost instead of the ASSUMED one")
    ap.add_argument("--codec-kind", default="compiled", choices=["eager", "compiled", "triton"],
                    help="which codec's rows of --codec to use")
    ap.add_argument("--warmup", type=int, action="append", default=None,
                    help="DiT warm-up steps to model besides 1, 2 and 4 (repeatable); the chart and table use --chart-warmup")
    ap.add_argument("--chart-warmup", type=int, default=4, help="the DiT warm-up count the chart shows (default 4, the presets')")
    ap.add_argument("--out", default="results/compressed/compressed-model.json")
    a = ap.parse_args(argv)
    ref2 = json.load(open(a.sdxl_n2))["reference"]["per_step_ms"]
    sdxl_ref = a.sdxl_ref_ms or sorted(ref2)[len(ref2) // 2]
    ct = load_codec(a.codec, a.codec_kind) if a.codec else None
    doc = {"MODELLED": True, "note": __doc__, "profiles": list(PROFILES), "sdxl_ref_step_ms": sdxl_ref,
           "codec": ({"source": os.path.basename(a.codec), "codec_kind": a.codec_kind, "measured": True,
                      "ms_per_gb_encode_apply": {str(b): v for b, v in ct.items()}} if ct else
                     {"measured": False, "assumed": f"{CODEC_PASSES} passes over the wire bytes at {CODEC_GBPS:g} GB/s"}),
           "sdxl": {"2": sdxl_rows(2, a.sdxl_n2, sdxl_ref, codec_table=ct), "4": sdxl_rows(4, a.sdxl_n4, sdxl_ref, codec_table=ct),
                    "4_cfgsplit": sdxl_rows(4, a.sdxl_n2, sdxl_ref, split=True, codec_table=ct)}, "dit": {}}
    refs = dict(kv.split("=") for kv in a.dit_ref)
    alone = {tuple(k.split(":")): float(v) for k, v in (kv.split("=") for kv in a.dit_alone)}

    def alone_ms(key, n, text):
        return alone.get((key, str(n), text), alone.get((key, str(n))))
    warmups = tuple(sorted(set(WARMUPS) | set(a.warmup or ())))
    doc["dit_warmups"] = list(warmups)
    doc["dit_note"] = ("DiT rows: rows[n][text][preset]; warm-up steps before the last by the cheapest exact attention on the "
                       "link, the last one gathered into the stale memory; compute = reference x the busiest rank's token "
                       "share unless measured alone; 'modelled'[profile][warm-up steps] = MODELLED speed-up")
    for key, steps in (("flux1_1024", 28), ("wan21_14b_480x832x81", 50), ("qwen_image_1328", 50)):
        ref = float(refs[key]) if key in refs else None
        cps = 1 if key == "flux1_1024" else 2  # FLUX.1-dev: guidance distilled, one call per step; the others CFG
        texts = TEXT_LAYOUTS if key != "wan21_14b_480x832x81" else ("whole",)  # Wan: text by cross-attention only
        per = doc["dit"][key] = {}
        for n in (2, 4):
            per[str(n)] = {t: dit_rows(key, n, ref, None, steps, warmups, calls_per_step=cps, text=t, codec_table=ct)
                           for t in texts}
        if cps == 2:
            per["4_cfgseq"] = {t: dit_rows(key, 4, ref, None, steps, warmups, calls_per_step=cps, cfg_groups=2, text=t,
                                           codec_table=ct) for t in texts}
        for n in (2, 4):
            measured = {t: alone_ms(key, n, t) for t in texts if alone_ms(key, n, t) is not None}
            if measured:
                per[f"{n}_alone"] = {t: dit_rows(key, n, ref, ms, steps, warmups, calls_per_step=cps, text=t, codec_table=ct)
                                     for t, ms in measured.items()}
                per[f"{n}_alone_compute_ms"] = measured
        per["steps"] = steps
        per["calls_per_step"] = cps
        per["ref_step_ms"] = ref
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    _chart(doc, a.out.replace(".json", ".png"), a.chart_warmup)
    for n in ("2", "4", "4_cfgsplit"):
        for name, r in doc["sdxl"][n].items():
            sp = " ".join(f"{p}={r['modelled'][p][4]:.2f}x(w4)/{r['modelled'][p][2]:.2f}x(w2)" for p in PROFILES)
            print(f"SDXL N={n} {name:16s} {r['bytes_per_step'] / 1e6:8.1f} MB/step  MODELLED {sp}")
    for key, per in doc["dit"].items():
        for n in ("2", "4", "4_cfgseq", "2_alone", "4_alone"):
            for text, rows in per.get(n, {}).items():
                for name, r in rows.items():
                    sp = "" if "modelled" not in r else " ".join(
                        f"{p}=" + "/".join(f"{r['modelled'][p][w]:.2f}x(w{w})" for w in warmups) for p in PROFILES)
                    print(f"{key} N={n} text={r['text']:7s} {name:16s} {r['bytes_per_step'] / 1e6:9.1f} MB/step MODELLED {sp}")
    return 0


def _chart(doc: dict, path: str, warmup: int = 4) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - charts are optional
        return
    modes = ["full_sync", "displaced", "compressed", "compressed_2bit", "compressed_1bit"]
    short = {"flux1_1024": "FLUX.1", "wan21_14b_480x832x81": "Wan 14B", "qwen_image_1328": "Qwen"}
    groups = [("SDXL N=2", doc["sdxl"]["2"], 4), ("SDXL N=4", doc["sdxl"]["4"], 4), ("SDXL N=4\ncfg split", doc["sdxl"]["4_cfgsplit"], 4)]
    for key, per in doc["dit"].items():
        for n in ("2", "4", "4_cfgseq"):
            for text, rows in per.get(n, {}).items():
                if "modelled" in rows["displaced"]:
                    groups.append((f"{short.get(key, key)} N={n[0]}" + ("\ncfg+seq" if "cfg" in n else "") + f"\ntext {text}", rows, warmup))
    fig, axes = plt.subplots(3, 1, figsize=(18, 13))
    width = 0.8 / len(modes)
    ticks = ([j + 0.4 for j in range(len(groups))], [g for g, _, _ in groups])
    ax = axes[0]
    for i, m in enumerate(modes):
        ax.bar([j + i * width for j in range(len(groups))], [g[m]["bytes_per_step"] / 1e6 for _, g, _ in groups], width, label=m)
    ax.set_yscale("log")
    ax.set_ylabel("MB sent per rank per step (async steps)")
    ax.set_title("MODELLED bytes per step")
    ax.set_xticks(*ticks, fontsize=7)
    ax.legend(fontsize=7)
    for ax, w in zip(axes[1:], (warmup, 1)):
        for i, m in enumerate(modes):
            vals = []
            for label, g, _ in groups:
                mod = g[m]["modelled"]["pcie4_x16_no_p2p"]
                ww = 4 if label.startswith("SDXL") else w  # SDXL rows: the presets' 4 warm-up steps
                vals.append(mod.get(ww, mod.get(str(ww), 0.0)))
            ax.bar([j + i * width for j in range(len(groups))], vals, width, label=m)
        ax.axhline(1.8, color="k", ls=":", lw=0.8)
        ax.axhline(3.0, color="k", ls="--", lw=0.8)
        ax.set_xticks(*ticks, fontsize=7)
        ax.set_ylabel("speed-up vs one rank")
        ax.set_title(f"MODELLED speed-up, PCIe 4.0 x16 without P2P, DiTs with {w} exact warm-up step{'s' if w > 1 else ''} "
                     "(SDXL: 4); DiT compute: the busiest rank's token share")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
