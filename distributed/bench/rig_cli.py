"""``python -m patchray plan-rig``: the rig model's command line (MODELLED figures; docs/rig-model.md).

    python -m patchray plan-rig --card rtx4090 --ranks 2 --link pcie4_x16_no_p2p --model flux1 --height 1024 --width 1024
    python -m patchray plan-rig --card rtx5090 --ranks 8 --link pcie5_x16_no_p2p --model wan22_a14b \\
        --height 480 --width 832 --frames 81 --steps 20 --json
    python -m patchray plan-rig --list
    python -m patchray plan-rig --calibrate --out results/rig-model/calibration.json --doc docs/rig-model.md
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m patchray plan-rig",
                                 description="MODELLED s/step and memory per rank of every PatchRay mode on N cards "
                                             "(compute measured on one H200, scaled by datasheet ratios)")
    ap.add_argument("--card", help="card profile (--list shows them)")
    ap.add_argument("--ranks", type=int, help="cards (one rank each)")
    ap.add_argument("--link", help="link between the cards (--list shows them)")
    ap.add_argument("--model", help="flux1, wan21_14b, wan22_a14b or qwen_image")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int, default=1, help="video frames (Wan: 1 + 4k; images: 1)")
    ap.add_argument("--steps", type=int, default=None, help="sampling steps (default: the model's)")
    ap.add_argument("--weights", default="bf16",
                    help="bf16; fp8 (fp8 GEMMs where the card has FP8 tensor cores, else stored only); fp8-storage "
                         "(fp8 bytes, bf16 GEMMs: ComfyUI's default for fp8 checkpoints)")
    ap.add_argument("--kernels", default="eager", help="eager (what ComfyUI runs) or compiled (FLUX.1 only)")
    ap.add_argument("--attention", default="auto",
                    help="the sequence attention of the sharding and cfg+sequence rows (auto: the fastest)")
    ap.add_argument("--calls-per-step", type=int, default=None,
                    help="model calls per step (default: the model's; 1 models a CFG-free run)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--list", action="store_true", help="list the cards, links and models")
    ap.add_argument("--calibrate", action="store_true", help="compare the model with published measurements")
    ap.add_argument("--out", default="results/rig-model/calibration.json", help="--calibrate: the JSON (README.md beside it)")
    ap.add_argument("--doc", default=None, help="--calibrate: also refresh the generated table in this markdown file")
    return ap


def _list() -> str:
    from .rig_cards import CARDS
    from .rig_compute import MODELS
    from .rig_links import RIG_LINKS

    lines = ["cards (dense bf16 / fp8 TFLOP/s, memory, bandwidth):"]
    for c in CARDS.values():
        lines.append(f"  {c.key:<12} {c.title:<45} {c.bf16_tflops:>7g} / {c.fp8_tflops or '-':>6}  {c.memory_gib:>4g} GiB  "
                     f"{c.bandwidth_gbps:>5g} GB/s  PCIe {c.pcie_gen}.0 x{c.pcie_lanes}" + (f", {c.nvlink}" if c.nvlink else ""))
    lines.append("links (achievable GB/s one way; via host = staged through host memory, counted twice):")
    for p in RIG_LINKS.values():
        lines.append(f"  {p.name:<22} {p.bandwidth_gbps:>7g} GB/s {p.latency_us:>5g} us{'  via host' if p.via_host else ''}")
    lines.append("models:")
    for m in MODELS.values():
        h, w, f = m.base
        lines.append(f"  {m.key:<12} {m.title} (measured at {h}x{w}" + (f"x{f}" if f > 1 else "") + ")")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print(_list())
        return 0
    if args.calibrate:
        from .rig_calibration import calibration_table, write

        cal = write(args.out, args.doc)
        print(calibration_table(cal))
        print(f"\nwrote {args.out}" + (f" and refreshed {args.doc}" if args.doc else ""))
        return 0
    missing = [f"--{k}" for k in ("card", "ranks", "link", "model", "height", "width") if getattr(args, k) is None]
    if missing:
        print(f"plan-rig: missing {', '.join(missing)} (or --list, --calibrate)", file=sys.stderr)
        return 2
    from .rig_model import format_plan, plan

    try:
        doc = plan(args.card, args.ranks, args.link, args.model, args.height, args.width, args.frames, args.steps,
                   args.weights, args.kernels, args.attention, calls_per_step=args.calls_per_step)
    except ValueError as exc:
        print(f"plan-rig: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=1) if args.json else format_plan(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
