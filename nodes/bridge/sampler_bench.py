"""PatchRay Sampler Benchmark: the user's own MODEL, conditioning and latent, sampled a few steps by ComfyUI's stock
path and by the Parallel Model in each mode the cluster can run, with s/step, bytes exchanged per step and the error
against the stock result. Driver side.

Design decisions:

* **The baseline is ComfyUI's own sampling in this process** (``nodes.common_ksampler`` on the unpatched MODEL): the
  one-GPU figure a user would otherwise get, on the same inputs. On a machine whose ComfyUI runs on GPU 0 this loads
  the model there once (freed after); the modes then sample on the ranks.
* **Each mode is the product path**: the MODEL patched by :func:`.parallel_model.patch_model` with that parallelism,
  sampled by the same ``common_ksampler``; the figures come from the run's own record (``Hooks.stats``), the error
  from the latent against the baseline's. A mode the layout refuses for this model, latent or rank count is listed
  with the reason, not run.
* **Ranks sharing a device are not a speed-up**: with CPU ranks on one host, or several ranks on one GPU, the s/step
  figures measure contention, and the table says so.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, List, NamedTuple, Optional

import torch

from . import parallel_model
from .sampling_options import SamplingOptions

__all__ = ["MODES", "BenchRow", "run", "table", "write_chart"]

#: the exact parallelisms a benchmark tries (full_sync preset: each equals the stock result within fp tolerance)
MODES = ("sequence", "cfg", "cfg+sequence", "batch")


class BenchRow(NamedTuple):
    mode: str
    ranks: int
    s_per_step: Optional[float]
    speedup: Optional[float]
    bytes_per_step: Optional[float]
    rel_l2: Optional[float]
    calls: Optional[int]
    note: str = ""


def run(model, positive, negative, latent_image, cluster_config, seed: int, steps: int, cfg: float, sampler_name: str,
        scheduler: str, hooks: parallel_model.Hooks = parallel_model.Hooks(),
        modes=MODES, sample: Optional[Callable] = None, warmup: int = 1) -> List[BenchRow]:
    """The baseline and every mode of ``modes`` on ``cluster_config``'s ranks; one :class:`BenchRow` each, timed on the
    last of ``1 + warmup`` runs (the first loads or ships the model, and may run the exactness check).

    ``sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent)`` -> LATENT dict: ComfyUI's
    ``nodes.common_ksampler`` by default.
    """
    if sample is None:
        import nodes as comfy_nodes

        def sample(m, *args):
            return comfy_nodes.common_ksampler(m, *args)[0]

    args = (seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image)
    for _ in range(1 + int(warmup)):  # the first run loads the model
        t0 = time.perf_counter()
        stock = sample(model, *args)["samples"].float()
        base_s = (time.perf_counter() - t0) / max(1, steps)
    rows = [BenchRow("stock (this process)", 1, base_s, 1.0, None, 0.0, None, "ComfyUI's own sampler, one device")]
    for mode in modes:
        seen = []
        run_hooks = hooks._replace(stats=seen.append, report=None)
        try:
            patched = parallel_model.patch_model(model, SamplingOptions(cluster_config, parallelism=mode), run_hooks)
            for _ in range(1 + int(warmup)):  # the first run ships the model and may run the exactness check
                out = sample(patched, *args)["samples"].float()
        except (ValueError, NotImplementedError) as exc:
            rows.append(BenchRow(mode, cluster_config.num_ranks, None, None, None, None, None, _short(exc)))
            continue
        st = seen[-1] if seen else {}
        s_step = st.get("seconds", float("nan")) / max(1, st.get("steps", steps))
        rel = ((out - stock).norm() / stock.norm().clamp_min(1e-30)).item()
        note = "" if st.get("mode", mode) == mode else f"ran as {st.get('mode')}"
        rows.append(BenchRow(mode, cluster_config.num_ranks, s_step, base_s / s_step if s_step > 0 else None,
                             st.get("bytes_per_step"), rel, st.get("calls"), note))
    return rows


def _short(exc: BaseException) -> str:
    text = str(exc).replace("PatchRay: ", "")
    return (text[:157] + "...") if len(text) > 160 else text


def table(rows: List[BenchRow], shared_device: bool) -> str:
    """The rows as a fixed-width table; ranks sharing a device are said under it."""
    head = f"{'mode':<22} {'ranks':>5} {'s/step':>9} {'vs stock':>9} {'MB/step':>9} {'rel L2':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.mode:<22} {r.ranks:>5} {_fmt(r.s_per_step, '.3f'):>9} {_fmt(r.speedup, '.2f', 'x'):>9} "
            f"{_fmt(None if r.bytes_per_step is None else r.bytes_per_step / 1e6, '.2f'):>9} "
            f"{_fmt(r.rel_l2, '.1e'):>9}  {r.note}")
    if shared_device:
        lines.append("the ranks share this machine's device(s): s/step measures contention, not a multi-GPU speed-up")
    return "\n".join(lines)


def _fmt(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None or v != v else f"{v:{spec}}{suffix}"


def write_chart(rows: List[BenchRow], path: str) -> str:
    """A bar chart of s/step per mode (PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.s_per_step is not None]
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
    ax.bar([r.mode for r in ran], [r.s_per_step for r in ran], color=["#888"] + ["#3a7"] * (len(ran) - 1))
    for i, r in enumerate(ran):
        ax.text(i, r.s_per_step, f"{r.s_per_step:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("s/step")
    ax.set_title("PatchRay Sampler Benchmark")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def save(rows: List[BenchRow], folder: str, meta: dict) -> str:
    """The report as JSON in ``folder``; returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"sampler_bench_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as fh:
        json.dump(dict(meta, rows=[r._asdict() for r in rows]), fh, indent=1)
    return path


def shares_device(cluster_config) -> bool:
    """Whether the ranks share one device: CPU ranks on this host, or more ranks than GPUs here."""
    if getattr(cluster_config, "device", "auto") == "cpu":
        return True
    return torch.cuda.device_count() < int(cluster_config.num_ranks) and not getattr(cluster_config, "address", None)
