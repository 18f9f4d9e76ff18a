"""The CPU cost of issuing one DiT call: diffusers' own forward (N = 1) against a PatchRay sequence rank (N = 2).

``python -m tools.dev.issue_cpu [--preset flux1_1024] [--hidden 32] [--calls 30] [--out FILE]``

On an H200 a 1,024x1,024 FLUX.1 sequence rank is launch-bound: its kernels run faster than the CPU issues them from
Python, so every Python-level call PatchRay adds per block shows in the step time. This benchmark measures that
share on a CPU, where it is cheap to measure: a model with the released block count (FLUX.1: 19 double + 38
single blocks; Qwen-Image: 60) but a tiny width (``--hidden``) and a small token grid, so a call's time is almost
all Python and dispatch, as on the H200 at full size. Every rank runs one compute thread
(``torch.set_num_threads(1)``).

Per call it reports, for N = 1 (unmodified diffusers, one process; and two such processes, "the pair") and for each
rank of N = 2 (``parallelize_dit``, gathered attention by default, text sharded, two real gloo ranks):

* ``alone_cpu_ms`` / ``alone_cpu_ms_min`` (the headline): the ranks take turns between collectives
  (``bench/turns.py``, as the GPU benchmark measures issue time), a stage is also closed at every transformer
  block's start, and each stage's process CPU time is recorded (collectives excluded); per stage the median / the
  minimum over ``--calls``, summed. In the two-process runs every stage starts after a process switch (cold caches),
  which one process never pays, so the pair passes the baton where the ranks do (every block start and every
  attention module): ``n2_alone_over_pair`` is PatchRay's overhead at equal switching.
* ``cpu_ms``: the main thread's CPU time per call with the processes running at once (``time.thread_time``; gloo's
  transfers run on its worker threads and a blocked wait costs no CPU); ``comm_cpu_ms``: of it, inside collectives
  (``comm.intercept``); ``issue_ms`` the difference. ``wall_ms``: wall time per call.
* from one further call under ``cProfile`` with a counting ``TorchFunctionMode`` installed outside the model (an
  instrument of this script only): ``torch_calls`` (Python-level torch function calls the call makes),
  ``py_calls`` (Python function calls), ``patchray_calls`` (of those, calls of functions in PatchRay's
  ``distributed/`` package) and ``routed_calls`` (calls of a ``__torch_function__`` handler defined in PatchRay:
  torch calls that passed through a PatchRay function mode).

The N = 2 rank also computes on half of the tokens, a small part of its time at this width. ``--summary FILE...``
prints the headline figures of saved records. results/cpu-issue/README.md has the figures.
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
    from patchray.distributed.bench.dit_models import PRESETS

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


def _attention_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules the family's plan adapts as sequence attention (where a rank exchanges K/V)."""
    import fnmatch

    from patchray.distributed.sampling.dit import family_of
    from patchray.distributed.sampling.dit_families import attention_globs

    globs = attention_globs(family_of(model))
    return [m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in globs)]


def measure_rank(ctx, preset_name: str, hidden: int, rows: int, text: int, calls: int, warmup: int,
                 parallel: bool, mode: str = "gathered") -> dict:
    """One rank's figures (see the module docstring); ``parallel=False``: diffusers' own forward."""
    from patchray.distributed.comm import barrier, intercept
    from patchray.distributed.bench.dit_models import build_random, make_inputs
    from patchray.distributed.bench.turns import take_turns

    torch.set_num_threads(1)
    preset = issue_preset(preset_name, hidden, rows, text)
    model = build_random(preset, "tiny", torch.device("cpu"), torch.float32, seed=0)
    inputs = make_inputs(preset, "tiny", torch.device("cpu"), torch.float32, seed=1)[0]
    handle = None
    if parallel:
        from patchray.distributed.sampling.dit import parallelize_dit

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
        # the ranks computing one at a time between collectives (the benchmark's turn-taking), a stage also closed
        # at every transformer block's start: each stage's CPU time with the machine to itself, collectives
        # excluded (as the H200 runs report issue time); per stage the median (and the minimum) over the calls, a
        # statistic of short stages that a loaded machine's preemptions disturb far less than whole calls. N = 1
        # has one stage per block, N = 2 two (split at the block's attention exchange). In the two-process runs
        # (N = 2, and the two copies of N = 1) the ranks pass the baton at every block start too, and the copies
        # of N = 1 at every attention module as well, so both start every stage after a process switch (cold
        # caches), twice per block: the fair comparison on a 2-core machine.
        stages: List[List[float]] = []
        current = [None]

        def mark(mod, args):
            turns = current[0]
            if turns is None:
                return
            if ctx.world_size > 1:  # pass the baton: in both two-process runs every stage starts after a switch
                turns.end_turn()
                turns.begin_turn()
            else:
                turns.mark()

        blocks = [b for n, m in model.named_children() if isinstance(m, torch.nn.ModuleList) for b in m]
        hooks = [b.register_forward_pre_hook(mark) for b in blocks]
        if ctx.world_size > 1 and not parallel:
            # the copies of N = 1 also switch where a rank exchanges K/V (at its attention modules)
            hooks += [m.register_forward_pre_hook(mark) for m in _attention_modules(model)]
        for i in range(warmup + calls):
            barrier(ctx)
            with take_turns(ctx, clock=None) as turns:
                current[0] = turns
                call()
                current[0] = None
            if i >= warmup:
                stages.append(list(turns.cpu_ms))
        for h in hooks:
            h.remove()
        if len({len(x) for x in stages}) != 1:  # backstop: the same work every call
            raise RuntimeError(f"stage counts differ between calls: {sorted({len(x) for x in stages})}")
        per_stage = list(zip(*stages))
        alone_cpu = [sum(x) for x in stages]
        staged_median = sum(statistics.median(x) for x in per_stage)
        staged_min = sum(min(x) for x in per_stage)
        barrier(ctx)
        counts = _profile_one(call)
    if handle is not None:
        handle.remove()
    return {"rank": ctx.rank, "world_size": ctx.world_size if parallel else 1, "blocks": len(blocks),
            "cpu_ms": round(statistics.median(cpu), 3), "cpu_ms_min": round(min(cpu), 3),
            "issue_ms": round(statistics.median([c - m for c, m in zip(cpu, comm_cpu)]), 3),
            "comm_cpu_ms": round(statistics.median(comm_cpu), 3),
            "alone_cpu_ms": round(staged_median, 3), "alone_cpu_ms_min": round(staged_min, 3),
            "alone_call_cpu_ms": round(statistics.median(alone_cpu), 3), "stages": len(per_stage),
            "wall_ms": round(statistics.median(wall), 3), **counts, "output": out.float()}


def run(preset: str = "flux1_1024", hidden: int = 32, rows: int = 8, text: int = 8, calls: int = 30,
        warmup: int = 3, mode: str = "gathered") -> dict:
    """N = 1 (diffusers' forward) then N = 2 (PatchRay); returns the record (outputs compared, not kept)."""
    from patchray.distributed.spawn import run_ranks

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
            "n2_alone_over_n1": round(worst_alone / one["alone_cpu_ms"], 3),
            "n2_alone_over_n1_min": round(max(r["alone_cpu_ms_min"] for r in two) / one["alone_cpu_ms_min"], 3),
            # the headline: against the two copies of N = 1 that switch processes where the ranks do
            "n2_alone_over_pair": round(worst_alone / max(r["alone_cpu_ms"] for r in pair), 3),
            "n2_alone_over_pair_min": round(max(r["alone_cpu_ms_min"] for r in two) / max(r["alone_cpu_ms_min"] for r in pair), 3),
            "rel_l2_n2_vs_n1": max(err)}


def _table(rec: dict) -> str:
    rows = ([("N=1 diffusers", rec["n1"])] + [(f"N=1 diffusers, 2 copies: {r['rank']}", r) for r in rec["n1_pair"]]
            + [(f"N=2 PatchRay rank {r['rank']}", r) for r in rec["n2"]])
    lines = [f"{rec['preset']} hidden {rec['hidden']}, {rec['n1']['blocks']} blocks, grid {rec['grid'][1]}x{rec['grid'][2]}, "
             f"{rec['text']} text tokens, mode {rec['mode']}",
             "| run | CPU ms/call, alone (turns; sum of per-stage medians / minima) | CPU ms/call, ranks at once | of it in collectives | issue ms/call (CPU - "
             "collectives) | wall ms/call | torch calls | py calls | PatchRay calls | routed torch calls |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['alone_cpu_ms']:.1f} / {r['alone_cpu_ms_min']:.1f} | {r['cpu_ms']:.1f} | {r['comm_cpu_ms']:.1f} | {r['issue_ms']:.1f} | {r['wall_ms']:.1f} | "
                     f"{r['torch_calls']} | {r['py_calls']} | {r['patchray_calls']} | {r['routed_calls']} |")
    lines.append(f"N=2 / N=1 CPU per call, alone (turns), against the two copies switching where the ranks do: "
                 f"{rec['n2_alone_over_pair']:.3f} (medians), {rec['n2_alone_over_pair_min']:.3f} (minima); against N=1 "
                 f"in one process: {rec['n2_alone_over_n1']:.3f} / {rec['n2_alone_over_n1_min']:.3f}; ranks at once: {rec['n2_over_n1_cpu']:.3f} (N=1 alone), {rec['n2_over_n1_pair_cpu']:.3f} (2 copies "
                 f"at once); issue time (collectives excluded): {rec['n2_issue_over_n1']:.3f} / {rec['n2_issue_over_n1_pair']:.3f}; "
                 f"rel L2 N=2 vs N=1: {rec['rel_l2_n2_vs_n1']:.1e}")
    return "\n".join(lines)


def summary(paths: List[str]) -> str:
    """One line per saved record (``--out`` files): the headline figures side by side."""
    lines = ["| file | N=1 CPU ms/call (one process) | N=1 two copies | N=2 PatchRay rank | N=2 / two copies (medians, "
             "minima) | torch calls N=1 / N=2 | Python calls N=1 / N=2 | PatchRay calls | routed torch calls |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            for rec in json.load(f):
                one, pair, two = rec["n1"], rec["n1_pair"], rec["n2"]
                worst = max(two, key=lambda r: r["alone_cpu_ms"])
                p = max(pair, key=lambda r: r["alone_cpu_ms"])
                lines.append(
                    f"| {os.path.basename(path)} | {one['alone_cpu_ms']:.1f} / {one['alone_cpu_ms_min']:.1f} | "
                    f"{p['alone_cpu_ms']:.1f} / {p['alone_cpu_ms_min']:.1f} | {worst['alone_cpu_ms']:.1f} / "
                    f"{worst['alone_cpu_ms_min']:.1f} | {rec['n2_alone_over_pair']:.2f}, {rec['n2_alone_over_pair_min']:.2f} | "
                    f"{one['torch_calls']} / {worst['torch_calls']} | {one['py_calls']} / {worst['py_calls']} | "
                    f"{worst['patchray_calls']} | {worst['routed_calls']} |")
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
    ap.add_argument("--summary", nargs="+", metavar="JSON", help="only print the headline figures of saved records")
    a = ap.parse_args(argv)
    if a.summary:
        print(summary(a.summary))
        return
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
