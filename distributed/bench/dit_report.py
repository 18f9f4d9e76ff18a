"""The DiT benchmark's report (``python -m patchray.distributed.bench.dit_bench``): the table, the chart, the estimate.

* :func:`format_table` / :func:`write_chart`: a measured report (compute measured alone per rank, N-GPU latency
  MODELLED, every title says so).
* :func:`estimate` / :func:`format_estimate`: no device at all, the step latency ESTIMATED from one rank's measured
  full call x the busiest rank's token share (:func:`.dit_models.token_share`, text tokens replicated or sharded as
  :data:`.dit_models.TEXT_TOKENS` says) + the runtime cost model's bytes over each link profile.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .dit_models import DEFAULT_MODES, PRESETS, TEXT_TOKENS, _calls_per_step, _reference_calls, dit_shape, plan_cases, token_share
from .dit_rank import SHOWN_PROFILES

__all__ = ["GOALS", "BASELINE_CALL_MS", "estimate", "format_estimate", "format_table", "write_chart"]

#: the speed-up goals the report is read against (modelled; per step)
GOALS = {"nvlink": {2: 1.9, 4: 3.6}, "pcie4_x16_no_p2p_cfg": {2: 1.9}}

#: one rank's full call (batch 1, bf16) on an H200: FLUX.1 measured alone by this benchmark (results/h200/dit);
#: Wan 2.1 14B and Qwen-Image from plain single-GPU diffusers runs of the same configurations on an H200 (2026-11-29;
#: Wan later measured alone by this benchmark at 3,289 ms, results/h200/dit/dit_wan.json)
BASELINE_CALL_MS = {"flux1_1024": 172.3, "wan21_14b_480x832x81": 3230.0, "qwen_image_1328": 347.0}


def estimate(presets: Sequence[str], ns: Sequence[int] = (1, 2, 4), modes: Sequence[str] = DEFAULT_MODES, *,
             cfg_inner: str = "gathered", itemsize: int = 2, call_ms: Optional[Dict[str, float]] = None,
             text_tokens: Optional[str] = None) -> dict:
    """Step latency ESTIMATED without a device: ``calls x (share x one rank's call + link time of the call's bytes)``.

    The compute is one rank's measured full call (:data:`BASELINE_CALL_MS`) times the busiest rank's token share
    (:func:`token_share`, text tokens replicated or sharded per ``text_tokens``, default :data:`TEXT_TOKENS`;
    every linear layer and every query of attention scales with it, keys stay full), which
    assumes per-rank compute proportional to its tokens: it ignores launch overhead and the lower efficiency of
    smaller matrices, so it is an upper bound of the speed-up. The bytes are the runtime's cost model
    (``sampling.dit.step_cost``, ``split.split_cost``), which the measured runs match exactly.
    """
    from ..sampling.dit import step_cost
    from ..sampling.split import split_cost
    from ..topology.links import LINK_PROFILES, model_latency_ms

    call_ms = dict(BASELINE_CALL_MS, **(call_ms or {}))
    text = text_tokens or TEXT_TOKENS
    rows = []
    for name in presets:
        preset = PRESETS[name]
        base = call_ms[name]
        shape = dit_shape(preset, "full")
        for case in plan_cases(preset, "full", ns, modes):
            calls = _calls_per_step(preset, case)
            ref = base * _reference_calls(preset, case)
            if case.mode == "cfg":
                m = case.n // 2
                inner = step_cost(shape, m, cfg_inner, itemsize=itemsize) if m > 1 else {"wire_bytes": 0, "messages": 0}
                ex = split_cost((shape.frames * shape.rows * shape.cols * shape.out_features,), itemsize, 2, 2)
                compute, wire, msgs = token_share(preset, m, text_tokens=text) * base, inner["wire_bytes"] + ex["wire_bytes"], inner["messages"] + ex["messages"]
            elif case.mode == "none":
                compute, wire, msgs = base, 0, 0
            else:
                cost = step_cost(shape, case.n, case.mode, itemsize=itemsize)
                compute, wire, msgs = token_share(preset, case.n, text_tokens=text) * base, cost["wire_bytes"], cost["messages"]
            step = {p: round(calls * model_latency_ms(compute, wire, msgs, p), 1) for p in LINK_PROFILES}
            rows.append({"preset": name, "model": preset.title, "case": case.label, "n": case.n, "mode": case.mode,
                         "calls_per_step": calls, "compute_ms_per_call": round(compute, 1),
                         "wire_bytes_per_step": calls * wire, "reference_step_ms": ref, "estimated_step_ms": step,
                         "speedup_estimated": {p: round(ref / v, 3) for p, v in step.items()}, "estimate": True})
    return {"benchmark": "dit-bench-estimate", "estimate": True, "cfg_inner": cfg_inner, "call_ms": call_ms,
            "text_tokens": text,
            "text_tokens_note": ("replicated: every sequence rank holds all text tokens; sharded: the busiest rank holds "
                                 "ceil(text / N); the bytes are the runtime cost model's (sampling.dit.step_cost) whatever this "
                                 "setting, i.e. the exchange of the sampler that model describes"),
            "method": estimate.__doc__.split("\n\n")[0] + " " + " ".join(estimate.__doc__.split("\n\n")[1].split()),
            "rows": rows}


def format_estimate(doc: dict) -> str:
    lines = [f"{'preset':22s} {'case':18s} {'compute/call ms':>15s} {'GB/step':>8s} {'nvlink ms':>10s} {'x':>6s} "
             f"{'pcie-noP2P ms':>13s} {'x':>6s}  (ESTIMATED: share x one rank's call + link model)"]
    for r in doc["rows"]:
        e, s = r["estimated_step_ms"], r["speedup_estimated"]
        lines.append(f"{r['preset']:22s} {r['case']:18s} {r['compute_ms_per_call']:15.1f} {r['wire_bytes_per_step'] / 1e9:8.2f} "
                     f"{e['nvlink']:10.1f} {s['nvlink']:6.2f} {e['pcie4_x16_no_p2p']:13.1f} {s['pcie4_x16_no_p2p']:6.2f}")
    return "\n".join(lines)


def format_table(report: dict) -> str:
    """One line per record: compute alone (and with the prefilled clock its GPU and CPU-issue parts), bytes, modelled
    step and speed-up (NVLink, PCIe 4.0 x16 no P2P), memory."""
    lines = [f"{'preset':22s} {'case':18s} {'compute/step ms':>15s} {'gpu/call':>9s} {'issue/call':>10s} {'GB/step':>8s} "
             f"{'nvlink ms':>10s} {'x':>6s} {'pcie-noP2P ms':>13s} {'x':>6s} {'peak GiB':>9s} {'rel L2':>9s}  (modelled)"]
    nan = float("nan")
    for r in report.get("records", []):
        if r.get("status") != "ok":
            lines.append(f"{r['preset']:22s} {r['case']:18s} {r['status']}: {r.get('error', '')[:90]}")
            continue
        # a speed-up needs the N = 1 reference in the same report (absent when --ns leaves it out): nan
        m = {k: (v if v is not None else nan) for k, v in (r.get("modelled_step_ms") or {}).items()}
        s = {k: (v if v is not None else nan) for k, v in (r.get("speedup_modelled") or {}).items()}
        m.setdefault("nvlink", nan), m.setdefault("pcie4_x16_no_p2p", nan)
        s.setdefault("nvlink", nan), s.setdefault("pcie4_x16_no_p2p", nan)
        rel = (r.get("exactness") or {}).get("rel_l2_vs_n1")
        gpu, issue = r.get("gpu_ms_per_call_alone"), r.get("launch_ms_per_call_alone")
        lines.append(
            f"{r['preset']:22s} {r['case']:18s} {r['compute_ms_per_step_alone']:15.1f} "
            f"{gpu if gpu is not None else nan:9.1f} {issue if issue is not None else nan:10.1f}"
            f"{'*' if r.get('launch_bound') else ' '}{r['wire_bytes_per_step'] / 1e9:7.2f} "
            f"{m['nvlink']:10.1f} {s['nvlink']:6.2f} {m['pcie4_x16_no_p2p']:13.1f} {s['pcie4_x16_no_p2p']:6.2f} "
            f"{max(p for p in r['peak_gib_by_rank'] if p is not None) if any(r['peak_gib_by_rank']) else nan:9.2f} "
            f"{rel if rel is not None else nan:9.2e}")
    lines.append(f"clock: {report.get('alone_clock')}; gpu/call = GPU time per call, issue/call = the CPU's issue time "
                 "(per stage the slowest rank, queued stages); * = launch-bound (the model uses the issue time)")
    measured = [r for r in report.get("records", []) if r.get("status") == "ok" and r.get("measured")]
    if measured:
        lines.append(f"MEASURED with the ranks at once ({report.get('placement')}, {report.get('backend')}): step ms, "
                     "speed-up over one rank's measured step, model / measured - 1 per model")
        for r in measured:
            err = r.get("model_error_vs_measured") or {}
            errs = " ".join(f"{k} {v:+.1%}" for k, v in err.items() if v is not None and k in SHOWN_PROFILES + ("measured_collectives",))
            x = r.get("speedup_measured")
            lines.append(f"{r['preset']:22s} {r['case']:18s} {r['measured_step_ms']:12.1f} ms "
                         f"{x if x is not None else nan:6.2f}x  {errs}")
    return "\n".join(lines)


def write_chart(report: dict, path: str) -> str:
    """Per preset: modelled speed-up per case (NVLink, PCIe 4.0 x16 no P2P) with the goals, and bytes per step.

    An :func:`estimate` document is drawn the same way, every title saying ESTIMATED.
    """
    if report.get("estimate"):
        label = "ESTIMATED"
        report = {"records": [dict(r, status="ok", speedup_modelled=r["speedup_estimated"]) for r in report["rows"]],
                  "suptitle": "PatchRay DiT modes: step latency ESTIMATED (one rank's measured call x the busiest rank's "
                              "token share + the cost model's bytes over the link); not a per-rank measurement"}
    else:
        label = "MODELLED"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_preset: Dict[str, List[dict]] = {}
    for r in report.get("records", []):
        by_preset.setdefault(r["preset"], []).append(r)
    # a preset none of whose cases ran is named in the title, not drawn as a row of empty bars
    unmeasured = [name for name, recs in by_preset.items() if not any(r.get("status") == "ok" for r in recs)]
    by_preset = {name: recs for name, recs in by_preset.items() if name not in unmeasured}
    if not by_preset:
        raise ValueError("no measured records to chart")
    rows = len(by_preset)
    fig, axes = plt.subplots(rows, 2, figsize=(15, 3.2 * rows + 1.0), squeeze=False)
    colors = {"nvlink": "#2b6cb0", "pcie4_x16_no_p2p": "#dd6b20", "measured": "#2f855a"}
    for row, (name, recs) in enumerate(by_preset.items()):
        ax, bx = axes[row]
        labels = [r["case"] for r in recs]
        xs = list(range(len(recs)))
        shown = SHOWN_PROFILES + (("measured",) if any(r.get("measured") for r in recs) else ())
        width = 0.76 / len(shown)
        for j, prof in enumerate(shown):
            key = "speedup_measured" if prof == "measured" else "speedup_modelled"
            vals = [((r.get(key) if prof == "measured" else (r.get(key) or {}).get(prof)) if r.get("status") == "ok"
                     else None) for r in recs]
            for x, v, r in zip(xs, vals, recs):
                pos = x + (j - (len(shown) - 1) / 2) * width
                if v is None:
                    ax.bar(pos, 0.3, width, color="none", edgecolor="#b22222", hatch="//")
                    if j == 0:
                        ax.text(x, 0.35, r.get("status", "n/a"), ha="center", fontsize=7, color="#b22222", rotation=90)
                else:
                    ax.bar(pos, v, width, color=colors[prof], label=prof if x == 0 else None)
                    ax.text(pos, v + 0.05, f"{v:.2f}", ha="center", fontsize=7)
        for n, goal in GOALS["nvlink"].items():
            ax.axhline(goal, color=colors["nvlink"], ls=":", lw=0.8)
            ax.text(len(recs) - 0.5, goal, f"NVLink goal {goal} (N={n})", fontsize=7, va="bottom", ha="right")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(f"speed-up per step ({label})")
        ax.set_title(f"{recs[0].get('model', name)}: {label} speed-up over one rank's step", fontsize=9)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in shown]
        names = {"nvlink": f"NVLink (H200), {label}", "pcie4_x16_no_p2p": f"PCIe 4.0 x16, no P2P, {label}",
                 "measured": f"MEASURED, ranks at once ({report.get('placement', '')}, {report.get('backend', '')})"}
        ax.legend(handles, [names[p] for p in shown], fontsize=7, loc="upper left")
        gb = [r.get("wire_bytes_per_step", 0) / 1e9 if r.get("status") == "ok" else 0 for r in recs]
        bx.bar(xs, gb, color="#4a5568")
        for x, v in zip(xs, gb):
            bx.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        bx.set_xticks(xs)
        bx.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        bx.set_ylabel("GB a rank sends per step")
        bx.set_title("bytes per step (comm accounting, busiest rank)", fontsize=9)
    title = report.get("suptitle") or ("PatchRay DiT modes: compute measured alone, link latency "
                                       f"MODELLED ({report.get('dtype')}, {report.get('size')} size, "
                                       + (f"{report.get('placement')}, {report.get('backend')}"
                                          if report.get("placement") == "one GPU per rank" else
                                          f"{report.get('ranks_on_one_device')} ranks on one device") + ")")
    if unmeasured:
        title += f"\nnot run: {', '.join(unmeasured)} (see the JSON's status)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
