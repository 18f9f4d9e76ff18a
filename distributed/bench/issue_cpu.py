"""The CPU cost of issuing one DiT call: diffusers' own forward (N = 1) against a PatchRay sequence rank (N = 2).

``python -m patchray.distributed.bench.issue_cpu [--preset flux1_1024] [--hidden 64] [--calls 30] [--out FILE]``

On an H200 a 1,024x1,024 FLUX.1 sequence rank is launch-bound: its kernels run faster than the CPU issues them from
Python, so every Python-level call PatchRay adds per block shows in the step time. This benchmark measures that
share on a CPU, where it is cheap to measure: a model with the released block count (FLUX.1: 19 double + 38
single blocks; Qwen-Image: 60) but a tiny width (``--hidden``) and a small token grid, so a call's time is almost
all Python and dispatch, as on the H200 at full size. Every rank runs one compute thread
(``torch.set_num_threads(1)``).

Per call it reports, for N = 1 (unmodified diffusers, one process; and two such processes at once, the machine as
loaded as by two ranks) and for each rank of N = 2 (``parallelize_dit``, gathered attention by default, text
sharded, two real gloo ranks):

* ``cpu_ms``: the main thread's CPU time per call (``time.thread_time``; gloo's transfers run on its own worker
  threads, and a blocked wait costs no CPU): the issue time plus the (small) compute. Median over ``--calls``.
* ``wall_ms``: wall time per call (N = 2: includes waiting for the peer; informative only on a shared machine).
* from one further call under ``cProfile`` with a counting ``TorchFunctionMode`` installed outside the model (an
  instrument of this script only): ``torch_calls`` (Python-level torch function calls the call makes),
  ``py_calls`` (Python function calls), ``patchray_calls`` (of those, calls of functions in PatchRay's
  ``distributed/`` package) and ``routed_calls`` (calls of a ``__torch_function__`` handler defined in PatchRay:
  torch calls that passed through a PatchRay function mode).

The ratio ``N = 2 cpu_ms / N = 1 cpu_ms`` is PatchRay's issue overhead at this block count (the N = 2 rank also
computes on half of the tokens, which at this width is a small part of its time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["issue_preset", "measure_rank", "main"]

#: tiny-width, full-depth configurations: the released block counts, ``hidden`` = heads x head_dim
_DEPTH = {
    "flux1_1024": dict(num_layers=19, num_single_layers=38),
    "qwen_image_1328": dict(num_layers=60),
}


def issue_preset(name: str, hidden: int = 32, rows: int = 8, text: int = 8):
    """The preset ``name`` at its released depth with width ``hidden`` (2 heads), a ``rows x rows`` token grid and
    ``text`` text tokens (FLUX.1 at 1,024x1,024 has 4,096 image and 512 text tokens: the same 8:1)."""
    from .dit_models import PRESETS

    base = PRESETS[name]
    heads, head_dim = 2, hidden // 2
    if head_dim % 8:
        raise ValueError(f"--hidden must be a multiple of 16 (got {hidden})")
    t = max(2, head_dim // 8)  # RoPE axes (frame, row, column) near FLUX.1's proportions (16/56/56 of 128), even
    t += (head_dim - t) % 4
    tiny = dict(base.tiny, attention_head_dim=head_dim, num_attention_heads=heads,
                axes_dims_rope=(t, (head_dim - t) // 2, (head_dim - t) // 2), **_DEPTH[name])
    return base._replace(tiny=tiny, grid_tiny=(1, rows, rows), text_tiny=text)


class _CountTorch(TorchFunctionMode):
    """Counts the Python-level torch function calls made while active (an instrument; changes no result)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _profile_one(call) -> Dict[str, int]:
    import patchray.distributed as pkg

    root = os.path.dirname(os.path.abspath(pkg.__file__))
    counter = _CountTorch()
    prof = cProfile.Profile()
    with counter:
        prof.enable()
        call()
        prof.disable()
    stats = pstats.Stats(prof).stats
    py = ours = routed = 0
    for (filename, _, func), (_, ncalls, _, _, _) in stats.items():
        py += ncalls
        if os.path.abspath(filename).startswith(root) and "/bench/" not in filename:
            ours += ncalls
            if func == "__torch_function__":
                routed += ncalls
    return {"torch_calls": counter.calls, "py_calls": py, "patchray_calls": ours, "routed_calls": routed}


def measure_rank(ctx, preset_name: str, hidden: int, rows: int, text: int, calls: int, warmup: int,
                 parallel: bool, mode: str = "gathered") -> dict:
    """One rank's figures (see the module docstring); ``parallel=False``: diffusers' own forward."""
    from ..comm import barrier, intercept
    from .dit_models import build_random, make_inputs
    from .turns import take_turns

    torch.set_num_threads(1)
    preset = issue_preset(preset_name, hidden, rows, text)
    model = build_random(preset, "tiny", torch.device("cpu"), torch.float32, seed=0)
    inputs = make_inputs(preset, "tiny", torch.device("cpu"), torch.float32, seed=1)[0]
    handle = None
    if parallel:
        from ..sampling.dit import parallelize_dit

        handle = parallelize_dit(model, ctx, mode=mode)

    def call():
        return model(**inputs)[0]

    cpu: List[float] = []
    comm_cpu: List[float] = []
    wall: List[float] = []
    in_comm = [0.0]

    def timed(comm_call, proceed):  # the main thread's CPU time inside each collective (its Python and enqueue)
        c = time.thread_time()
        try:
            return proceed()
        finally:
            in_comm[0] += time.thread_time() - c

    with torch.no_grad():
        out = call()
        with intercept(timed) if parallel else contextlib.nullcontext():
            for i in range(warmup + calls):
                if parallel:
                    barrier(ctx)
                in_comm[0] = 0.0
                t0, c0 = time.perf_counter(), time.thread_time()
                call()
                c1, t1 = time.thread_time(), time.perf_counter()
                if i >= warmup:
                    cpu.append((c1 - c0) * 1e3)
                    comm_cpu.append(in_comm[0] * 1e3)
                    wall.append((t1 - t0) * 1e3)
        # the ranks computing one at a time between collectives (the benchmark's turn-taking): each stage's CPU
        # time with the machine to itself, collectives excluded, as the H200 runs report their issue time
        alone_cpu: List[float] = []
        alone_wall: List[float] = []
        for i in range(warmup + calls):
            barrier(ctx)
            with take_turns(ctx, clock=None) as turns:
                call()
            if i >= warmup:
                alone_cpu.append(sum(turns.cpu_ms))
                alone_wall.append(sum(turns.compute_ms))
        barrier(ctx)
        counts = _profile_one(call)
    if handle is not None:
        handle.remove()
    blocks = sum(len(m) for n, m in model.named_children() if isinstance(m, torch.nn.ModuleList))
    return {"rank": ctx.rank, "world_size": ctx.world_size if parallel else 1, "blocks": blocks,
            "cpu_ms": round(statistics.median(cpu), 3), "cpu_ms_min": round(min(cpu), 3),
            "issue_ms": round(statistics.median([c - m for c, m in zip(cpu, comm_cpu)]), 3),
            "comm_cpu_ms": round(statistics.median(comm_cpu), 3),
            "alone_cpu_ms": round(statistics.median(alone_cpu), 3), "alone_wall_ms": round(statistics.median(alone_wall), 3),
            "wall_ms": round(statistics.median(wall), 3), **counts, "output": out.float()}


def run(preset: str = "flux1_1024", hidden: int = 32, rows: int = 8, text: int = 8, calls: int = 30,
        warmup: int = 3, mode: str = "gathered") -> dict:
    """N = 1 (diffusers' forward) then N = 2 (PatchRay); returns the record (outputs compared, not kept)."""
    from ..spawn import run_ranks

    args = (preset, hidden, rows, text, calls, warmup)
    one = run_ranks(measure_rank, 1, *args, parallel=False)[0]
    # the same unmodified forward in two processes at once: the machine as loaded as by two ranks
    pair = run_ranks(measure_rank, 2, *args, parallel=False)
    two = run_ranks(measure_rank, 2, *args, parallel=True, mode=mode)
    ref = one.pop("output")
    for r in pair:
        r.pop("output")
    err = []
    for r in two:
        out = r.pop("output")
        err.append(float((out - ref).norm() / ref.norm()))
    worst = max(r["cpu_ms"] for r in two)
    worst_issue = max(r["issue_ms"] for r in two)
    worst_alone = max(r["alone_cpu_ms"] for r in two)
    return {"preset": preset, "hidden": hidden, "grid": [1, rows, rows], "text": text, "mode": mode,
            "torch": torch.__version__, "threads_per_rank": 1, "n1": one, "n1_pair": pair, "n2": two,
            "n2_over_n1_cpu": round(worst / one["cpu_ms"], 3),
            "n2_over_n1_pair_cpu": round(worst / max(r["cpu_ms"] for r in pair), 3),
            "n2_issue_over_n1": round(worst_issue / one["issue_ms"], 3),
            "n2_issue_over_n1_pair": round(worst_issue / max(r["issue_ms"] for r in pair), 3),
            "n2_alone_over_n1": round(worst_alone / one["alone_cpu_ms"], 3), "rel_l2_n2_vs_n1": max(err)}


def _table(rec: dict) -> str:
    rows = ([("N=1 diffusers", rec["n1"])] + [(f"N=1 diffusers, 2 copies at once: {r['rank']}", r) for r in rec["n1_pair"]]
            + [(f"N=2 PatchRay rank {r['rank']}", r) for r in rec["n2"]])
    lines = [f"{rec['preset']} hidden {rec['hidden']}, {rec['n1']['blocks']} blocks, grid {rec['grid'][1]}x{rec['grid'][2]}, "
             f"{rec['text']} text tokens, mode {rec['mode']}",
             "| run | CPU ms/call, alone (turns) | CPU ms/call, ranks at once | of it in collectives | issue ms/call (CPU - "
             "collectives) | wall ms/call | torch calls | py calls | PatchRay calls | routed torch calls |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['alone_cpu_ms']:.1f} | {r['cpu_ms']:.1f} | {r['comm_cpu_ms']:.1f} | {r['issue_ms']:.1f} | {r['wall_ms']:.1f} | "
                     f"{r['torch_calls']} | {r['py_calls']} | {r['patchray_calls']} | {r['routed_calls']} |")
    lines.append(f"N=2 / N=1 CPU per call, alone (turns): {rec['n2_alone_over_n1']:.3f}; ranks at once: {rec['n2_over_n1_cpu']:.3f} (N=1 alone), {rec['n2_over_n1_pair_cpu']:.3f} (2 copies "
                 f"at once); issue time (collectives excluded): {rec['n2_issue_over_n1']:.3f} / {rec['n2_issue_over_n1_pair']:.3f}; "
                 f"rel L2 N=2 vs N=1: {rec['rel_l2_n2_vs_n1']:.1e}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(_DEPTH), help="repeatable (default flux1_1024)")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8, help="token rows = token columns")
    ap.add_argument("--text", type=int, default=8)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode", default="gathered", choices=("gathered", "ulysses"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    records = []
    for name in a.preset or ["flux1_1024"]:
        rec = run(name, a.hidden, a.rows, a.text, a.calls, a.warmup, a.mode)
        records.append(rec)
        print(_table(rec), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
