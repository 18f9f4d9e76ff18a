"""Modelled traffic of sequence-parallel DiT sampling at full size (no model, no GPU): bytes and link time per step.

Design decision: the figures come from the runtime's cost function (``sampling.dit.step_cost``, whose counted
bytes the CPU tests check against comm's accounting of real runs) and the link profiles of
``topology.links``; nothing is measured here, and every number in the output is labelled ``modelled``. The
per-step compute of one rank is the companion measurement (one rank's compute measured alone); adding it to the
communication time below gives the modelled step latency.

Usage::

    python -m tools.dev.dit_cost --out results/dit-cost/dit_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from patchray.distributed.sampling.dit import FULL_SIZE_SHAPES, step_cost
from patchray.distributed.sampling.split import split_cost
from patchray.distributed.topology.links import LINK_PROFILES, model_latency_ms

__all__ = ["cost_table", "main"]

PROFILES = ("nvlink", "pcie4_x16_p2p", "pcie4_x16_no_p2p", "10gbe")


def cost_table(world_sizes: Sequence[int] = (2, 4), itemsize: int = 2) -> List[dict]:
    """One row per (shape, N, mode): modelled bytes and messages per step per rank, and link time per profile.

    Sequence-parallel rows evaluate one CFG branch per call (batch 1, both branches one after the other: the
    step's figures are twice the call's). CFG-parallel rows (2 groups) exchange each group's output once per step.
    """
    rows = []
    for name, shape in FULL_SIZE_SHAPES.items():
        for n in world_sizes:
            for mode in ("gathered", "ulysses", "auto"):
                if mode == "ulysses" and shape.heads % n:
                    continue
                per_call = step_cost(shape, n, mode, itemsize=itemsize, link="pcie4_x16_no_p2p")
                wire, msgs = 2 * per_call["wire_bytes"], 2 * per_call["messages"]  # cond + uncond
                rows.append({
                    "shape": name, "world_size": n, "split": "sequence", "mode": mode, "resolved": per_call["mode"],
                    "wire_mb_per_step": round(wire / 1e6, 1), "messages_per_step": msgs,
                    "comm_ms_per_step": {p: round(model_latency_ms(0.0, wire, msgs, p), 2) for p in PROFILES},
                    "modelled": True,
                })
            if n % 2 == 0:
                # CFG-parallel: 2 groups of n/2 sequence ranks; each group evaluates one branch
                inner = step_cost(shape, n // 2, "auto", itemsize=itemsize, link="pcie4_x16_no_p2p") if n > 2 else None
                latent = (shape.frames * shape.rows * shape.cols * shape.out_features,)
                ex = split_cost(latent, itemsize, 2, 2)
                wire = ex["wire_bytes"] + (inner["wire_bytes"] if inner else 0)
                msgs = ex["messages"] + (inner["messages"] if inner else 0)
                rows.append({
                    "shape": name, "world_size": n, "split": f"cfg2 x sequence{n // 2}",
                    "mode": inner["mode"] if inner else "none", "resolved": inner["mode"] if inner else "none",
                    "wire_mb_per_step": round(wire / 1e6, 1), "messages_per_step": msgs,
                    "comm_ms_per_step": {p: round(model_latency_ms(0.0, wire, msgs, p), 2) for p in PROFILES},
                    "modelled": True,
                })
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    rows = cost_table()
    for r in rows:
        links = "  ".join(f"{p} {r['comm_ms_per_step'][p]:8.1f}" for p in PROFILES)
        print(f"{r['shape']:22s} N={r['world_size']} {r['split']:18s} {r['mode'] + '->' + r['resolved']:18s} "
              f"{r['wire_mb_per_step']:9.1f} MB {r['messages_per_step']:4d} msgs  comm ms (modelled): {links}")
    if args.out:
        doc = {
            "command": "python -m tools.dev.dit_cost --out " + args.out,
            "note": "modelled from shapes (sampling.dit.step_cost, sampling.split.split_cost) and link profiles; "
                    "communication only, per rank per sampling step with CFG (two model evaluations), bf16",
            "profiles": {p: LINK_PROFILES[p]._asdict() for p in PROFILES},
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
