"""``python -m patchray.distributed.bench.dit_bench``: full-size DiT denoisers, sequence- and CFG-parallel (JSON + PNG).

For each preset (a diffusers DiT class at the configuration of a released checkpoint, random weights) and each rank
count N it measures PatchRay's exact modes on N rank processes sharing one device (gloo):

* ``none`` (N = 1): the stock model, one rank;
* ``gathered`` / ``ulysses``: sequence parallelism (``sampling.dit.parallelize_dit``) over all N ranks;
* ``cfg``: cond and uncond on two rank groups (``sampling.split.cfg_parallel``), each group sequence-parallel
  (gathered) over N / 2 ranks when N > 2 ("cfg x sequence").

Per case: the bytes per step (comm's accounting of one logged call: counted bytes per operation, and the bytes each
rank puts on its link), the per-rank peak device memory, each rank's compute per call **measured alone** (the ranks
take turns between collectives, ``turns.take_turns``; on CUDA the GPU time with the launch queue prefilled, and
the CPU's issue time beside it: ``--alone-clock``), and the **modelled** latency per step for every link profile of
``topology.links`` (per stage the slowest rank's compute, the CPU's issue time instead where it is longer per call,
+ per collective the slowest rank's ``latency + bytes / bandwidth``, doubled via host: ``linkmodel.model_alone``),
with the speed-up over one rank's full step (N = 1, measured alone). An exactness check compares one call's output
with N = 1's (relative L2).

The code is in four modules, one job each: :mod:`.dit_models` (presets, random-weight models, inputs, cases),
:mod:`.dit_rank` (the rank body: turn-taking calls, the per-case record), :mod:`.dit_report` (table, chart, the
no-device estimate) and this one (the driver and the command line). Everything modelled is labelled so
(``modelled: true``, the chart's titles): N ranks on one GPU measure compute and memory, not multi-GPU latency.

Usage::

    python -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --out results/h200/dit/dit_h200.json
    python -m patchray.distributed.bench.dit_bench --size tiny --device cpu --ranks 2 --out /tmp/dit.json   # CPU smoke run
    # several GPUs, one rank each (NCCL): measured latency beside the modelled one
    python -m patchray.distributed.bench.dit_bench --device cuda --gpu-per-rank --ranks 4 --concurrent --out x4.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

import torch

from .dit_models import (DEFAULT_MODES, MODES, PRESETS, TEXT_TOKENS, Case, DiTPreset, _constructor_tensors, build_random, dit_shape,
                         make_inputs, plan_cases, ranks_that_fit, token_share)
from .dit_rank import BF16_TOLERANCE, FP32_TOLERANCE, SHOWN_PROFILES, bench_rank, write_doc
from .dit_report import BASELINE_CALL_MS, GOALS, estimate, format_estimate, format_table, write_chart

__all__ = ["DiTPreset", "PRESETS", "MODES", "GOALS", "TEXT_TOKENS", "Case", "build_random", "make_inputs", "plan_cases",
           "dit_shape", "run_dit_bench", "estimate", "token_share", "BASELINE_CALL_MS", "format_estimate",
           "write_chart", "format_table", "ranks_that_fit", "main", "_constructor_tensors", "SHOWN_PROFILES"]


def run_dit_bench(presets: Sequence[str], *, ranks: int = 4, ns: Sequence[int] = (1, 2, 4), modes: Sequence[str] = DEFAULT_MODES,
                  size: str = "full", device: str = "cuda", dtype: Optional[str] = None, warmup: Optional[int] = None,
                  iters: Optional[int] = None, deadline_s: float = 1e9, out: Optional[str] = None,
                  timeout_s: float = 900.0, watchdog_s: float = 0.0, cfg_inner: str = "gathered",
                  alone_clock: str = "prefilled", profile_dir: Optional[str] = None,
                  compile_mode: Optional[str] = None, compile_attention: str = "compiled",
                  gpu_per_rank: bool = False, backend: Optional[str] = None, concurrent: bool = False,
                  modulation: str = "shared") -> dict:
    """Run the benchmark on ``ranks`` spawned rank processes and return the report (see the module docstring).

    ``gpu_per_rank``: rank r on ``cuda:r`` (a multi-GPU machine; ``backend`` defaults to NCCL there, gloo otherwise).
    ``concurrent``: every case also runs with the ranks at once and records the measured latency beside the
    modelled one (CPU ranks, or one GPU per rank: ranks sharing one GPU would measure nothing a multi-GPU rig sees).
    ``modulation``: ``shared`` (the sampler's default: the blocks' adaLN layers computed once across the sequence
    ranks) or ``whole`` (every rank computes them in full, as before that existed: for comparisons).

    Raises:
        ValueError: an unknown preset or mode, a rank count below 1, ``ns`` above ``ranks``, or a placement that
            cannot give the figures asked for (before any rank starts).
    """
    from ..spawn import run_ranks

    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown preset {unknown[0]!r}; choose from {sorted(PRESETS)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode {bad[0]!r}; choose from {list(MODES)}")
    if ranks < 1 or any(n < 1 or n > ranks for n in ns):
        raise ValueError(f"every N in --ns must be between 1 and --ranks ({ranks}); got {list(ns)}")
    if cfg_inner not in ("gathered", "ulysses"):
        raise ValueError(f"cfg_inner must be 'gathered' or 'ulysses' (got {cfg_inner!r})")
    if size not in ("full", "tiny"):
        raise ValueError(f"size must be 'full' or 'tiny' (got {size!r})")
    from .turns import ALONE_CLOCKS, resolve_clock

    if alone_clock not in ALONE_CLOCKS:
        raise ValueError(f"alone_clock must be one of {list(ALONE_CLOCKS)} (got {alone_clock!r})")
    from ..sampling.compiled import ATTENTION_SCOPES, COMPILE_MODES

    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {list(COMPILE_MODES)} (got {compile_mode!r})")
    if compile_attention not in ATTENTION_SCOPES:
        raise ValueError(f"compile_attention must be one of {list(ATTENTION_SCOPES)} (got {compile_attention!r})")
    if modulation not in ("shared", "whole"):
        raise ValueError(f"modulation must be 'shared' or 'whole' (got {modulation!r})")
    kind = "cuda" if device == "cuda" else "cpu"
    backend = backend or ("nccl" if gpu_per_rank else "gloo")
    if gpu_per_rank and kind != "cuda":
        raise ValueError("--gpu-per-rank needs --device cuda")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl' (got {backend!r})")
    if backend == "nccl" and not gpu_per_rank and ranks > 1:
        raise ValueError("NCCL refuses two ranks on one GPU: use --backend gloo, or --gpu-per-rank on a multi-GPU machine")
    if concurrent and kind == "cuda" and not gpu_per_rank and ranks > 1:
        raise ValueError("--concurrent on ranks sharing one GPU measures the ranks competing for it, not N GPUs: "
                         "add --gpu-per-rank on a machine with a GPU per rank, or use CPU ranks")
    dtype = dtype or ("bf16" if kind == "cuda" else "fp32")
    doc = {
        "benchmark": "dit-bench",
        "schema": 1,
        "size": size,
        "dtype": dtype,
        "device": kind,
        "ranks_on_one_device": 1 if gpu_per_rank else ranks,
        "placement": "one GPU per rank" if gpu_per_rank else ("CPU ranks" if kind == "cpu" else "ranks share one GPU"),
        "backend": backend,
        "concurrent": bool(concurrent),
        "presets": list(presets),
        "ns": list(ns),
        "modes": list(modes),
        "cfg_inner": cfg_inner,
        "compile": compile_mode,
        "compile_attention": compile_attention if compile_mode else None,
        "modulation": modulation,
        "alone_clock": resolve_clock(torch.device(kind), alone_clock),
        "modelled": ["records[].modelled_step_ms", "records[].speedup_modelled"],
        "measured": (["records[].measured_step_ms", "records[].speedup_measured", "records[].model_error_vs_measured"]
                     if concurrent else []),
        "method": ("N rank processes share one device (gloo). compute: each rank's compute per call measured alone "
                   "(ranks take turns between collectives; CUDA events on GPU, with alone_clock gpu-prefilled each "
                   "stage's GPU time behind a prefilled launch queue and its CPU issue time beside it), per stage the "
                   "slowest rank; per call the longer of the GPU time and the CPU issue time (launch bound). modelled "
                   "step latency = calls_per_step x (that compute + per collective "
                   "the slowest rank's latency + wire_bytes / bandwidth, doubled when staged through host). "
                   "speed-up = N=1 reference step (measured alone) / modelled step. Peak memory: "
                   "torch.cuda.max_memory_allocated per rank process, weights included."
                   + (" measured (--concurrent): after the turn-taking calls, the same call with every rank at once "
                      "after a barrier; per call the slowest rank's wall time (median over the timed calls); "
                      "model_error_vs_measured = modelled step / measured step - 1, per link profile and for "
                      "measured_collectives (the alone compute + the collectives' times measured in the "
                      "turn-taking run)." if concurrent else "")),
        "exactness_note": ("relative L2 of one call's output vs N=1's on the same inputs. bf16 tolerance "
                           f"{BF16_TOLERANCE:g}: bands change only the row count of every GEMM (kernel tiling) and the "
                           "order of the softmax sum over keys, each a rounding of unit 2^-8 = 3.9e-3 per operation; "
                           "uncorrelated over 40-60 residual blocks they stay below ~sqrt(L) x 3.9e-3 = 2.5e-2 to 3e-2, "
                           "while a structural error (wrong band, missing K/V, misplaced RoPE) is of the order of "
                           f"the output itself (> 0.3). fp32 tolerance {FP32_TOLERANCE:g}."),
        "goals": {"nvlink": "speed-up >= 1.9 at 2 ranks, >= 3.6 at 4 (FLUX.1, Wan 2.1)",
                  "pcie4_x16_no_p2p": "CFG-parallel >= 1.9 at 2 ranks"},
    }
    plan = dict(presets=list(presets), ns=sorted(set(ns)), modes=list(modes), size=size, dtype=dtype, warmup=warmup,
                iters=iters, deadline_s=deadline_s, out=out, doc=doc, watchdog_s=watchdog_s, cfg_inner=cfg_inner,
                alone_clock=alone_clock, profile_dir=profile_dir, compile=compile_mode,
                compile_attention=compile_attention, gpu_per_rank=gpu_per_rank, concurrent=concurrent,
                modulation=modulation)
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
    started = time.time()
    results = run_ranks(bench_rank, ranks, plan, device=kind, backend=backend, timeout_s=timeout_s, gpu_per_rank=gpu_per_rank)
    print(f"[dit_bench] ranks done after {time.time() - started:.1f} s", flush=True)
    report = results[0]
    report["wall_s"] = round(time.time() - started, 1)
    try:
        from . import provenance

        report["provenance"] = provenance.collect(torch.device(kind))
    except Exception as exc:  # provenance is informative only
        report["provenance"] = {"error": f"{type(exc).__name__}: {exc}"}
    write_doc(out, report)
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patchray.distributed.bench.dit_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", default=None, help=f"preset(s) (repeatable); default all: {', '.join(PRESETS)}")
    ap.add_argument("--ranks", type=int, default=4, help="rank processes on the one device (the largest N)")
    ap.add_argument("--ns", default="1,2,4", help="rank counts to measure, comma-separated (each <= --ranks)")
    ap.add_argument("--mode", action="append", default=None, help=f"modes (repeatable) of {', '.join(MODES)}; default {', '.join(DEFAULT_MODES)}")
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls per case (default per preset)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default per preset)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip the cases that would start after this many seconds")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on every collective and on the whole run")
    ap.add_argument("--cfg-inner", choices=["gathered", "ulysses"], default="gathered",
                    help="attention mode inside each CFG group when N > 2 (CFG x sequence)")
    ap.add_argument("--estimate", action="store_true",
                    help="no ranks, no device: the step latency ESTIMATED from one rank's measured call (BASELINE_CALL_MS) "
                         "x the busiest rank's token share, plus the cost model's bytes over each link profile")
    ap.add_argument("--watchdog-s", type=float, default=0.0,
                    help="every rank prints its stack to stderr after this many seconds, repeatedly (0: off)")
    ap.add_argument("--alone-clock", choices=["prefilled", "idle"], default="prefilled",
                    help="CUDA turn-taking clock: prefilled (each stage's GPU time with the launch queue filled ahead of "
                         "it, and the CPU's issue time beside it; the model takes the longer per call) or idle (each "
                         "stage timed from an idle GPU, launch gaps included: the earlier clock)")
    ap.add_argument("--text-tokens", choices=["replicated", "sharded"], default=None,
                    help=f"--estimate only: text tokens of joint-attention models replicated on every sequence rank or "
                         f"split across them (default: dit_models.TEXT_TOKENS = {TEXT_TOKENS!r})")
    ap.add_argument("--compile", default=None, choices=["default", "max-autotune-no-cudagraphs"],
                    help="compile every transformer block (torch.compile around the attention exchange) on every N, "
                         "N = 1 included; the warm-up calls compile")
    ap.add_argument("--compile-attention", default="compiled", choices=["compiled", "eager"],
                    help="with --compile: compile the attention modules' projections too, the attention call one opaque "
                         "operation (compiled), or keep each attention module eager (eager)")
    ap.add_argument("--profile-dir", default=None,
                    help="after each case's timed calls, one more call per rank under torch.profiler (not timed); its "
                         "kernels by name and by class (GEMM, attention, copies, elementwise...) go to this folder")
    ap.add_argument("--gpu-per-rank", action="store_true",
                    help="rank r on GPU r (a multi-GPU machine; NCCL unless --backend gloo); default: every rank on GPU 0")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default nccl with --gpu-per-rank, else gloo")
    ap.add_argument("--concurrent", action="store_true",
                    help="also run every case with the ranks at once and record the measured step and speed-up beside "
                         "the modelled ones (CPU ranks or --gpu-per-rank)")
    ap.add_argument("--modulation", choices=["shared", "whole"], default="shared",
                    help="the blocks' adaLN modulation layers: computed once across the sequence ranks (shared, the "
                         "sampler's default) or in full on every rank (whole, for comparison)")
    ap.add_argument("--out", help="JSON report path (written after every case); the chart goes next to it (.png)")
    ap.add_argument("--chart-from", help="only redraw the chart (and print the table) of an existing JSON report")
    args = ap.parse_args(argv)
    if args.chart_from:
        with open(args.chart_from) as f:
            report = json.load(f)
        png = write_chart(report, os.path.splitext(args.out or args.chart_from)[0] + ".png")
        print(format_estimate(report) if report.get("estimate") else format_table(report))
        print(f"wrote {png}")
        return 0
    presets = [p for item in (args.preset or list(PRESETS)) for p in item.split(",") if p]
    modes = [m for item in (args.mode or list(DEFAULT_MODES)) for m in item.split(",") if m]
    ns = [int(x) for x in args.ns.split(",") if x]
    if args.estimate:
        doc = estimate(presets, ns, modes, cfg_inner=args.cfg_inner, text_tokens=args.text_tokens)
        print(format_estimate(doc))
        if args.out:
            write_doc(args.out, doc)
            print(f"wrote {args.out} and {write_chart(doc, os.path.splitext(args.out)[0] + '.png')}")
        return 0
    if args.text_tokens is not None:
        ap.error("--text-tokens applies to --estimate only: measured runs lay out the text as the sampler does "
                 "(split across the sequence ranks under full_sync)")
    report = run_dit_bench(presets, ranks=args.ranks, ns=ns, modes=modes, size=args.size, device=args.device,
                           dtype=args.dtype, warmup=args.warmup, iters=args.iters, deadline_s=args.deadline_s,
                           out=args.out, timeout_s=args.timeout_s, watchdog_s=args.watchdog_s, cfg_inner=args.cfg_inner,
                           alone_clock=args.alone_clock, profile_dir=args.profile_dir, compile_mode=args.compile,
                           compile_attention=args.compile_attention, gpu_per_rank=args.gpu_per_rank,
                           backend=args.backend, concurrent=args.concurrent, modulation=args.modulation)
    print(format_table(report))
    if args.out:
        try:
            png = write_chart(report, os.path.splitext(args.out)[0] + ".png")
            print(f"wrote {args.out} and {png}")
        except ImportError as exc:  # a device image without matplotlib: redraw later with --chart-from
            print(f"wrote {args.out}; no chart ({exc}); redraw with --chart-from {args.out}")
    bad = [r for r in report["records"] if r.get("status") == "error" or not (r.get("exactness") or {}).get("ok", True)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
