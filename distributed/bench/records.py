"""The schema record of a case: its fields, the comparison with the reference, and the exit status.

Design decision: a record is built from rank 0's view plus every rank's measurements (gathered once per case),
so every rank returns the same records and the JSON cannot depend on how the ranks were started. The fields and
their meaning are documented in ``docs/benchmark.md``; a change that renames or retypes one bumps
:data:`~.options.SCHEMA_VERSION`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import torch

from .cases import Case, Reference, expected_shape
from .catalog import CATALOG_VERSION, architecture_digest, format_shape
from .options import EXIT_FAILED, EXIT_OK, FAILING_ERRORS, ROW_TOLERANCE, SCHEMA_VERSION, TILED, Options

__all__ = ["agreement", "comm_block", "check_output", "peak_block", "base_record", "exit_status", "json_safe"]


def agreement(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max_abs, mean_abs and PSNR (data range: the reference's max - min) in fp32, chunked to bound memory."""
    a, b = out.reshape(-1), ref.reshape(-1)
    n = a.numel()
    max_abs, abs_sum, sq_sum = 0.0, 0.0, 0.0
    lo, hi = math.inf, -math.inf
    step = 1 << 24
    for i in range(0, n, step):
        x, y = a[i:i + step].float().cpu(), b[i:i + step].float().cpu()
        d = (x - y).abs()
        max_abs = max(max_abs, float(d.max()))
        abs_sum += float(d.double().sum())
        sq_sum += float((d.double() ** 2).sum())
        lo, hi = min(lo, float(y.min())), max(hi, float(y.max()))
    mse = sq_sum / n
    data_range = hi - lo if hi > lo else 1.0
    psnr = None if mse == 0 else 10 * math.log10(data_range**2 / mse)
    result = {"max_abs": max_abs, "mean_abs": abs_sum / n, "psnr_db": psnr, "data_range": data_range, "identical": mse == 0}
    return result


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def comm_block(comms: Sequence[dict]) -> dict:
    """The record's ``comm`` from each rank's :meth:`CommLog.to_dict` (rank 0's count, the busiest
    rank's count and every rank's; bytes by operation and in total; see ``docs/benchmark.md``)."""
    return {
        "total_calls": comms[0]["total_calls"],
        "total_calls_max": max(c["total_calls"] for c in comms),
        "total_calls_by_rank": [c["total_calls"] for c in comms],
        "calls_by_op": comms[0]["calls"],
        "batched_calls_by_op": comms[0]["batched_calls"],
        "bytes": {
            "by_op": comms[0]["bytes"],
            "total": comms[0]["total_bytes"],
            "total_max": max(c["total_bytes"] for c in comms),
            "total_by_rank": [c["total_bytes"] for c in comms],
        },
    }


def check_output(opts, spec, shape, case: Case, output, ref: Reference) -> dict:
    check: Dict[str, Any] = {"agreement": None, "note": None, "finite": None, "structural": None}
    if case.mode == "tile-shape-cost":
        check["note"] = "tile-shape costs decode a tile-sized latent: nothing to compare"
        return check
    if output is None:
        check["structural"] = f"{case.mode} delivered no output to rank 0"
        return check
    reference = ref.output
    want = expected_shape(opts, shape, spec, case)
    # batch and spatial size are certain; the frame count of a video decode is the family's business, so frames
    # (and channels) are only compared against the unsharded reference
    if want is not None and (output.dim() != len(want) or output.shape[0] != want[0]
                             or tuple(output.shape[-2:]) != tuple(want[-2:])):
        check["structural"] = f"{case.mode} output has shape {tuple(output.shape)}, expected {tuple(want)}"
        return check
    if reference is not None and output.shape != reference.shape:
        check["structural"] = f"{case.mode} output has shape {tuple(output.shape)}, the reference {tuple(reference.shape)}"
        return check
    check["finite"] = finite(output)
    if case.mode == "unsharded":
        check["note"] = "this case is the reference"
        return check
    if reference is None:
        check["note"] = ref.note or "no unsharded reference for this case"
        return check
    if not check["finite"] and finite(reference):
        check["structural"] = f"{case.mode} output holds non-finite values where the unsharded reference is finite"
    check["agreement"] = agreement(output, reference)
    if case.plan is not None:
        try:
            from ..vae.tiled import seam_error

            check["seam"] = seam_error(output, reference, case.plan)
        except Exception as exc:  # a report extra: never fails the case
            check["seam"] = {"error": f"{type(exc).__name__}: {exc}"}
    return check


def peak_block(peaks: List[dict], device: torch.device) -> dict:
    by_rank = [p.get("bytes") for p in peaks]
    metric = peaks[0].get("metric") if peaks else None
    known = [b for b in by_rank if b is not None]
    block = {
        "metric": metric,
        "max_bytes": max(known) if known else None,
        "by_rank_bytes": by_rank,
        "max_gib": round(max(known) / 2**30, 4) if known else None,
    }
    if metric == "process_rss_peak":
        block["note"] = ("CPU ranks: no accelerator memory. This is the rank process's peak resident set (host RAM: "
                         "weights, activations, Python and the torch runtime), reset before the case (Linux clear_refs)")
    elif metric == "cuda_max_memory_allocated":
        block["note"] = "torch.cuda.max_memory_allocated per rank over warm-up, logged and timed invocations (weights included)"
    else:
        block["note"] = "not measured (the case failed before measuring, or the platform has no peak counter)"
    return block


def base_record(opts: Options, spec, shape, case: Case, world: int, prov) -> dict:
    from ..vae.families import latent_shape

    h, w, f = shape
    tile = None
    planner = None
    if case.plan is not None:
        d = case.plan.to_dict()
        tile = {k: d[k] for k in ("name", "window", "overlap", "latent_window", "latent_overlap", "grid", "runs")}
        tile["tiles"] = len(d["tiles_latent"])
        tile["coverage"] = d["objectives"]["coverage"]
        planner = {"objectives": d["objectives"]}
        if case.plan_report is not None:
            planner["candidate_limit"] = case.plan_report.candidate_limit
            planner["frontier_size"] = case.plan_report.frontier_size
            planner["candidates_considered"] = case.plan_report.candidates_considered
    if case.mode == "tile-shape-cost":
        a, b = case.latent_window
        r = spec.spatial_ratio
        tile = {"name": None, "window": [a * r, b * r], "overlap": [0, 0], "latent_window": [a, b],
                "batch": opts.tile_shape_batch}
    enforced = case.mode == "row"
    tol = dict(ROW_TOLERANCE[opts.dtype])
    if opts.row_tolerance is not None:
        tol["max_abs"] = opts.row_tolerance
    try:
        lat = list(latent_shape(opts.family, h, w, f, batch=opts.batch, size=opts.size))
    except ValueError:
        lat = None
    return {
        "schema": SCHEMA_VERSION,
        "benchmark": "patchray-vae",
        "family": opts.family,
        "half": opts.half,
        "size": opts.size,
        "architecture_digest": architecture_digest(spec.full_config if opts.size == "full" else spec.tiny_config),
        "catalog_version": CATALOG_VERSION,
        "shape": {"height": h, "width": w, "frames": f, "label": format_shape(shape)},
        "latent_shape": lat,
        "batch": opts.batch,
        "world_size": world,
        "dtype": opts.dtype,
        "device": opts.device,
        "mode": case.mode,
        "case": case.case,
        "name": case.name,
        "plan": case.plan.name if case.plan is not None else None,
        "window": tile["window"] if tile else None,
        "overlap": tile["overlap"] if tile else None,
        "tile": tile,
        "beats_row_sharding": bool(case.plan.beats_row_sharding) if case.plan is not None else None,
        "planner": planner,
        "gn_sync": bool(opts.gn_sync) if case.mode in TILED else None,
        "warmup": opts.warmup,
        "iters": opts.iters,
        "status": None,
        "error": None,
        "errors_by_rank": None,
        "latency_ms": None,
        "latency_ms_iterations": None,
        "latency_ms_by_rank": None,
        "peak_memory": None,
        "comm": None,
        "agreement": None,
        "agreement_note": None,
        "agreement_enforced": enforced,
        "agreement_tolerance": tol if enforced else None,
        "agreement_ok": None,
        "finite": None,
        "cpu_s_by_rank": None,
        "reference_ranks": None,
        "compute_ms_by_rank": None,
        "comm_ms_by_rank": None,
        "wire_bytes_by_rank": None,
        "link_model": None,
        "link_model_basis": None,
        "timing": getattr(opts, "timing", "concurrent"),
        "alone_clock": getattr(opts, "alone_clock", "prefilled") if getattr(opts, "timing", "concurrent") != "concurrent" else None,
        "alone": None,
        "link": None,
        "memory_cap_mb": opts.max_memory_mb,
        "profile": None,
        "hw_family": opts.hw_family,
        "provenance": prov,
    }


def exit_status(records: Sequence[dict]) -> int:
    """The exit status of finished records (0 ok, 1 failed); setup errors never reach here."""
    for r in records:
        err = r.get("error") or {}
        if err.get("kind") in FAILING_ERRORS:
            return EXIT_FAILED
        if r.get("agreement_enforced") and r.get("agreement_ok") is False:
            return EXIT_FAILED
    return EXIT_OK


def json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)
