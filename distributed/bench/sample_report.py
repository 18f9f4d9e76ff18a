"""The sampling benchmark's outputs for a person: a PNG chart and a text table of a ``sample-bench`` report.

Design decision: rendering reads only the finished report (a dict, the JSON written to ``--out``), so a saved
report can be drawn again without running anything.
"""

from __future__ import annotations

__all__ = ["write_chart", "format_table"]


def write_chart(report: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..sampling.comm_manager import KINDS

    cases = report["cases"]
    labels = [f"{c['case']}{'/split' if c['split_batch'] else ''}" for c in cases]
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    ax = axes[0][0]
    ax.plot(report["reference"]["per_step_ms"], "k--", label="1 rank (reference)")
    for c, lab in zip(cases, labels):
        ax.plot(c["per_step_ms"], label=lab)
    ax.set_title("per-step latency (slowest rank)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend(fontsize=6)
    ax = axes[0][1]
    bottom = [0.0] * len(cases)
    for kind in KINDS:
        vals = [c["mean_bytes_per_step"][kind] / 1e6 for c in cases]
        ax.bar(range(len(cases)), vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_title("mean MB per step and rank, by kind")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    profiles = list(cases[0]["modelled"]) if cases else []
    width = 0.8 / max(1, len(profiles))
    for j, p in enumerate(profiles):
        xs = [i + j * width for i in range(len(cases))]
        ax.bar(xs, [c["modelled"][p]["speedup"] or 0 for c in cases], width, label=p)
        ax.plot(xs, [c["modelled_ideal_compute"][p]["speedup"] or 0 for c in cases], "kx", ms=4,
                label="ideal compute" if j == 0 else None)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    basis = "compute measured ALONE" if cases and all(c.get("compute_basis") == "alone" for c in cases) else "measured compute"
    ax.set_title(f"MODELLED speed-up vs 1 rank, N={report['ranks']} (bars: {basis}, x: ideal)")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    ax.bar(range(len(cases)), [min(c["psnr_db"], 99) for c in cases], color="tab:green")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("PSNR dB (latent preview vs 1 rank)")
    ax2 = ax.twinx()
    ax2.plot(range(len(cases)), [c["rel_l2"] for c in cases], "ro", label="relative L2 (latent)")
    ax2.set_yscale("log")
    ax2.set_ylabel("relative L2")
    ax.set_title("agreement with the single-rank run")
    fig.suptitle(
        f"sample-bench: {report['model']}, {report['height']}x{report['width']}, {report['steps']} steps, "
        f"{report['ranks']} ranks on {report['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(report: dict) -> str:
    lines = [
        f"{'case':<22}{'ms/step':>9}{'meas x':>8}{'MB/step':>10}{'async MB':>10}{'rel L2':>10}{'PSNR':>7}  "
        "modelled speed-up (measured compute | ideal compute)",
    ]
    ref_ms = sorted(report["reference"]["per_step_ms"])[len(report["reference"]["per_step_ms"]) // 2]
    lines.append(f"{'reference (1 rank)':<22}{ref_ms:>9.1f}")
    for c in report["cases"]:
        steps = len(c["per_step_ms"])
        mb = sum(c["bytes_per_step_total"]) / steps / 1e6
        amb = sum(c["async_bytes_per_step"]) / steps / 1e6
        mod = " ".join(
            f"{k}={v['speedup']:.2f}|{c['modelled_ideal_compute'][k]['speedup']:.2f}" for k, v in c["modelled"].items()
        )
        lab = f"{c['case']}{'/split' if c['split_batch'] else ''}"
        lines.append(
            f"{lab:<22}{c['median_step_ms']:>9.1f}{c['measured_speedup'] if c['measured_speedup'] is not None else float('nan'):>8.2f}"
            f"{mb:>10.3f}{amb:>10.3f}"
            f"{c['rel_l2']:>10.2e}{c['psnr_db']:>7.1f}  {mod}"
        )
    return "\n".join(lines)
