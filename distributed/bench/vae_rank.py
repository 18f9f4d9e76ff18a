"""What one rank does in a benchmark run: :func:`bench_rank`, the one body every launcher runs.

Design decision: :func:`bench_rank` builds the VAE with seed-0 weights and the input with seed 1, plans the
cases, measures each (:mod:`.measure`) and ends every case with one ``all_gather_object`` so *every* rank
returns the finished records. An error in one case is recorded and the ranks move on together. The unsharded
reference runs on rank 0 alone while the other ranks wait (:func:`.measure.measure_on_one_rank`): its figures are
one device's decode, the denominator of every speed-up, and the record's per-rank lists hold rank 0's only.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
from typing import Any, List, Tuple

import torch

from ..cluster import report_progress
from ..comm import all_gather_object
from .cases import Case, Reference, make_input, make_runner, plan_cases
from .catalog import format_shape
from .linkmodel import model_record, summarise_alone, throttle_link, wire_bytes
from .measure import error_record, measure, measure_on_one_rank, memory_cap
from .options import DTYPES, Options
from .records import base_record, check_output, comm_block, peak_block

__all__ = ["bench_rank"]

log = logging.getLogger(__name__)


def progress_line(opts: "Options", line: str) -> None:
    """Rank 0's progress: logged (torchrun prints it), and appended to ``progress_path`` when the driver tails one
    (Ray actors and spawned ranks do not share the driver's stdout)."""
    log.info("%s", line)
    if opts.progress_path:
        try:
            with open(opts.progress_path, "a") as fh:
                fh.write(line + "\n")
        except OSError:  # progress is a courtesy; a remote rank may not see the driver's folder
            pass


def bench_rank(ctx, payload: dict) -> List[dict]:
    """Everything one rank does; returns the finished records (identical on every rank).

    Args:
        ctx: this rank's :class:`~patchray.distributed.context.ParallelContext`.
        payload: :class:`Options` as a dict (``dataclasses.asdict``).
    """
    # a Ray actor outlives the run (ComfyUI reuses the cluster): put the process-wide settings back afterwards
    saved = (torch.get_num_threads(), torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    try:
        return _bench_rank(ctx, Options(**payload))
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[1], saved[2]


def _bench_rank(ctx, opts: Options) -> List[dict]:
    from ..vae.families import FAMILIES, build_vae
    from . import provenance

    device = ctx.device
    if device.type == "cpu":
        torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 1) // max(1, ctx.world_size)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # fp32 means fp32: TF32 convolutions/matmuls would make row vs unsharded differ by ~1e-3 for no reason
    torch.backends.cudnn.allow_tf32 = opts.dtype != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = opts.dtype != "fp32"
    spec = FAMILIES[opts.family]
    dtype = DTYPES[opts.dtype]
    # rank 0's provenance, with every rank's device name, goes into every rank's records
    mine = provenance.collect(device) if ctx.rank == 0 else provenance.device_info(device).get("name")
    gathered = all_gather_object(mine, ctx)
    prov = gathered[0]
    prov["device"]["names_by_rank"] = [prov["device"].get("name")] + gathered[1:]
    prov["launcher"] = "torchrun" if opts.torchrun else opts.launcher
    prov["backend"] = ctx.backend

    records: List[dict] = []
    with contextlib.ExitStack() as stack:
        throttle = stack.enter_context(throttle_link(opts.link, ctx.world_size)) if opts.link else None
        cap = stack.enter_context(memory_cap(device, opts.max_memory_mb))
        stack.enter_context(torch.no_grad())
        vae = build_vae(opts.family, size=opts.size, seed=0, dtype=dtype, device=device)
        if cap is not None:
            cap["weights"] = sum(p.numel() * p.element_size() for p in vae.parameters())
        planned = [(tuple(shape), plan_cases(opts, tuple(shape), ctx.world_size)) for shape in opts.shapes]
        total, done = sum(len(c) for _, c in planned), 0
        for shape, cases in planned:
            inp = make_input(opts, shape, spec).to(device=device, dtype=dtype)
            within_limit = shape[0] * shape[1] * shape[2] / 1e6 <= opts.reference_limit_mpix
            ref = Reference(None, None if within_limit else (
                f"output {format_shape(shape)} is over the reference-size limit "
                f"({opts.reference_limit_mpix:g} megapixels; --reference-limit-mpix)"))
            if within_limit and not any(c.mode == "unsharded" for c in cases):
                ref = Reference(None, "no unsharded reference in this run (add --case unsharded)")
            for case in cases:
                rec, output = _run_case(ctx, opts, spec, vae, inp, shape, case, prov, throttle, ref)
                if case.mode == "unsharded" and within_limit:
                    if output is not None:
                        ref = Reference(output, None)
                    else:
                        kind = (rec.get("error") or {}).get("kind") or rec.get("status")
                        ref = Reference(None, f"the unsharded reference failed ({kind})")
                del output
                records.append(rec)
                done += 1
                report_progress(done, total)  # the driver's progress bar (ComfyUI), if it asked for one
            del inp, ref
            gc.collect()
        del vae
    return records


def _run_case(ctx, opts, spec, vae, inp, shape, case: Case, prov, throttle, ref: Reference) -> Tuple[dict, Any]:
    """Run one case on this rank; return the finished record and rank 0's output of an unsharded case."""
    world = ctx.world_size
    stem = f"{opts.family}-{opts.half}-{format_shape(shape)}-{case.name.replace(' ', '-')}"
    rec = base_record(opts, spec, shape, case, world, prov)
    if case.skipped:
        rec["status"] = "skipped"
        rec["error"] = error_record("plan", case.skipped)
        if ctx.rank == 0:
            progress_line(opts, f"  {case.name:<24} skipped: {case.skipped}")
        return rec, None
    case_inp = inp
    if case.mode == "tile-shape-cost":
        from ..vae.families import latent_shape

        a, b = case.latent_window
        full = latent_shape(opts.family, shape[0], shape[1], shape[2], batch=opts.tile_shape_batch, size=opts.size)
        g = torch.Generator().manual_seed(1)
        case_inp = torch.randn(tuple(full[:-2]) + (a, b), generator=g).to(device=inp.device, dtype=inp.dtype)
    runner = make_runner(case, vae, case_inp, ctx, opts)
    if ctx.rank == 0:
        progress_line(opts, f"  {format_shape(shape)} {case.name}: running ({opts.warmup} warm-up, 1 logged, {opts.iters} timed)")
    slept_before = throttle["slept_ms"] if throttle is not None else 0.0
    on_one_rank = case.mode == "unsharded" and world > 1
    if on_one_rank:
        mine, output = measure_on_one_rank(ctx, opts, runner, stem)
    else:
        mine, output = measure(ctx, opts, runner, stem)
    if throttle is not None:
        mine["slept_ms"] = throttle["slept_ms"] - slept_before
    # rank 0 judges its output (the distributed modes deliver there); the verdict travels with its measurements
    if ctx.rank == 0 and mine["error"] is None:
        mine["check"] = check_output(opts, spec, shape, case, output, ref)
    gathered = all_gather_object(mine, ctx)
    keep = output if (case.mode == "unsharded" and ctx.rank == 0) else None
    del output

    errors = [m["error"] for m in gathered if m["error"]]
    rec["error"] = errors[0] if errors else None
    rec["errors_by_rank"] = [m["error"]["kind"] if m["error"] else None for m in gathered]
    # the reference ran on rank 0 alone: its figures are rank 0's (the others only waited)
    per_rank = [m for m in gathered if not m.get("waited")]
    rec["reference_ranks"] = [m["rank"] for m in per_rank] if case.mode == "unsharded" else None
    world = len(per_rank)
    check = per_rank[0].get("check") or {}
    if rec["error"] is None and check.get("structural"):
        rec["error"] = error_record("structural", check["structural"], 0)
    rec["status"] = "ok" if rec["error"] is None else "error"

    times = [m["times_ms"] for m in per_rank]
    if rec["error"] is None and all(times):
        slowest = [max(t[i] for t in times) for i in range(len(times[0]))]
        rec["latency_ms"] = round(statistics.median(slowest), 3)
        rec["latency_ms_iterations"] = [round(t, 3) for t in slowest]
        rec["latency_ms_by_rank"] = [round(statistics.median(t), 3) for t in times]
    # CPU seconds each rank process spent on the whole case (warm-up, logged, timed, profiled): on CPU ranks this
    # is the case's wall time on an otherwise idle machine, whatever else shared the cores during the run
    rec["cpu_s_by_rank"] = [round(m.get("cpu_s", 0.0), 3) for m in per_rank]
    peaks = [m["peak"] for m in per_rank]
    rec["peak_memory"] = peak_block(peaks, ctx.device)
    comms = [m["comm"] for m in per_rank]
    if all(c is not None for c in comms):
        rec["comm"] = comm_block(comms)
    if rec["latency_ms"] is not None and rec["comm"] is not None:
        comm_ms = [m["comm_ms"] or 0.0 for m in per_rank]
        compute = [max(0.0, lat - c) for lat, c in zip(rec["latency_ms_by_rank"], comm_ms)]
        rec["compute_ms_by_rank"] = [round(c, 3) for c in compute]
        rec["comm_ms_by_rank"] = [round(c, 3) for c in comm_ms]
        rec["wire_bytes_by_rank"] = [wire_bytes(c["bytes"], world) for c in comms]
        rec["link_model"] = model_record(compute, [c["bytes"] for c in comms], [c["total_calls"] for c in comms], world)
        rec["link_model_basis"] = {"modelled": True, "compute": "concurrent",
                                   "note": "compute = each rank's median latency minus its time in communication, "
                                           "measured while the ranks ran at once (on a shared device: inflated)"}
    alone = [m.get("alone") for m in per_rank]
    if rec["error"] is None and all(alone):
        rec["alone"] = summarise_alone(alone, world)
        if rec["alone"]["link_model"]:
            rec["link_model"] = rec["alone"]["link_model"]
            rec["link_model_basis"] = {"modelled": True, "compute": "alone", "clock": rec["alone"].get("clock"),
                                       "note": "compute measured alone by turn-taking (the 'alone' block): per stage the "
                                               "slowest rank (clock gpu-prefilled: GPU time, or per invocation the "
                                               "CPU's issue time where longer), plus each collective modelled from "
                                               "its bytes"}
    if throttle is not None:
        slept = [m.get("slept_ms") for m in per_rank]
        rec["link"] = {"profile": throttle["profile"], "throttled": True,
                       "slept_ms_by_rank": [round(x, 3) if x is not None else None for x in slept]}
    if check:
        rec["agreement"] = check.get("agreement")
        rec["agreement_note"] = check.get("note")
        rec["finite"] = check.get("finite")
        if "seam" in check:
            rec["seam_error"] = check["seam"]
    if rec["agreement_enforced"]:
        tol = rec["agreement_tolerance"]
        agr = rec["agreement"]
        if agr is None:
            rec["agreement_ok"] = None
        else:
            rec["agreement_ok"] = bool(agr["max_abs"] <= tol["max_abs"] and agr["mean_abs"] <= tol["mean_abs"])
    profiles = [m["profile"] for m in per_rank if m.get("profile")]
    if profiles:
        rec["profile"] = {"files": [f for p in profiles for f in p["files"]]}
    if ctx.rank == 0:
        from .report import case_line

        progress_line(opts, case_line(rec))
    return rec, keep
