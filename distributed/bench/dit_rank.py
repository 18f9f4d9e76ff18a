"""The DiT benchmark's rank side (``python -m patchray.distributed.bench.dit_bench``): every preset and case on one rank.

Design decisions:

* **One process launch for every preset and N.** ``--ranks W`` rank processes start once; each preset is built on
  as many ranks as its full copies fit on the device (per-process memory fraction ``0.97 / ranks``), the cases
  with N < W run on the first N ranks (subgroups) while the others wait, and the model is freed before the next
  preset. Rank 0 writes the JSON after every case (a run cut short still leaves its data), and a deadline
  (``--deadline-s``) skips the remaining cases, decided on rank 0 and shared, so every rank takes the same branch.
* **Compute measured alone, on the clock asked for.** Every call runs with the ranks taking turns
  (:func:`.turns.take_turns`); the warm-up and timed calls of one case share one :class:`.turns.Prefill`, so
  on CUDA the timed calls' spins are sized from the warm-up's issue times (``--alone-clock prefilled``, the
  default: GPU time with the launch queue filled ahead, and the CPU's issue time beside it).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch

from .dit_models import (_GIB, _HEADROOM, PRESETS, Case, DiTPreset, _calls_per_step, _cost_model_wire,
                         _reference_calls, _weights_bytes, build_random, make_inputs, plan_cases, ranks_that_fit)

__all__ = ["BF16_TOLERANCE", "FP32_TOLERANCE", "SHOWN_PROFILES", "bench_rank", "write_doc"]

#: link profiles the table and chart show, and whose parameters a record carries (the JSON holds every profile)
SHOWN_PROFILES = ("nvlink", "pcie4_x16_no_p2p")

def _subcontext(world, members: List[int]):
    from .. import comm
    from ..context import ParallelContext

    if len(members) == 1:
        return ParallelContext.single(world.device)
    if len(members) == world.world_size:
        return world
    group = comm.new_group(members) if world.rank in members else None
    if group is None:
        return None
    return ParallelContext(group=group, rank=members.index(world.rank), world_size=len(members),
                           global_ranks=tuple(members), device=world.device, backend=world.backend)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _gloo_cuda_all_to_all(ctx):
    """Ulysses on CUDA ranks under gloo: hand CUDA tensors to gloo's own all-to-all (it copies through pinned host
    memory inside the call) instead of comm's default host staging around the call, whose copies would be billed
    to the rank's compute by the turn-taking clock. Yields the transport's name (recorded)."""
    from .. import comm
    from ..parallel import seq_attention as seq  # the module whose calls look the name up

    if not (ctx.device.type == "cuda" and ctx.backend == "gloo"):
        yield "default"
        return
    original = seq.all_to_all_equal
    state = {"direct": True}

    def direct(send, c):
        if state["direct"]:
            try:
                return comm.all_to_all_equal(send, c, stage_on_host=False)
            except (RuntimeError, NotImplementedError):  # raised before any transfer, the same on every rank
                state["direct"] = False
        return original(send, c)

    seq.all_to_all_equal = direct
    try:
        yield state
    finally:
        seq.all_to_all_equal = original


def _measure_case(ctx, layout, model, inputs, case: Case, warmup: int, iters: int, keep_output: bool,
                  cfg_inner: str = "gathered", clock: str = "prefilled",
                  profile: Optional[str] = None, compile_mode: Optional[str] = None,
                  compile_attention: str = "compiled", concurrent: bool = False,
                  share_modulation: bool = True) -> Tuple[dict, Optional[torch.Tensor]]:
    """Run ``warmup + iters`` calls with the ranks taking turns; the first call is also the logged one.

    With ``concurrent`` (CPU ranks, or one GPU per rank), ``1 + iters`` more calls run with every rank at once, after
    a barrier; each rank's wall time per timed call is recorded (``concurrent_ms``): the measured latency the
    turn-taking model predicts.

    With ``profile`` (a path prefix) one more call runs under ``torch.profiler`` after the timed ones (not timed
    itself: the profiler slows the CPU side) and its kernels are written per rank (:func:`.kernel_profile.write`).
    With ``compile_mode`` every transformer block is compiled (:func:`~..sampling.compiled.compile_blocks`, its
    ``attention`` scope ``compile_attention``) after the sequence plan is installed; the warm-up calls compile.

    Returns this rank's measurements and, with ``keep_output``, the first call's output (fp32, on the host).
    """
    from ..comm import barrier, log_comm
    from ..sampling.dit import parallelize_dit
    from ..sampling.split import cfg_parallel
    from .measure import _read_peak, _reset_peak
    from .turns import Prefill, take_turns

    device = ctx.device
    handle = None
    if case.mode in ("gathered", "ulysses", "overlapped", "ring"):
        handle = parallelize_dit(model, ctx, mode=case.mode, share_modulation=share_modulation)
        attention = case.mode

        def call():
            return model(**inputs[0])[0]
    elif case.mode == "cfg":
        inner = layout.inner
        attention = cfg_inner if inner.world_size > 1 else "none"
        if inner.world_size > 1:
            handle = parallelize_dit(model, inner, mode=cfg_inner, share_modulation=share_modulation)

        def call():
            return torch.stack(cfg_parallel(lambda c: model(**c)[0], inputs, layout))
    else:
        attention = "none"

        def call():
            return model(**inputs[0])[0]

    compiled = None
    if compile_mode:
        from ..sampling.compiled import compile_blocks

        compiled = compile_blocks(model, mode=compile_mode, attention=compile_attention)
    out: Dict[str, Any] = {"rank": ctx.rank, "attention": attention, "runs": [], "counted": None, "calls": None,
                           "compile": compile_mode, "compile_attention": compile_attention if compile_mode else None,
                           "modulation": "shared" if share_modulation else "whole"}
    output = None
    transport = (_gloo_cuda_all_to_all(ctx) if attention == "ulysses" else contextlib.nullcontext("default"))
    prefill = Prefill()  # the warm-up calls size the timed calls' spins, stage by stage
    try:
        a2a = transport.__enter__()
        _reset_peak(device)
        with torch.no_grad():
            for i in range(warmup + iters):
                barrier(ctx)
                _sync(device)
                logging = log_comm() if i == 0 else contextlib.nullcontext(None)
                with logging as log, take_turns(ctx, clock=clock, prefill=prefill) as turns:
                    y = call()
                if i == 0:
                    out["counted"] = dict(log.bytes) if log is not None else {}
                    out["calls"] = int(log.total_calls) if log is not None else 0
                    out["finite"] = bool(torch.isfinite(y).all())
                    if keep_output:
                        output = y.detach().float().cpu()
                del y
                out["runs"].append(turns.to_dict())
            if concurrent:
                out["concurrent_ms"] = _time_at_once(ctx, call, iters)
            state = getattr(handle, "state", None)
            out["mode_calls"] = dict(getattr(state, "mode_calls", None) or {})  # the attention modes that ran, calls each
            if profile:
                from . import kernel_profile

                barrier(ctx)
                _sync(device)
                with kernel_profile.record(device) as prof, take_turns(ctx, clock=clock, prefill=prefill):
                    call()
                _sync(device)
                out["kernel_profile"] = kernel_profile.write(prof, f"{profile}_{case.label}_r{ctx.rank}".replace(" ", "_"))
        peak = _read_peak(device)
        out["peak_bytes"], out["peak_metric"] = peak["bytes"], peak["metric"]
        if isinstance(a2a, dict):
            out["all_to_all_transport"] = "gloo CUDA all-to-all" if a2a["direct"] else "host-staged (copies billed to compute)"
    finally:
        transport.__exit__(None, None, None)
        if compiled is not None:
            compiled.remove()
            # each case starts with no compiled graphs, as a sampling run does: rank 0 runs one case more (N = 1)
            # than the others, and the graphs of five cases of different shapes reached torch.compile's recompile
            # limit there (its blocks then ran eagerly)
            torch._dynamo.reset()
        if handle is not None:
            handle.remove()
    return out, output


def _time_at_once(ctx, call, iters: int) -> List[float]:
    """Wall milliseconds of ``iters`` calls with every rank running at once (one untimed call first: the
    collectives' first concurrent use); each call starts after a barrier with the device idle and ends when this
    rank's device has finished it."""
    from .turns import settle

    walls = []
    for i in range(1 + iters):
        settle(ctx)
        t0 = time.perf_counter()
        y = call()
        _sync(ctx.device)
        if i:
            walls.append((time.perf_counter() - t0) * 1e3)
        del y
    return walls


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


#: bf16 exactness bound for one call's output (relative L2); see ``docs/dit.md`` / results README for the reasoning
BF16_TOLERANCE = 5e-2
FP32_TOLERANCE = 1e-5


def _measured_at_once(rec: dict, per_rank: List[dict], calls: int, link: Dict[str, Optional[float]],
                      comm_ms: Optional[float], ref_measured_ms: Optional[float]) -> None:
    """Add the concurrent run's figures to ``rec`` (when the ranks ran at once): per timed call the slowest rank's
    wall time, its median per step, the speed-up over one rank's measured step, and each model's error against it
    (``model / measured - 1``): every link profile's, and ``measured_collectives`` (the alone compute plus the
    collectives' times measured inside the turn-taking run, i.e. this machine's own links)."""
    walls = [r.get("concurrent_ms") for r in per_rank]
    if not walls or not all(walls):
        return
    per_call = [max(ms) for ms in zip(*walls)]
    call_ms = statistics.median(per_call)
    step = call_ms * calls
    models = dict(link)
    if comm_ms is not None and rec.get("compute_ms_per_call_alone") is not None:
        models["measured_collectives"] = (rec["compute_ms_per_call_alone"] + comm_ms) * calls
    rec.update({
        "measured": True,
        "measured_ms_per_call": round(call_ms, 3),
        "measured_ms_per_call_iterations": [round(v, 3) for v in per_call],
        "measured_step_ms": round(step, 3),
        "speedup_measured": round(ref_measured_ms / step, 3) if ref_measured_ms else None,
        "model_error_vs_measured": {k: (round(v / step - 1.0, 4) if v else None) for k, v in models.items()},
        "modelled_step_ms_measured_collectives": models.get("measured_collectives"),
    })


def _summarise(preset: DiTPreset, case: Case, per_rank: List[dict], warmup: int, ref_call_ms: Optional[float],
               size: str, itemsize: int, ref_measured_ms: Optional[float] = None) -> dict:
    from .linkmodel import LINK_PROFILES, summarise_alone

    calls = _calls_per_step(preset, case)
    timed = [r["runs"][warmup:] for r in per_rank]
    alone = summarise_alone(timed, case.n)
    counted: Dict[str, int] = {}
    for r in per_rank:
        for op, b in (r["counted"] or {}).items():
            counted[op] = max(counted.get(op, 0), int(b))
    first = [r["runs"][0] for r in per_rank]
    wire_call = max(sum(run["wire_bytes"]) for run in first)
    colls_call = max(len(run["wire_bytes"]) for run in first)
    link = {name: (v * calls if v is not None else None) for name, v in alone["link_model"].items()}
    ref_step = ref_call_ms * _reference_calls(preset, case) if ref_call_ms else None
    rec = {
        "preset": preset.name, "model": preset.title, "case": case.label, "n": case.n, "mode": case.mode,
        "attention": per_rank[0]["attention"], "attention_calls_by_mode": per_rank[0].get("mode_calls"), "status": "ok",
        "cfg_groups": 2 if case.mode == "cfg" else 1,
        "sequence_ranks": case.n // 2 if case.mode == "cfg" else case.n,
        "calls_per_step": calls,
        "step_definition": ("one call per step: each CFG group evaluates its branch, outputs exchanged once"
                            if case.mode == "cfg" else
                            ("two calls per step (cond, uncond), each the same kernels on the same shapes"
                             if calls == 2 else "one call per step (guidance-distilled)")),
        "compute_ms_per_call_alone": alone["compute_ms"],
        "compute_ms_per_call_alone_iterations": alone["compute_ms_iterations"],
        "compute_ms_per_call_by_rank": alone["compute_ms_by_rank"],
        "cpu_ms_per_call_alone": alone["cpu_compute_ms"],
        "alone_clock": alone["clock"],
        "gpu_ms_per_call_alone": alone["gpu_ms"],
        "launch_ms_per_call_alone": alone["launch_ms"],
        "launch_ms_per_call_by_rank": alone["launch_ms_by_rank"],
        "launch_bound": alone["launch_bound"],
        "queued_stages_per_call": alone["queued_stages"],
        "host_sync_stages_per_call": alone["host_sync_stages"],
        "compute_ms_per_step_alone": alone["compute_ms"] * calls if alone["compute_ms"] is not None else None,
        "stages_per_call": alone["stages"],
        "collectives_per_step": colls_call * calls,
        "counted_bytes_per_step": {op: b * calls for op, b in counted.items()},
        "wire_bytes_per_step": wire_call * calls,
        "comm_ms_measured_gloo_one_gpu": alone["comm_ms_measured"],
        "modelled": True,
        "modelled_step_ms": link,
        "reference_step_ms": ref_step,
        "speedup_modelled": {name: (round(ref_step / v, 3) if ref_step and v else None) for name, v in link.items()},
        "peak_gib_by_rank": [round(r["peak_bytes"] / _GIB, 3) if r.get("peak_bytes") else None for r in per_rank],
        "peak_metric": per_rank[0].get("peak_metric"),
        "finite": all(r.get("finite", False) for r in per_rank),
        "all_to_all_transport": per_rank[0].get("all_to_all_transport"), "compile": per_rank[0].get("compile"),
        "compile_attention": per_rank[0].get("compile_attention"), "modulation": per_rank[0].get("modulation"),
        "iterations": {"warmup": warmup, "timed": len(timed[0])},
    }
    if case.n > 1:
        rec["cost_model_wire_bytes_per_step"] = calls * _cost_model_wire(preset, size, case, itemsize,
                                                                         per_rank[0]["attention"] if case.mode == "cfg" and case.n > 2 else "gathered",
                                                                         modulation=per_rank[0].get("modulation") != "whole")
    rec["link_profiles"] = {name: LINK_PROFILES[name]._asdict() for name in SHOWN_PROFILES}
    ref_measured_step = ref_measured_ms * _reference_calls(preset, case) if ref_measured_ms else None
    _measured_at_once(rec, per_rank, calls, link, alone["comm_ms_measured"], ref_measured_step)
    return rec


def _skipped(preset: DiTPreset, case: Case, status: str, why: str) -> dict:
    return {"preset": preset.name, "model": preset.title, "case": case.label, "n": case.n, "mode": case.mode,
            "status": status, "error": why, "modelled": True}


def _write_doc(path: Optional[str], doc: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=float)
    os.replace(tmp, path)


def _log(ctx, start: float, msg: str) -> None:
    if ctx.rank == 0:
        print(f"[dit_bench {time.time() - start:7.1f}s] {msg}", flush=True)


def _bench_rank(ctx, plan: dict) -> Optional[dict]:
    """Every preset and case on this rank (``ctx``: all W rank processes); rank 0 returns the records."""
    from ..comm import all_gather_object
    from ..sampling.split import RankGroups

    start = time.time()
    device = ctx.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan["dtype"]]
    itemsize = torch.tensor([], dtype=dtype).element_size()
    world = ctx.world_size
    ns = [n for n in plan["ns"] if n <= world]
    watchdog = float(plan.get("watchdog_s") or 0)
    if watchdog > 0:  # a rank that stops moving prints where it is (every rank, to stderr), then keeps waiting
        faulthandler.dump_traceback_later(watchdog, repeat=True, file=sys.stderr)
    # one group per member set: two groups of the same members get the same hashed name under local
    # synchronisation, so the sequence group of the first N/2 ranks is CFG x sequence's first inner group
    contexts: Dict[int, Any] = {}
    layouts = {}
    made: Dict[Tuple[int, ...], Any] = {}
    for n in sorted(ns, reverse=True):
        members = tuple(range(n))
        contexts[n] = made.get(members) or _subcontext(ctx, list(members))
        if n > 1 and n % 2 == 0 and "cfg" in plan["modes"] and contexts[n] is not None:
            layouts[n] = RankGroups(contexts[n], 2).layout
            inner = layouts[n].inner
            if inner.world_size > 1:
                made[tuple(inner.global_ranks)] = inner
    _log(ctx, start, f"groups ready for N in {ns}")
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    doc = dict(plan["doc"], records=[])
    for name in plan["presets"]:
        preset = PRESETS[name]
        warmup = plan["warmup"] if plan["warmup"] is not None else preset.warmup
        iters = plan["iters"] if plan["iters"] is not None else preset.iters
        weights = _weights_bytes(preset, plan["size"], itemsize)
        # ranks sharing one device hold as many full copies as fit it; with one GPU per rank each holds its own
        own_gpu = bool(plan.get("gpu_per_rank"))
        fit = max(ns) if own_gpu else max([n for n in ns if n <= ranks_that_fit(weights, total, world)] or [1])
        cases = plan_cases(preset, plan["size"], ns, plan["modes"])
        model = inputs = None
        _log(ctx, start, f"{name}: building on {fit} ranks")
        try:
            if ctx.rank < fit:
                if device.type == "cuda":
                    torch.cuda.set_per_process_memory_fraction(0.97 if own_gpu else min(1.0, 0.97 / fit), device)
                model = build_random(preset, plan["size"], device, dtype, seed=0)
                inputs = make_inputs(preset, plan["size"], device, dtype, seed=1)
            built_err = None
        except Exception as exc:  # recorded; every rank still meets at the collective below
            built_err = f"{type(exc).__name__}: {exc}"
            model = inputs = None
        errs = all_gather_object(built_err, ctx)
        _log(ctx, start, f"{name}: {weights / _GIB:.1f} GiB of weights, built on {fit} of {world} ranks"
                         + (f"; build failed: {[e for e in errs if e]}" if any(errs) else ""))
        ref_call_ms = ref_measured_ms = None
        ref_out: List[Optional[torch.Tensor]] = [None, None]
        for case in cases:
            if case.n > fit or any(errs):
                why = (f"does not fit: {case.n} full copies of {weights / _GIB:.1f} GiB + {_HEADROOM / _GIB:.0f} GiB "
                       f"head-room each exceed 97% of the device's {((total or 0) / _GIB):.0f} GiB; needs weight "
                       f"sharding (FSDP2)") if not any(errs) else f"build failed: {[e for e in errs if e][0]}"
                if ctx.rank == 0:
                    doc["records"].append(_skipped(preset, case, "not_run", why))
                    _write_doc(plan.get("out"), doc)
                continue
            go = all_gather_object(time.time() - start < plan["deadline_s"], ctx)[0]
            if not go:
                if ctx.rank == 0:
                    doc["records"].append(_skipped(preset, case, "skipped", f"deadline ({plan['deadline_s']} s) reached"))
                    _write_doc(plan.get("out"), doc)
                continue
            local, output, err = None, None, None
            if ctx.rank < case.n:
                try:
                    local, output = _measure_case(contexts[case.n], layouts.get(case.n), model, inputs, case, warmup,
                                                  iters, keep_output=ctx.rank == 0, cfg_inner=plan["cfg_inner"],
                                                  clock=plan.get("alone_clock", "prefilled"),
                                                  profile=(os.path.join(plan["profile_dir"], name) if plan.get("profile_dir") else None),
                                                  compile_mode=plan.get("compile"),
                                                  compile_attention=plan.get("compile_attention", "compiled"),
                                                  concurrent=bool(plan.get("concurrent")),
                                                  share_modulation=plan.get("modulation", "shared") == "shared")
                    if case.mode == "none" and ctx.rank == 0 and (preset.cfg or "cfg" in plan["modes"]):
                        with torch.no_grad():  # the uncond branch of the reference, for the CFG rows' check
                            ref_out[1] = model(**inputs[1])[0].float().cpu()
                except Exception as exc:
                    err = f"{type(exc).__name__}: {exc}"
                    local = {"error": err, "traceback": traceback.format_exc()[-3000:]}
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            gathered = all_gather_object(local, ctx)[: case.n]
            if ctx.rank != 0:
                continue
            failed = [g for g in gathered if g is None or g.get("error")]
            if failed:
                rec = _skipped(preset, case, "error", (failed[0] or {}).get("error", "no result"))
                rec["traceback"] = (failed[0] or {}).get("traceback")
            else:
                rec = _summarise(preset, case, gathered, warmup, ref_call_ms, plan["size"], itemsize, ref_measured_ms)
                if case.mode == "none":
                    ref_call_ms = rec["compute_ms_per_call_alone"]
                    if rec.get("measured"):  # one rank alone: its measured step is the measured speed-ups' reference
                        ref_measured_ms = rec["measured_ms_per_call"]
                        rec["speedup_measured"] = 1.0
                    ref_out[0] = output
                    rec["reference_step_ms"] = ref_call_ms * _reference_calls(preset, case)
                    rec["speedup_modelled"] = {k: round(rec["reference_step_ms"] / v, 3) for k, v in rec["modelled_step_ms"].items()}
                elif output is not None and ref_out[0] is not None:
                    tol = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
                    if case.mode == "cfg":
                        rels = [_rel_l2(output[0], ref_out[0])] + ([_rel_l2(output[1], ref_out[1])] if ref_out[1] is not None else [])
                    else:
                        rels = [_rel_l2(output, ref_out[0])]
                    rel = max(rels)
                    rec["exactness"] = {"rel_l2_vs_n1": rel, "rel_l2_by_branch": rels, "tolerance": tol,
                                        "ok": bool(rel <= tol and rec["finite"]), "dtype": plan["dtype"]}
            doc["records"].append(rec)
            _write_doc(plan.get("out"), doc)
            _log(ctx, start, f"{name} {case.label}: " + (
                f"compute/call {rec['compute_ms_per_call_alone']:.1f} ms alone ({rec['alone_clock']}: gpu "
                f"{rec['gpu_ms_per_call_alone']}, issue {rec['launch_ms_per_call_alone']}, launch-bound "
                f"{rec['launch_bound']}, host-sync stages {rec['host_sync_stages_per_call']}), wire {rec['wire_bytes_per_step'] / 1e6:.1f} MB/step, "
                f"modelled speed-up nvlink {rec['speedup_modelled'].get('nvlink')} pcie-no-p2p "
                f"{rec['speedup_modelled'].get('pcie4_x16_no_p2p')}, rel {rec.get('exactness', {}).get('rel_l2_vs_n1')}, "
                f"peak GiB {rec['peak_gib_by_rank']}" if rec["status"] == "ok" else f"{rec['status']}: {rec['error']}"))
        del model, inputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        all_gather_object(None, ctx)  # every rank freed its copy before the next preset is built
    if watchdog > 0:
        faulthandler.cancel_dump_traceback_later()
    return doc if ctx.rank == 0 else None


#: the rank body :func:`.spawn.run_ranks` runs, and the report writer the driver shares
bench_rank = _bench_rank
write_doc = _write_doc
