"""``python -m patchray sample-bench``: patch-parallel / OTIL sampling benchmark (JSON + PNG chart).

For one world size N it runs a single-rank reference and every preset (full_sync, displaced, otil_unsynced, otil,
balanced, plus the "beyond both papers" variants otil_c4 = OTIL + 4-bit residuals with error feedback,
otil_adaptive = OTIL with k chosen from the measured link bandwidth, and otil_cfghalf = OTIL whose CFG repair swaps
the whole completed half instead of the band), with split_batch on and off where N is even,
on the SDXL UNet architecture with synthetic (seeded random) weights, sampling with a plain Euler + CFG loop.

Per case it records: per-step latency (the slowest rank's), bytes per step by kind (halo, kv, groupnorm,
latent_blocks, output, cfg) and the asynchronous share, host synchronisation points per step (calls of
``Tensor.item/tolist/__bool__/__int__/__float__`` counted by wrapping them, the reference's count included for
comparison), agreement with the reference of the same seed (relative L2 of the final latent; PSNR of the latent
mapped to RGB with SDXL's latent-preview factors, peak = the reference preview's range) and a link-modelled
latency and speed-up for every profile of :mod:`patchray.distributed.bench.linkmodel`:

    step_ms = compute_ms + messages * latency + sync_bytes / bandwidth + max(0, async_bytes / bandwidth - compute_ms)

where compute_ms is the measured step time minus the host time inside communication calls, and async bytes (displaced
mode's halos/K/V/GroupNorm) overlap with compute as DistriFusion intends. Speed-up = reference step time (one
rank, no communication) / modelled step time.

Runs on the Ray cluster by default (``--launcher ray``); ``--launcher spawn`` uses torch.multiprocessing ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Dict, List, Optional

import torch

from .sample_report import format_table, write_chart
from .sample_summary import ALL_CASES, agreement, latent_preview  # noqa: F401  (public names of this command)
from .sample_summary import alone_steps as _alone_steps  # noqa: F401  (tests)
from .sample_summary import link_model as _link_model
from .sample_summary import summarise as _summarise

__all__ = ["sample_bench_main", "run_sample_bench", "ALL_CASES", "format_table", "write_chart"]

logger = logging.getLogger(__name__)

class HostSyncCounter:
    """Counts calls that force a host synchronisation on CUDA tensors (and would on any device)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.count = 0
        self._orig = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n, f in self._orig.items():

            def wrapper(*a, _f=f, **k):
                self.count += 1
                return _f(*a, **k)

            setattr(torch.Tensor, n, wrapper)
        return self

    def __exit__(self, *exc):
        for n, f in self._orig.items():
            setattr(torch.Tensor, n, f)


# ------------------------------------------------------------------------------------------------ rank side


def _model(tiny: bool, dtype, device):
    from ..sampling import sdxl

    key = ("sample_bench_unet", tiny, str(dtype), str(device))
    cache = None
    try:
        from ..cluster import rank_cache

        cache = rank_cache()
    except Exception:  # the spawn launcher has no actor cache
        cache = None
    if cache is not None and key in cache:
        return cache[key]
    unet = sdxl.build_unet(tiny, seed=0, dtype=dtype, device=device)
    if cache is not None:
        cache[key] = unet
    return unet


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_case(ctx, unet, plan, case: Optional[str], alone: bool = False) -> dict:
    """Sample once; ``case=None`` is the single-rank reference (unpatched model).

    ``alone``: the ranks take turns between collectives (:func:`.turns.take_turns`), each step's end closing a
    stage, so each rank's compute per step is measured with the device to itself (returned under ``"alone"``).
    """
    from ..comm import log_comm
    from ..sampling import sdxl
    from ..sampling.config import preset
    from ..sampling.denoiser import PatchParallelDenoiser

    device = ctx.device
    dtype = unet.dtype
    cond = sdxl.synthetic_cond(unet, plan["batch"], device=device, dtype=dtype)
    h, w = plan["height"] // 8, plan["width"] // 8
    lat = torch.randn(plan["batch"], 4, h, w, generator=torch.Generator().manual_seed(plan["seed"])).to(device=device, dtype=dtype)
    den = None
    model = sdxl.unet_denoiser(unet)
    if case is not None:
        name, over = ALL_CASES[case]
        cfg = preset(name, split_batch=plan["split"], **{**over, **plan.get("overrides", {})})
        den = PatchParallelDenoiser(model, ctx, cfg, unet=unet)
        model = den
    step_ms: List[float] = []
    comm_ms: List[float] = []
    syncs: List[int] = []
    traffic: List[dict] = []
    from .linkmodel import time_comm
    last = [time.perf_counter()]
    state = {"comm": None, "snap": den.traffic.snapshot() if den else None, "counter": None}

    def timed(x, t, **c):
        counter = HostSyncCounter()
        with counter:
            out = model(x, t, **c)
        syncs.append(counter.count)
        return out

    def on_step(i):
        turns = state.get("turns")
        if turns is not None:
            turns.close_stage()  # before any host wait: the stage's issue time ends at its last launch
        else:
            _sync(device)
        now = time.perf_counter()
        step_ms.append((now - last[0]) * 1e3)
        last[0] = now
        if den is not None:
            snap = den.traffic.snapshot()
            from ..sampling.comm_manager import Traffic

            traffic.append(Traffic.diff(snap, state["snap"]))
            state["snap"] = snap
        if state["comm"] is not None:
            comm_ms.append(state["comm"]["ms"] - sum(comm_ms))
        if turns is not None:
            turns.open_stage()

    # No synchronisation around communication calls: it would serialise displaced mode's asynchronous all-gathers
    # and hide the overlap being measured. On CUDA an NCCL call returns once enqueued, so "compute" then includes
    # the on-device transfer of the link the run used; modelling another link on top is slightly pessimistic.
    sync_fn = None
    with torch.no_grad(), log_comm() as log:
        import contextlib

        cm = time_comm(sync_fn) if (time_comm is not None and case is not None) else contextlib.nullcontext({"ms": 0.0})
        from .turns import take_turns

        turns_cm = (take_turns(ctx, lambda: _sync(device), plan.get("alone_clock", "prefilled")) if alone
                    else contextlib.nullcontext(None))
        with cm as comm_stats, turns_cm as turns:
            state["comm"] = comm_stats
            state["turns"] = turns
            _sync(device)
            last[0] = time.perf_counter()
            x = sdxl.sample_euler_cfg(timed, lat, cond, plan["steps"], on_step=on_step)
            if den is not None:
                x = den.finalize(x)
    if den is not None:
        den.remove()
    return {
        "step_ms": step_ms,
        "comm_ms": comm_ms or [0.0] * len(step_ms),
        "host_syncs": syncs,
        "traffic": traffic,
        "comm_log": log.to_dict(),
        "latent": x.float().cpu().numpy() if ctx.rank == 0 else None,
        "alone": turns.to_dict() if alone else None,
    }


def _bench_all(ctx, plan) -> dict:
    """Every case of ``plan`` on this rank; the reference runs on rank 0 while the others wait."""
    from ..comm import all_reduce

    device = ctx.device
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[plan["dtype"]]
    torch.manual_seed(0)
    unet = _model(plan["tiny"], dtype, device)
    out = {"rank": ctx.rank, "cases": {}}
    if ctx.rank == 0:
        # warm-up (lazy init, autotuning), then the reference
        _run_case(ctx, unet, dict(plan, steps=2), None)
        out["reference"] = _run_case(ctx, unet, plan, None)
    if ctx.world_size > 1:
        flag = torch.zeros(1, device=device)
        all_reduce(flag, ctx)  # everyone waits for the reference
    for key in plan["cases"]:
        case, split = key.rsplit("@", 1)
        if device.type == "cuda":  # kernels and autotuning for the band shapes, outside the timed run
            _run_case(ctx, unet, dict(plan, split=split == "split", steps=2), case)
        timing = plan.get("timing", "concurrent")
        if timing == "alone" and ctx.world_size > 1:
            # only the turn-taking run: its bytes, agreement and per-step compute alone are the case's figures;
            # its step times are turn-taking wall time, not a latency (the record says so)
            out["cases"][key] = _run_case(ctx, unet, dict(plan, split=split == "split"), case, alone=True)
            continue
        out["cases"][key] = _run_case(ctx, unet, dict(plan, split=split == "split"), case)
        if timing in ("alone", "both") and ctx.world_size > 1:
            out["cases"][key]["alone"] = _run_case(ctx, unet, dict(plan, split=split == "split"), case, alone=True)["alone"]
    return out


# ------------------------------------------------------------------------------------------------ driver side


def _cases_for(n: int, presets: Optional[List[str]], split_mode: str) -> List[str]:
    names = presets or list(ALL_CASES)
    splits = []
    if split_mode in ("both", "on") and n % 2 == 0:
        splits.append("split")
    if split_mode in ("both", "off") or n % 2:
        splits.append("nosplit")
    return [f"{c}@{s}" for c in names for s in splits]


def run_sample_bench(
    ranks: int = 2,
    device: str = "cpu",
    presets: Optional[List[str]] = None,
    steps: int = 12,
    tiny: bool = True,
    height: int = 256,
    width: int = 256,
    batch: int = 1,
    dtype: Optional[str] = None,
    split: str = "both",
    launcher: str = "ray",
    seed: int = 42,
    overrides: Optional[Dict[str, object]] = None,
    timing: str = "auto",
    alone_clock: str = "prefilled",
) -> dict:
    """Run the benchmark and return the report dict (see the module docstring)."""
    for p in presets or []:
        if p not in ALL_CASES:
            raise ValueError(f"unknown preset/case {p!r}; choose from {sorted(ALL_CASES)}")
    if ranks < 2:
        raise ValueError(f"--ranks must be >= 2 (got {ranks}); the reference is the single-rank run")
    from ..sampling.config import preset
    dtype = dtype or ("fp32" if device == "cpu" else "fp16")
    cases = _cases_for(ranks, presets, split)
    overrides = dict(overrides or {})
    for name, (p, over) in ALL_CASES.items():  # validate every case's config on the driver, before any rank starts
        if presets is None or name in presets:
            preset(p, **{**over, **overrides})
    if timing == "auto":
        # ranks sharing a device (more ranks than GPUs, or than CPU cores): measure compute alone as well
        if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
            timing = "both" if ranks > max(1, torch.cuda.device_count()) else "concurrent"
        else:
            timing = "both" if ranks > (os.cpu_count() or 1) else "concurrent"
    if timing not in ("concurrent", "alone", "both"):
        raise ValueError(f"timing must be auto, concurrent, alone or both (got {timing!r})")
    from .turns import ALONE_CLOCKS

    if alone_clock not in ALONE_CLOCKS:
        raise ValueError(f"alone_clock must be one of {list(ALONE_CLOCKS)} (got {alone_clock!r})")
    plan = dict(tiny=tiny, height=height, width=width, batch=batch, steps=steps, dtype=dtype, seed=seed, cases=cases,
                overrides=overrides, timing=timing, alone_clock=alone_clock)
    started = time.time()
    if launcher == "ray":
        from ..cluster import ClusterConfig, get_cluster

        results = get_cluster(ClusterConfig(num_ranks=ranks, device=device)).run(_bench_all, plan)
    elif launcher == "spawn":
        from ..spawn import run_ranks

        kind = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
        # PATCHRAY_SPAWN_BACKEND=gloo lets several ranks share one GPU (NCCL refuses that) to count bytes and
        # agreement on the real architecture; such times are not speed-ups.
        from ..spawn import choose_backend

        backend = choose_backend(os.environ.get("PATCHRAY_SPAWN_BACKEND") or "auto", kind, ranks)
        results = run_ranks(_bench_all, ranks, plan, device=kind, backend=backend, timeout_s=900)
    else:
        raise ValueError(f"--launcher must be 'ray' or 'spawn' (got {launcher!r})")
    profiles, model_fn, have_linkmodel = _link_model()
    if profiles is None:
        from collections import namedtuple

        P = namedtuple("LinkProfile", "name bandwidth_gbps latency_us via_host")
        profiles = {"pcie4_x16_no_p2p": P("pcie4_x16_no_p2p", 27.6, 20.0, True), "nvlink": P("nvlink", 360.0, 5.0, False)}
    ref = results[0]["reference"]
    ref_latent = ref["latent"]
    records = [_summarise(key, [r["cases"][key] for r in results], ref, ref_latent, plan, profiles, model_fn) for key in cases]
    report = {
        "benchmark": "sample-bench",
        "ranks": ranks,
        "device": device,
        "launcher": launcher,
        "model": "SDXL UNet2DConditionModel, synthetic weights" + (" (tiny width, same block types)" if tiny else ""),
        "height": height,
        "width": width,
        "latent": [batch, 4, height // 8, width // 8],
        "steps": steps,
        "dtype": dtype,
        "seed": seed,
        "sampler": "Euler (eps), CFG 5.0, batched [uncond, cond]",
        "overrides": overrides,
        "link_model": "patchray.distributed.bench.linkmodel" if have_linkmodel else "inline fallback (linkmodel absent)",
        "link_model_formula": "compute + messages*latency + sync_bytes/bandwidth + max(0, async_bytes/bandwidth - compute)",
        "modelled": ["cases[].modelled", "cases[].modelled_ideal_compute"],
        "timing": timing,
        "alone_clock": alone_clock if timing in ("alone", "both") else None,
        "compute_basis_note": ("compute_basis 'alone': per step, the sum over its stages of the slowest rank's compute "
                               "measured with the device to itself (ranks take turns between collectives; on CUDA "
                               "with alone_clock 'prefilled' the GPU time behind a prefilled launch queue, or the CPU's "
                               "issue time where that is longer: cases[].alone_launch_ms_per_step); "
                               "'concurrent': the step time minus the time in communication while the ranks ran at once"),
        "ideal_compute_note": "modelled_ideal_compute: compute = reference step x the busiest rank's share of rows (and batch)",
        "host_syncs_note": "Tensor.item/tolist/__bool__/__int__/__float__ calls per model call, diffusers' own included",
        "reference": {
            "per_step_ms": ref["step_ms"],
            "total_ms": sum(ref["step_ms"]),
            "host_syncs_per_step": ref["host_syncs"],
        },
        "cases": records,
        "wall_s": time.time() - started,
    }
    try:
        from . import provenance

        report["provenance"] = provenance.collect(torch.device(device if device != "auto" else "cpu"))
    except Exception as exc:  # provenance is informative only
        report["provenance"] = {"error": f"{type(exc).__name__}: {exc}"}
    return report


def sample_bench_main(argv: Optional[List[str]] = None) -> int:
    """CLI entry: ``python -m patchray sample-bench [...] --out FILE``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m patchray sample-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="world size N (>= 2)")
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    ap.add_argument("--preset", action="append", default=None, help=f"case(s) to run (repeatable); default all: {', '.join(ALL_CASES)}")
    ap.add_argument("--steps", type=int, default=None, help="sampling steps (default 12 with --tiny, else 50)")
    ap.add_argument("--tiny", action="store_true", help="reduced-width UNet of the SDXL block types (CPU-friendly)")
    ap.add_argument("--height", type=int, default=None, help="image height in pixels (default 256 tiny, 1024 otherwise)")
    ap.add_argument("--width", type=int, default=None, help="image width in pixels (default: height)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None, help="default fp32 on cpu, fp16 on cuda")
    ap.add_argument("--split", choices=["both", "on", "off"], default="both", help="split_batch variants to run")
    ap.add_argument("--launcher", choices=["ray", "spawn"], default="ray")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a PatchConfig field in every case, e.g. --set k_ratio=0.5 --set refresh_every=5")
    ap.add_argument("--timing", choices=["auto", "concurrent", "alone", "both"], default="auto",
                    help="both: also run each case with the ranks taking turns, so the modelled latency uses each rank's "
                         "compute measured alone; alone: only the turn-taking run (half the time; its step times are "
                         "not latencies); auto: both when the ranks share a device")
    ap.add_argument("--alone-clock", choices=["prefilled", "idle"], default="prefilled",
                    help="CUDA turn-taking clock: prefilled (GPU time with the launch queue filled ahead, and the CPU's "
                         "issue time beside it) or idle (each stage timed from an idle GPU, launch gaps included)")
    ap.add_argument("--out", required=True, help="JSON report path; the chart goes next to it (.png)")
    args = ap.parse_args(argv)
    presets = None
    if args.preset:
        presets = [p for item in args.preset for p in item.split(",") if p]
    overrides = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects FIELD=VALUE (got {item!r}), e.g. --set k_ratio=0.5")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError:
            overrides[field] = value  # enum names such as groupnorm=stale
    height = args.height or (256 if args.tiny else 1024)
    width = args.width or height
    steps = args.steps or (12 if args.tiny else 50)
    try:
        report = run_sample_bench(
            ranks=args.ranks, device=args.device, presets=presets, steps=steps, tiny=args.tiny, height=height, width=width,
            batch=args.batch, dtype=args.dtype, split=args.split, launcher=args.launcher, seed=args.seed,
            overrides=overrides, timing=args.timing, alone_clock=args.alone_clock,
        )
    finally:
        if args.launcher == "ray":
            from ..cluster import shutdown_cluster

            shutdown_cluster()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=float)
    png = os.path.splitext(args.out)[0] + ".png"
    write_chart(report, png)
    print(format_table(report))
    print(f"wrote {args.out} and {png}")
    return 0
