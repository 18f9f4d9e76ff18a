"""Speed-weighted bands against equal bands, on ranks of unequal speed: the wall-clock figure and its check.

``python -m tools.dev.balance_bench --threads 2 1 --out results/balance``

Design decisions:

* **Ranks of unequal speed on one machine**: CPU ranks with different thread counts (``spawn.run_ranks``'s
  ``threads``), the stand-in for a mixed rig (a 4090 beside a 3090) on a machine without GPUs. Each rank measures its
  speed with the probe workload (``topology.throughput``), the ranks agree on the figures, and every rank derives
  the same band table from them.
* **Interleaved rounds**: each round decodes once with equal bands and once with speed-weighted bands, in
  alternating order, so load from other processes on a shared machine falls on both alike. A round's time is the
  slowest rank's, from a barrier to the end of its ``row_decode`` (the image gathered on rank 0).
* **Exactness checked in the same run**: rank 0 decodes the unsharded reference alone (the others wait) and both
  row decodes are compared with it (fp32; row mode differs from it only in summation order).
* Wall-clock figures go to JSON, a PNG and a README next to them; no unit test asserts them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import List, Optional, Sequence

import torch

__all__ = ["balance_rank", "run_balance", "main"]


def _pin_and_compete(rank: int, competitors: int) -> List["subprocess.Popen"]:
    """Pin this rank to core ``rank`` and start ``competitors`` busy processes pinned to the same core.

    A rank sharing its core with one spinning process gets about half of it: the stand-in for a card of half the
    speed that holds on a quiet machine of few cores, where extra threads do not (they compete for the same cores
    as the other rank). The caller terminates the processes.
    """
    import subprocess

    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("--share-core needs Linux CPU affinity (os.sched_setaffinity)")
    os.sched_setaffinity(0, {rank})
    spin = f"import os\nos.sched_setaffinity(0, {{{rank}}})\nwhile True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(competitors)]


def balance_rank(ctx, family: str, size: str, height: int, width: int, rounds: int, timeout_s: float,
                 nice: Sequence[int] = (), share_core: Sequence[int] = ()) -> dict:
    """One rank's part: speeds, both band tables, interleaved timed decodes, the reference check on rank 0.

    ``nice``: per-rank niceness increments (this rank process's own scheduling priority; lowering it needs no
    privilege). On a machine busy with other work the scheduler's shares follow priority, not thread count.
    ``share_core``: per rank, busy processes sharing its core (ranks pinned one per core; see
    :func:`_pin_and_compete`); empty: no pinning.
    """
    if nice and nice[ctx.rank]:
        os.nice(int(nice[ctx.rank]))
    spinners = _pin_and_compete(ctx.rank, int(share_core[ctx.rank])) if share_core else []
    try:
        return _balance_rank(ctx, family, size, height, width, rounds, timeout_s, share_core)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait(timeout=10)


def _balance_rank(ctx, family, size, height, width, rounds, timeout_s, share_core) -> dict:
    from patchray.distributed.comm import all_gather_object, barrier, bounded_barrier
    from patchray.distributed.bands import row_bands
    from patchray.distributed.topology.throughput import rank_speeds_task, speed_weights
    from patchray.distributed.vae.families import build_vae, latent_shape
    from patchray.distributed.vae.row import row_decode

    speeds = rank_speeds_task(ctx)
    weights = speed_weights(speeds)
    with torch.no_grad():
        vae = build_vae(family, size=size, seed=0)
        z = torch.randn(latent_shape(family, height, width, 1, batch=1, size=size), generator=torch.Generator().manual_seed(1))
        tables = {"equal": None, "speed": weights}
        bands = {k: row_bands(z.shape[-2], ctx.world_size, weights=w) for k, w in tables.items()}
        outputs = {}
        for name, w in tables.items():  # warm-up, and the outputs compared below
            outputs[name] = row_decode(vae, z, ctx, weights=w)
        times = {"equal": [], "speed": []}
        for i in range(rounds):
            order = ("equal", "speed") if i % 2 == 0 else ("speed", "equal")
            for name in order:
                barrier(ctx)
                t0 = time.perf_counter()
                row_decode(vae, z, ctx, weights=tables[name])
                times[name].append((time.perf_counter() - t0) * 1e3)
        check = None
        if ctx.rank == 0:  # the reference on rank 0 alone: the others wait at one bounded barrier
            t0 = time.perf_counter()
            ref = vae.decode(z).sample
            ref_ms = (time.perf_counter() - t0) * 1e3
            check = {name: float((out - ref).abs().max()) for name, out in outputs.items()}
            check["equal_vs_speed"] = float((outputs["equal"] - outputs["speed"]).abs().max())
            check["reference_ms_rank0_alone"] = round(ref_ms, 1)
        bounded_barrier(ctx, timeout_s)
    every = all_gather_object({"times": times, "threads": torch.get_num_threads(), "nice": os.nice(0),
                               "share_core": int(share_core[ctx.rank]) if share_core else 0}, ctx)
    return {"speeds": speeds, "weights": weights, "bands": bands, "by_rank": every, "check": check,
            "latent_shape": list(z.shape)}


def _summary(rank0: dict, args) -> dict:
    by_rank = rank0["by_rank"]
    rounds = {}
    for name in ("equal", "speed"):
        per_round = [max(r["times"][name][i] for r in by_rank) for i in range(len(by_rank[0]["times"][name]))]
        rounds[name] = {"round_ms": [round(t, 1) for t in per_round], "median_ms": round(statistics.median(per_round), 1),
                        "by_rank_median_ms": [round(statistics.median(r["times"][name]), 1) for r in by_rank]}
    speedup = rounds["equal"]["median_ms"] / rounds["speed"]["median_ms"]
    # each round decodes both ways back to back: the ratio within a round cancels load that drifts between rounds
    paired = [e / v for e, v in zip(rounds["equal"]["round_ms"], rounds["speed"]["round_ms"])]
    return {
        "benchmark": "patchray-balance",
        "family": args.family, "size": args.size, "height": args.height, "width": args.width,
        "latent_shape": rank0["latent_shape"], "world_size": len(by_rank), "device": "cpu", "backend": "gloo",
        "threads_by_rank": [r["threads"] for r in by_rank],
        "niceness_by_rank": [r["nice"] for r in by_rank],
        "core_competitors_by_rank": [r.get("share_core", 0) for r in by_rank],
        "speeds_gflops_by_rank": [round(s, 2) for s in rank0["speeds"]],
        "weights": list(rank0["weights"]),
        "bands": {k: [list(b) for b in v] for k, v in rank0["bands"].items()},
        "rounds": args.rounds, "equal": rounds["equal"], "speed": rounds["speed"],
        "speedup_speed_over_equal": round(speedup, 3),
        "speedup_paired_rounds": [round(p, 3) for p in paired],
        "speedup_paired_median": round(statistics.median(paired), 3),
        "max_abs_vs_unsharded": {k: rank0["check"][k] for k in ("equal", "speed")},
        "max_abs_equal_vs_speed": rank0["check"]["equal_vs_speed"],
        "reference_ms_rank0_alone": rank0["check"]["reference_ms_rank0_alone"],
        "modelled": False,
        "note": "wall clock of the slowest rank per round (barrier to the end of row_decode), median over rounds; "
                "equal and speed rounds interleaved; CPU ranks on one machine of unequal speed (thread counts, "
                "niceness, or busy processes sharing a rank's core)",
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "command": "python -m tools.dev.balance_bench " + " ".join(args.argv),
    }


def _chart(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    names = ["equal", "speed"]
    med = [summary[n]["median_ms"] for n in names]
    ax1.bar(names, med, color=["#888888", "#2a7ab9"])
    for x, v in enumerate(med):
        ax1.text(x, v * 1.01, f"{v:.0f} ms", ha="center", fontsize=9)
    ax1.set_ylabel("decode wall time (ms, median)")
    ax1.set_title(f"{summary['family']} {summary['height']}x{summary['width']}, threads {summary['threads_by_rank']}, "
                  f"nice {summary['niceness_by_rank']}, core competitors {summary['core_competitors_by_rank']}: "
                  f"{summary['speedup_speed_over_equal']:.2f}x", fontsize=9)
    width = 0.38
    ranks = range(summary["world_size"])
    for k, (n, color) in enumerate(zip(names, ["#888888", "#2a7ab9"])):
        ax2.bar([r + (k - 0.5) * width for r in ranks], summary[n]["by_rank_median_ms"], width, label=f"{n} bands "
                f"{[b[1] - b[0] for b in summary['bands'][n]]} rows", color=color)
    ax2.set_xticks(list(ranks))
    ax2.set_xticklabels([f"rank {r} ({t} thr, nice {n})" for r, t, n in
                         zip(ranks, summary["threads_by_rank"], summary["niceness_by_rank"])], fontsize=8)
    ax2.set_ylabel("rank's time (ms, median)")
    ax2.set_title("per rank: the slowest rank sets the pace", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_balance(args) -> dict:
    import importlib

    from patchray.distributed.spawn import run_ranks

    # OpenMP threads that wait for a descheduled partner should sleep, not spin: on a shared machine a spinning
    # thread burns its own rank's share of the cores (set before the ranks start; recorded in the JSON)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load_before = os.getloadavg()
    # the rank function by its importable name (run as ``-m``, this module is ``__main__`` in the driver only)
    as_module = __name__ == "__main__" and __spec__ is not None
    rank_fn = importlib.import_module(__spec__.name).balance_rank if as_module else balance_rank
    results = run_ranks(rank_fn, len(args.threads), args.family, args.size, args.height, args.width, args.rounds,
                        args.timeout_s, tuple(args.nice or ()), tuple(args.share_core or ()), threads=tuple(args.threads),
                        timeout_s=args.timeout_s)
    summary = _summary(results[0], args)
    summary["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    summary["load_average_1min"] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2),
                                    "cores": os.cpu_count()}
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m tools.dev.balance_bench", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="compute threads of each CPU rank (one per rank)")
    p.add_argument("--nice", type=int, nargs="+", default=None,
                   help="niceness increment of each rank process (one per rank): unequal speed on a machine busy with "
                        "other work, where thread counts stop mattering")
    p.add_argument("--share-core", type=int, nargs="+", default=None,
                   help="busy processes sharing each rank's core (one count per rank; ranks pinned one per core): "
                        "e.g. 0 1 makes rank 1 about half as fast, on a quiet machine with a core per rank")
    p.add_argument("--family", default="kl")
    p.add_argument("--size", default="full", choices=["full", "tiny"])
    p.add_argument("--height", type=int, default=192)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="folder for balance.json, balance.png")
    args = p.parse_args(argv)
    args.argv = argv
    if len(args.threads) < 2 or min(args.threads) < 1:
        p.error("--threads needs one count >= 1 for each of at least 2 ranks")
    if args.nice is not None and (len(args.nice) != len(args.threads) or min(args.nice) < 0):
        p.error("--nice needs one increment >= 0 per rank (as many as --threads)")
    if args.share_core is not None:
        if len(args.share_core) != len(args.threads) or min(args.share_core) < 0:
            p.error("--share-core needs one count >= 0 per rank (as many as --threads)")
        if len(args.threads) > (os.cpu_count() or 1):
            p.error(f"--share-core pins one rank per core: {len(args.threads)} ranks need as many cores (this machine has {os.cpu_count()})")
    summary = run_balance(args)
    print(json.dumps({k: summary[k] for k in ("threads_by_rank", "speeds_gflops_by_rank", "weights", "bands",
                                              "speedup_speed_over_equal", "max_abs_vs_unsharded")}, indent=1))
    print(f"equal {summary['equal']['median_ms']} ms, speed {summary['speed']['median_ms']} ms: "
          f"{summary['speedup_speed_over_equal']}x (median of paired rounds {summary['speedup_paired_median']}x)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "balance.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        _chart(summary, os.path.join(args.out, "balance.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
