"""The sampling benchmark's driver-side summary of a case: the case table, agreement with the reference, the
per-step compute (measured alone where the ranks took turns) and the link-modelled latency and speed-up (MODELLED),
as ``sample_bench.py``'s module docstring describes.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

__all__ = ["ALL_CASES", "agreement", "latent_preview", "summarise", "alone_steps", "link_model"]

#: case name -> (preset, overrides)
ALL_CASES = {
    "full_sync": ("full_sync", {}),
    "displaced": ("displaced", {}),
    "guide": ("otil_unsynced", {}),  # case key kept so recorded results still match
    "otil": ("otil", {}),
    "balanced": ("balanced", {}),
    "otil_c4": ("otil", {"compress_bits": 4}),
    "otil_adaptive": ("otil", {"adaptive_k": True, "comm_budget_ms": 0.5}),
    "otil_cfghalf": ("otil", {"cfg_repair_half": True}),
    "compressed": ("compressed", {}),
    "compressed_2bit": ("compressed_2bit", {}),
    "compressed_1bit": ("compressed_1bit", {}),
    "otil_compressed": ("otil_compressed", {}),
}

# SDXL's latent -> RGB preview factors (rows: latent channels; columns: R, G, B) and bias
_SDXL_RGB = [[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362], [-0.3165, -0.2492, -0.2188]]
_SDXL_RGB_BIAS = [0.1084, -0.0175, -0.0011]


def latent_preview(latent: torch.Tensor) -> torch.Tensor:
    """(B, 4, h, w) latent -> (B, 3, h, w) RGB preview (SDXL's linear preview map)."""
    f = torch.tensor(_SDXL_RGB, dtype=torch.float32)
    b = torch.tensor(_SDXL_RGB_BIAS, dtype=torch.float32)
    return torch.einsum("bchw,cr->brhw", latent.float(), f) + b.view(1, 3, 1, 1)


def agreement(x: torch.Tensor, ref: torch.Tensor) -> dict:
    x, ref = x.float(), ref.float()
    rel = ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    px, pr = latent_preview(x), latent_preview(ref)
    peak = (pr.max() - pr.min()).item()
    mse = ((px - pr) ** 2).mean().item()
    psnr = float("inf") if mse == 0 else 10 * math.log10(peak * peak / mse)
    return {"rel_l2": rel, "psnr_db": psnr, "max_abs": (x - ref).abs().max().item()}


def link_model():
    from . import linkmodel

    return linkmodel.LINK_PROFILES, linkmodel.model_latency_ms, True


def _modelled(step_compute_ms: float, sync_bytes: float, async_bytes: float, messages: float, profiles, model_fn) -> dict:
    out = {}
    for name, p in profiles.items():
        if model_fn is not None:
            base = model_fn(step_compute_ms, sync_bytes, messages, p)
        else:  # inline fallback: time = compute + bytes / bandwidth + latency per message
            base = step_compute_ms + messages * p.latency_us / 1e3 + sync_bytes / (p.bandwidth_gbps * 1e9) * 1e3 * (2 if p.via_host else 1)
        async_ms = async_bytes / (p.bandwidth_gbps * 1e9) * 1e3 * (2 if p.via_host else 1)
        out[name] = base + max(0.0, async_ms - step_compute_ms)
    return out


def summarise(key: str, per_rank: List[dict], ref: dict, ref_latent, plan, profiles, model_fn) -> dict:
    from ..sampling.comm_manager import KINDS

    steps = len(per_rank[0]["step_ms"])
    step_ms = [max(r["step_ms"][i] for r in per_rank) for i in range(steps)]
    turns_only = plan.get("timing") == "alone" and len(per_rank) > 1
    # per rank and step: bytes by kind; report the busiest rank's per-step bytes and the mean over ranks
    bytes_by_kind = {k: [max(r["traffic"][i]["bytes"].get(k, 0) for r in per_rank) for i in range(steps)] for k in KINDS}
    async_by_step = [max(sum(r["traffic"][i]["async_bytes"].values()) for r in per_rank) for i in range(steps)]
    colls_by_step = [max(sum(r["traffic"][i]["collectives"].values()) for r in per_rank) for i in range(steps)]
    total_by_step = [sum(bytes_by_kind[k][i] for k in KINDS) for i in range(steps)]
    compute_by_step = [max(r["step_ms"][i] - r["comm_ms"][i] for r in per_rank) for i in range(steps)]
    compute_concurrent = list(compute_by_step)
    steps_alone = alone_steps([r.get("alone") for r in per_rank], steps)
    alone_detail = alone_steps([r.get("alone") for r in per_rank], steps, detail=True)
    compute_basis = "concurrent"
    if steps_alone is not None:
        compute_by_step, compute_basis = steps_alone, "alone"
    ref_step = sorted(ref["step_ms"])[len(ref["step_ms"]) // 2]
    modelled_steps = [
        _modelled(compute_by_step[i], total_by_step[i] - async_by_step[i], async_by_step[i], colls_by_step[i], profiles, model_fn)
        for i in range(steps)
    ] if profiles else []
    modelled = {}
    for name in (profiles or {}):
        total = sum(m[name] for m in modelled_steps)
        modelled[name] = {"latency_ms": total, "ref_ms": ref_step * steps, "speedup": ref_step * steps / total if total else None}
    # the same link model with ideal compute (the reference step times the busiest rank's share of the work), so
    # the communication cost can be judged where measured compute is noise (oversubscribed CPU ranks)
    n = len(per_rank)
    split = key.endswith("@split") and n % 2 == 0
    patch_n = n // 2 if split else n
    h_lat = plan["height"] // 8
    units = h_lat // 4
    share = math.ceil(units / patch_n) * 4 / h_lat / (2 if split else 1)
    ideal_steps = [
        _modelled(ref_step * share, total_by_step[i] - async_by_step[i], async_by_step[i], colls_by_step[i], profiles, model_fn)
        for i in range(steps)
    ] if profiles else []
    modelled_ideal = {}
    for name in (profiles or {}):
        total = sum(m[name] for m in ideal_steps)
        modelled_ideal[name] = {"latency_ms": total, "speedup": ref_step * steps / total if total else None}
    case, split = key.rsplit("@", 1)
    from ..sampling.config import preset

    name, over = ALL_CASES[case]
    rec = {
        "case": case,
        "split_batch": split == "split",
        "config": preset(name, split_batch=split == "split", **{**over, **plan.get("overrides", {})}).to_dict(),
        "per_step_ms": step_ms,
        "total_ms": sum(step_ms),
        "median_step_ms": sorted(step_ms)[steps // 2],
        "measured_speedup": ((sum(ref["step_ms"]) / sum(step_ms)) if sum(step_ms) else None) if not turns_only else None,
        "per_step_ms_basis": ("turn-taking wall time (the ranks computed one at a time: not a latency)" if turns_only
                              else "the slowest rank's step, ranks at once"),
        "compute_ms_per_step": compute_by_step,
        "compute_basis": compute_basis,
        "compute_ms_per_step_concurrent": compute_concurrent,
        "compute_ms_per_step_alone": steps_alone,
        "alone_clock": (per_rank[0].get("alone") or {}).get("clock"),
        "alone_gpu_ms_per_step": [d["gpu_ms"] for d in alone_detail] if alone_detail else None,
        "alone_launch_ms_per_step": [d["launch_ms"] for d in alone_detail] if alone_detail else None,
        "alone_launch_bound_steps": sum(bool(d["launch_bound"]) for d in alone_detail) if alone_detail else None,
        "alone_host_sync_stages": sum(d["host_sync_stages"] or 0 for d in alone_detail) if alone_detail else None,
        "bytes_per_step": bytes_by_kind,
        "bytes_per_step_total": total_by_step,
        "mean_bytes_per_step": {k: sum(v) / steps for k, v in bytes_by_kind.items()},
        "async_bytes_per_step": async_by_step,
        "collectives_per_step": colls_by_step,
        "host_syncs_per_step": [max(r["host_syncs"][i] for r in per_rank) for i in range(steps)],
        "comm_log_rank0": per_rank[0]["comm_log"],
        "modelled": modelled,
        "modelled_ideal_compute": modelled_ideal,
        "ideal_compute_share": share,
    }
    latent = per_rank[0]["latent"]
    rec.update(agreement(torch.tensor(latent), torch.tensor(ref_latent)))
    return rec


def alone_steps(alone: List[Optional[dict]], steps: int, detail: bool = False):
    """Per step: the compute of its stages measured alone (``None`` without turns).

    A step's stages are those between the previous step's mark and its own; every rank marks the same steps
    and runs the same collectives, so stage k is the same work on every rank. A step's compute is
    :func:`.linkmodel.effective_compute` of its stages: per stage the slowest rank, summed, and with the prefilled
    GPU clock the CPU's issue time where it exceeds the GPU time (the launch bound). ``detail``: a list of the
    per-step :func:`.linkmodel.effective_compute` dicts instead.
    """
    from .linkmodel import effective_compute

    if not alone or any(a is None for a in alone):
        return None
    if len({len(a["compute_ms"]) for a in alone}) != 1 or any(len(a["marks"]) < steps for a in alone):
        return None
    marks = alone[0]["marks"]
    out, start = [], 0
    for i in range(steps):
        stop = marks[i]
        eff = effective_compute(alone, start, stop)
        out.append(eff if detail else float(eff["compute_ms"]))
        start = stop
    return out
