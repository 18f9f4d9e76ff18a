"""The PNG next to the JSON: latency and peak memory per case and shape, and the link model, at a glance.

Design decision: one row of panels per shape, horizontal bars with the case names on the axis (long names stay
readable), the measured value printed at the end of each bar, failed cases drawn as an empty hatched bar labelled
with their error kind (an out-of-memory baseline is a result, not a gap), and a third panel with the link model
for every profile (measured latency marked for comparison; the panel title says whether the modelled figures rest on compute
measured alone, by turn-taking, or with the ranks running at once). matplotlib runs headless (Agg); nothing is shown.
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["write_chart"]


def _by_shape(records: Sequence[dict]):
    groups = {}
    for r in records:
        label = (r.get("shape") or {}).get("label", "?")
        groups.setdefault(label, []).append(r)
    return groups


def _bars(ax, names: List[str], values: List, errors: List, unit: str, fmt: str, color: str) -> None:
    known = [v for v in values if v is not None]
    top = max(known) if known else 1.0
    ys = list(range(len(names)))[::-1]
    for y, v, err in zip(ys, values, errors):
        if v is None:
            ax.barh(y, top * 0.25, color="none", edgecolor="#b22222", hatch="//")
            ax.text(top * 0.27, y, err or "n/a", va="center", fontsize=8, color="#b22222")
        else:
            ax.barh(y, v, color=color)
            ax.text(v + top * 0.02, y, format(v, fmt) + unit, va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xlim(0, top * 1.35)
    ax.grid(axis="x", alpha=0.3)


def write_chart(records: Sequence[dict], path: str) -> str:
    """Draw ``records`` (one benchmark run) into ``path`` (PNG); return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _by_shape(records)
    if not groups:
        raise ValueError("no records to chart")
    first = records[0]
    rows = len(groups)
    fig, axes = plt.subplots(rows, 3, figsize=(18, 1.6 + (0.45 * max(len(g) for g in groups.values()) + 1.3) * rows),
                             squeeze=False)
    metric = next(((r.get("peak_memory") or {}).get("metric") for r in records if (r.get("peak_memory") or {}).get("metric")), None)
    mem_title = "peak accelerator memory, max over ranks (GiB)" if metric != "process_rss_peak" else \
        "peak process RSS, max over ranks (GiB; CPU ranks: host RAM)"
    for row, (label, recs) in enumerate(groups.items()):
        names = [str(r.get("name")) for r in recs]
        errs = [None if r.get("status") == "ok" else ((r.get("error") or {}).get("kind") or r.get("status")) for r in recs]
        lat = [r.get("latency_ms") for r in recs]
        mem = [(r.get("peak_memory") or {}).get("max_gib") if r.get("status") == "ok" else None for r in recs]
        _bars(axes[row][0], names, lat, errs, " ms", ".1f", "#3b75af")
        axes[row][0].set_title(f"{label}: latency (median, slowest rank, ms)", fontsize=10)
        _bars(axes[row][1], names, mem, errs, "", ".2f", "#e08a2c")
        axes[row][1].set_title(f"{label}: {mem_title}", fontsize=10)
        ax = axes[row][2]
        profiles = []
        for r in recs:
            for p in (r.get("link_model") or {}):
                if p not in profiles:
                    profiles.append(p)
        ys = list(range(len(recs)))[::-1]
        height = 0.8 / max(1, len(profiles))
        colors = plt.get_cmap("viridis")
        for i, p in enumerate(profiles):
            vals = [(r.get("link_model") or {}).get(p) for r in recs]
            pos = [y + 0.4 - height * (i + 0.5) for y in ys]
            ax.barh([y for y, v in zip(pos, vals) if v is not None], [v for v in vals if v is not None], height=height,
                    color=colors(i / max(1, len(profiles) - 1)), label=p)
        measured = [(y, v) for y, v in zip(ys, lat) if v is not None]
        if measured:
            ax.scatter([v for _, v in measured], [y for y, _ in measured], marker="|", s=400, color="black",
                       label="measured here", zorder=3)
        ax.set_yticks(ys)
        ax.set_yticklabels(names, fontsize=8)
        if profiles:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
        ax.grid(axis="x", alpha=0.3)
        bases = {(r.get("link_model_basis") or {}).get("compute") for r in recs if r.get("link_model")}
        basis = "compute measured ALONE (turn-taking)" if bases == {"alone"} else (
            "compute measured with ranks at once" if bases == {"concurrent"} else "compute: see link_model_basis")
        ax.set_title(f"{label}: MODELLED latency per link (ms; {basis} + link)", fontsize=10)
    fig.suptitle(
        f"PatchRay VAE benchmark: {first.get('family')} {first.get('half')} ({first.get('size')}), "
        f"{first.get('world_size')} ranks, {first.get('dtype')}, {first.get('device')}"
        + (f", HW_FAMILY={first.get('hw_family')}" if first.get("hw_family") else ""),
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
