"""``python -m patchray <command>``: one entry point, each command implemented next to its subject.

Commands are looked up lazily so ``python -m patchray plan`` does not import Ray, and
``python -m patchray --help`` works even where an optional piece is missing.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import List, Optional

__all__ = ["main", "COMMANDS"]

#: command -> (module, function, one-line help)
COMMANDS = {
    "bench": ("patchray.distributed.bench.vae_bench", "bench_main", "VAE benchmark (docs/benchmark.md): JSON + PNG chart"),
    "sample-bench": ("patchray.distributed.bench.sample_bench", "sample_bench_main", "patch-parallel / OTIL sampling benchmark"),
    "probe": ("patchray.distributed.topology.cli", "probe_main", "form the cluster, check collectives, P2P topology and advice"),
    "plan": ("patchray.distributed.vae.planner", "plan_main", "tile plans (coarse / balanced / fine) and the Pareto frontier"),
    "row-memory": ("patchray.distributed.vae.row_memory", "main", "per-rank peak CUDA memory of row mode vs the band 1/N baseline"),
    "exactness": ("patchray.distributed.sampling.exactness", "main", "the runtime exactness check's verdicts (--clear forgets them)"),
    "auto-plan": ("patchray.distributed.bench.auto_plan", "main", "parallelism auto's measured model calls (--clear forgets them)"),
    "plan-rig": ("patchray.distributed.bench.rig_cli", "main", "MODELLED s/step and memory of every mode on N cards of one kind"),
}


def _usage() -> str:
    lines = ["usage: python -m patchray <command> [options]", "", "commands:"]
    for name, (_, _, text) in COMMANDS.items():
        lines.append(f"  {name:<13} {text}")
    lines.append("")
    lines.append("Run `python -m patchray <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module, func, _ = COMMANDS[command]
    fn = getattr(importlib.import_module(module), func)
    return int(fn(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
