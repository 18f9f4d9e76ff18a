"""Table and chart of the host-copy runs (``distributed/bench/host_copy.py`` records): run by ``run.sh``.

    python results/h200/hostram/summarize.py OUTDIR RECORDS.json [RECORDS.json ...]

Writes OUTDIR/summary.json (one row per case) and OUTDIR/hostram.png (when matplotlib is there); prints the table.
"""

import json
import os
import sys

GOAL = 1.25  # peak host memory during the first prompt, in units of the model's bytes


def rows(paths):
    out = []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        for r in doc.get("records", []):
            gib = lambda xs: [round(x / 2**30, 2) if x is not None else None for x in xs]
            out.append({
                "model": r["model"], "device": r["device"], "ranks": r["ranks"], "sharding": r["sharding"],
                "transport": r["transport"], "model_gb": round(r["model_bytes"] / 1e9, 2),
                "first_prompt": round(r["first_prompt_ratio"], 3), "shipping": round(r["shipping_ratio"], 3),
                "first_forward": round(r["first_forward_ratio"], 3), "later": round(r["later_prompts_ratio"], 3),
                "first_prompt_without_idle_workers": round(r["first_prompt_ratio_without_idle_workers"], 3),
                "meets_1_25x": r["first_prompt_ratio"] <= GOAL,
                "rank_gpu_peak_gib": gib(r["rank_gpu_peak_allocated_bytes_first_prompt"]),
                "rank_host_weights_gib": gib(r["rank_host_weight_bytes"]),
                # gloo's staging of the forward's all-gathers on ranks sharing a GPU (comm_fsdp stages each block
                # through host memory; NCCL between GPUs stages nothing): its bound, (N + 1) x the largest block, taken
                # off the first prompt's figure (derived, not measured); and PyTorch's pinned host pool's peak per rank
                "first_prompt_less_gloo_staging": round(r.get("first_prompt_ratio_less_gloo_staging", r["first_prompt_ratio"]), 3),
                "gloo_staging_bound_gib": round(r.get("gloo_host_staging_bound_bytes", 0) / 2**30, 2),
                "rank_pinned_host_peak_gib": gib(r.get("rank_pinned_host_peak_bytes") or []),
                "pss_growth_gib_after_shipping": {k: round(v / 2**30, 2) for k, v in r["pss_growth_by_process_after_shipping"].items()},
                "outputs_agree": r["outputs_agree"], "seconds": {k: round(v, 1) for k, v in r["seconds"].items()},
                "source": os.path.basename(path),
            })
    return out


def table(rs):
    lines = ["| model | ranks | sharding | first prompt | shipping | first forward | later | first prompt less gloo staging "
             "(derived) | rank GPU peak (GiB) | agree | case s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        peak = "/".join(f"{x:.1f}" for x in r["rank_gpu_peak_gib"] if x is not None) or "-"
        lines.append(f"| {r['model']} ({r['model_gb']} GB) | {r['ranks']} {r['device']} | {r['sharding']} | "
                     f"{r['first_prompt']:.2f}x{'' if r['meets_1_25x'] else ' (>1.25x)'} | {r['shipping']:.2f}x | "
                     f"{r['first_forward']:.2f}x | {r['later']:.2f}x | {r['first_prompt_less_gloo_staging']:.2f}x | {peak} | "
                     f"{r['outputs_agree']} | {r['seconds']['case']:.0f} |")
    return "\n".join(lines)


def chart(rs, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['model']}\nN={r['ranks']} {r['sharding']}" for r in rs]
    xs = range(len(rs))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rs)), 4.5))
    w = 0.27
    ax.bar([x - w for x in xs], [r["shipping"] for r in rs], w, label="shipping")
    ax.bar(list(xs), [r["first_prompt"] for r in rs], w, label="first prompt (shipping + forward)")
    ax.bar([x + w for x in xs], [r["later"] for r in rs], w, label="later prompts")
    ax.axhline(GOAL, color="k", ls="--", lw=1, label=f"goal {GOAL}x")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("peak host PSS above baseline / model bytes")
    ax.set_title("Host PSS of driver + Ray + ranks while a model ships", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv):
    outdir, paths = argv[0], argv[1:]
    order = {"blocks": 0, "none": 1, "none-host": 2}
    rs = sorted(rows(paths), key=lambda r: (r["model"], r["ranks"], order.get(r["sharding"], 9)))
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump({"goal_first_prompt_ratio": GOAL, "rows": rs}, f, indent=1)
    print(table(rs))
    if rs:
        chart(rs, os.path.join(outdir, "hostram.png"))
    return 0 if rs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
