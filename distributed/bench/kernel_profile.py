"""Where a rank's GPU time goes: one call's kernels under ``torch.profiler``, by name and by class.

Design decisions:

* **Kernels, not operators.** The profiler's device events (kernels, copies, memsets) are what the GPU ran; the
  operator view attributes them to Python calls, which differ between the whole model and a sequence rank (the
  rank adds gathers and concatenations). Summing device events by class (GEMM, attention, copies, the turn-taking
  spin...) compares a rank with the whole call kernel for kernel.
* **The class is read from the kernel name** (cuBLAS / CUTLASS / nvJet GEMMs, flash / cuDNN / memory-efficient
  attention, ``Memcpy``/``Memset``, concatenation and copy kernels, normalisation and reduction kernels); anything
  else is ``elementwise`` or ``other``. The turn-taking clock's busy-wait (``torch.cuda._sleep``'s spin kernel)
  is its own class, so a profiled call's GPU time can be compared with the clock's stage time without it.
* **Profiling is never the timed call**: the profiler slows the CPU side; the benchmark runs it once after the
  timed calls (``--profile-dir``).
"""

from __future__ import annotations

import contextlib
import json
from typing import Dict, Iterator, List, Tuple

import torch

__all__ = ["CLASSES", "classify", "record", "summarise", "write"]

#: (class, substrings of the kernel name, lower case), first match wins
CLASSES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("spin", ("spin_kernel", "_sleep")),
    ("memcpy", ("memcpy",)),
    ("memset", ("memset",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "efficient_attention", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "sm90_", "sm80_", "splitk")),
    ("cat/copy", ("catarray", "cat_", "copy_kernel", "direct_copy", "index_put", "scatter", "gather")),
    ("norm/reduce", ("norm", "reduce", "softmax", "welford")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


@contextlib.contextmanager
def record(device: torch.device) -> Iterator[torch.profiler.profile]:
    """Profile the block: CPU operators, and the device's kernels when ``device`` is CUDA."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        yield prof


def _device_events(prof) -> List[Tuple[str, float]]:
    """(name, microseconds) of every device event of the profile (kernels, copies, memsets)."""
    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out.append((e.name, float(e.time_range.elapsed_us())))
    return out


def summarise(events: List[Tuple[str, float]], top: int = 40) -> dict:
    """Totals by class and the ``top`` kernels by total time, in ms; ``gpu_ms_without_spin`` excludes the clock's spin."""
    by_name: Dict[str, List[float]] = {}
    for name, us in events:
        by_name.setdefault(name, []).append(us)
    by_class: Dict[str, Dict[str, float]] = {}
    for name, durs in by_name.items():
        c = by_class.setdefault(classify(name), {"ms": 0.0, "kernels": 0})
        c["ms"] += sum(durs) / 1e3
        c["kernels"] += len(durs)
    total = sum(c["ms"] for c in by_class.values())
    spin = by_class.get("spin", {}).get("ms", 0.0)
    kernels = sorted(((sum(d) / 1e3, len(d), n) for n, d in by_name.items()), reverse=True)[:top]
    return {
        "gpu_ms": round(total, 3),
        "gpu_ms_without_spin": round(total - spin, 3),
        "device_events": len(events) - by_class.get("spin", {}).get("kernels", 0),
        "by_class": {k: {"ms": round(v["ms"], 3), "kernels": v["kernels"]} for k, v in
                     sorted(by_class.items(), key=lambda kv: -kv[1]["ms"])},
        "top": [{"ms": round(ms, 3), "count": n, "class": classify(name), "name": name[:160]} for ms, n, name in kernels],
    }


def write(prof, prefix: str) -> dict:
    """Write ``prefix.json`` (the summary) and ``prefix.txt`` (a table); return the summary without the top list."""
    summary = summarise(_device_events(prof))
    with open(prefix + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    lines = [f"GPU time of the profiled call: {summary['gpu_ms']:.3f} ms ({summary['gpu_ms_without_spin']:.3f} ms "
             f"without the clock's spin), {summary['device_events']} device events", "", "by class:"]
    lines += [f"  {k:12s} {v['ms']:10.3f} ms  {v['kernels']:6d} events" for k, v in summary["by_class"].items()]
    lines += ["", "top kernels:"]
    lines += [f"  {t['ms']:10.3f} ms {t['count']:6d}x  {t['class']:12s} {t['name']}" for t in summary["top"]]
    with open(prefix + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    return {k: v for k, v in summary.items() if k != "top"}
