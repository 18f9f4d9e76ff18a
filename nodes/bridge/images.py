"""PNG file -> IMAGE tensor (for charts and heatmaps the library writes)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["png_to_image"]


def png_to_image(path: str) -> torch.Tensor:
    """IMAGE ``[1, H, W, 3]`` float 0..1 from a PNG (alpha composited on white)."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(bg, im).convert("RGB")
        arr = np.asarray(rgb, dtype=np.float32) / 255.0
    return torch.from_numpy(arr.copy()).unsqueeze(0)


def node_chart(records, path: str) -> str:
    """The Benchmark node's chart, drawn for a node (about 640 px wide, 11 pt text): latency and peak memory per case.

    The report's own chart (next to its JSON) is a page-wide figure for reading on its own; scaled into a node its
    text is unreadable. This one has two panels side by side, one bar per case, the value at the end of each bar,
    failed cases marked with their error kind, and the size as width x height.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = list(records)
    if not recs:
        raise ValueError("no records to chart")
    names = [str(r.get("name")) for r in recs]
    failed = [None if r.get("status") == "ok" else ((r.get("error") or {}).get("kind") or r.get("status") or "failed") for r in recs]
    on_cpu = any((r.get("peak_memory") or {}).get("metric") == "process_rss_peak" for r in recs)
    panels = (
        ("latency (ms)", [r.get("latency_ms") for r in recs], "#3b75af", "{:.0f}"),
        ("peak process RAM (GiB)" if on_cpu else "peak GPU memory (GiB)", [(r.get("peak_memory") or {}).get("max_gib") if r.get("status") == "ok" else None for r in recs], "#e08a2c", "{:.2f}"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(6.4, 1.3 + 0.42 * len(recs)), dpi=100)
    ys = list(range(len(recs)))[::-1]
    for ax, (title, values, color, fmt) in zip(axes, panels):
        known = [v for v in values if v is not None]
        top = max(known) if known else 1.0
        for y, v, err in zip(ys, values, failed):
            if v is None:
                ax.barh(y, top * 0.3, color="none", edgecolor="#b22222", hatch="//")
                ax.text(top * 0.32, y, err or "n/a", va="center", fontsize=10, color="#b22222")
            else:
                ax.barh(y, v, color=color)
                ax.text(v + top * 0.03, y, fmt.format(v), va="center", fontsize=10)
        ax.set_yticks(ys)
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names), fontsize=10)
        ax.set_xlim(0, top * 1.45)
        ax.tick_params(axis="x", labelsize=9)
        ax.set_title(title, fontsize=11)
        ax.grid(axis="x", alpha=0.3)
    first = recs[0]
    shape = first.get("shape") or {}
    size = f"{shape.get('width')}x{shape.get('height')}" if shape.get("width") else shape.get("label", "")
    if (shape.get("frames") or 1) > 1:
        size += f"x{shape['frames']}"
    fig.suptitle(f"{first.get('family')} {first.get('half')} ({first.get('size')}) {size}, {first.get('world_size')} "
                 f"{first.get('device')} ranks", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path)
    plt.close(fig)
    return path
