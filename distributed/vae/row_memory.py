"""Per-rank peak CUDA memory of ``row_decode`` on the FULL architectures, against the 'band 1/N' baseline.

What it measures is the ratio row mode's memory bound is stated in: per rank, at most 1.15x the peak of a plain
decode of one band (docs/vae.md, "The memory bound"). The band decode is one rank's ideal share: no halo, no
communication. The ratios are reported, not enforced: the tool measures, the reader judges.

Design decision: while only one GPU is lent, N rank processes share it under gloo (``spawn.run_ranks(...,
backend="gloo", device="cuda")``). ``torch.cuda.max_memory_allocated`` is per process, so each rank's figure is
honest; speed is not (the ranks share one GPU and gloo stages halos through the host), so only memory is
reported. Each rank builds the family's full-size VAE (synthetic weights, bf16), decodes once to warm up, resets
the peak counter and decodes again. Rank 0 then also measures the baseline itself: a plain ``vae.decode`` of the
first ``h // N`` latent rows, no adapters, no communication (the "band 1/N" decode), so the ratio is taken
against a figure from the same PyTorch build; the figure recorded on one H200 (:data:`RECORDED_BAND_GIB`) is
printed beside it.

Ranks sharing one GPU also share its free memory: each rank's caching allocator may hold far more than it has
allocated (HunyuanVideo-1.5 at N = 4 ran out of memory that way with ~23 GiB allocated per rank). The ranks
therefore run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (unless the caller set it) and return
their cached blocks after the warm-up; ``--memory-fraction`` also caps each rank's allocator (past the cap it
frees its cache and retries before failing). None of these changes ``max_memory_allocated``, the figure reported.

Usage::

    python -m patchray.distributed.vae.row_memory --families kl flux2 --ranks 2 4 --out results/row_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

import torch

__all__ = ["CANONICAL_SMALL", "RECORDED_BAND_GIB", "measure", "main"]

GIB = 1024**3

#: the family's smaller canonical benchmark shape (height, width, frames), height first (docs/benchmark.md)
CANONICAL_SMALL = {
    "kl": (1024, 1024, 1),
    "flux2": (1024, 1024, 1),
    "qwen_image": (1024, 1024, 1),
    "wan": (480, 832, 81),
    "hunyuan_video": (480, 832, 129),
    "hunyuan_video_15": (480, 832, 129),
    "ltx2": (1024, 1536, 121),
    "wan22": (704, 1280, 121),
    "ltx_video": (704, 1216, 121),
    "ltx_video_090": (512, 768, 121),
    "hunyuan_video_full_attention": (480, 832, 129),
    "hunyuan_image": (2048, 2048, 1),
    "hunyuan_image_refiner": (2048, 2048, 1),
}

#: band 1/N peaks (GiB, ``max_memory_allocated``, weights included) measured for those shapes on one NVIDIA H200 with
#: PyTorch 2.11 + CUDA 13, diffusers 0.42.1, bf16, synthetic weights (2026-11-29); the table is in docs/vae.md
RECORDED_BAND_GIB = {
    "kl": {2: 1.38, 4: 0.79},
    "flux2": {2: 1.39, 4: 0.79},
    "qwen_image": {2: 2.34, 4: 1.31},
    "wan": {2: 2.47, 4: 1.38},
    "hunyuan_video": {2: 11.47, 4: 6.02},
    "hunyuan_video_15": {2: 45.67, 4: 22.63},
    "ltx2": {2: 12.74, 4: 7.54},
}


def _rank_task(ctx, family: str, dtype_name: str, memory_fraction: float = 0.0, shape_hwf=None) -> dict:
    from .families import build_vae, latent_shape
    from .row import _decode_band, row_bands, row_decode

    if memory_fraction:
        # caps what this process's caching allocator may reserve: past it, the allocator returns its cached
        # blocks and retries before failing, so N ranks sharing one GPU cannot starve each other with cache
        torch.cuda.set_per_process_memory_fraction(memory_fraction, ctx.device)
    dtype = getattr(torch, dtype_name)
    height, width, frames = shape_hwf or CANONICAL_SMALL[family]
    vae = build_vae(family, size="full", dtype=dtype, device=ctx.device)
    shape = latent_shape(family, height, width, frames=frames, size="full")
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(ctx.device, dtype)
    row_decode(vae, z, ctx)  # warm-up (allocator, kernels)
    torch.cuda.synchronize(ctx.device)
    torch.cuda.empty_cache()  # give cached blocks back: the peers on this GPU need them
    torch.cuda.reset_peak_memory_stats(ctx.device)
    out = row_decode(vae, z, ctx)
    torch.cuda.synchronize(ctx.device)
    result = {
        "rank": ctx.rank,
        "peak_gib": torch.cuda.max_memory_allocated(ctx.device) / GIB,
        "reserved_peak_gib": torch.cuda.max_memory_reserved(ctx.device) / GIB,
    }
    if ctx.rank == 0:
        result["output_shape"] = list(out.shape)
        del out
        rows = row_bands(shape[-2], ctx.world_size)[0][1]
        with torch.no_grad():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
            band = _decode_band(vae, z.narrow(-2, 0, rows))  # the plain decode, with the family's options
            torch.cuda.synchronize(ctx.device)
        result["band_peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / GIB
        del band
    return result


def measure(family: str, world_size: int, dtype: str = "bfloat16", memory_fraction: float = 0.0, shape_hwf=None) -> dict:
    """Run ``world_size`` gloo ranks on the one visible GPU; return per-rank peaks and the ratios.

    ``shape_hwf``: ``(height, width, frames)`` instead of the family's canonical shape (the recorded band figure then
    does not apply and is left out)."""
    from ..spawn import run_ranks

    # read by each rank process when it initialises CUDA (spawned children inherit the environment)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ranks = run_ranks(_rank_task, world_size, family, dtype, memory_fraction, shape_hwf, backend="gloo", device="cuda", timeout_s=1800.0)
    worst = max(r["peak_gib"] for r in ranks)
    band = ranks[0]["band_peak_gib"]
    recorded = None if shape_hwf else RECORDED_BAND_GIB.get(family, {}).get(world_size)
    height, width, frames = shape_hwf or CANONICAL_SMALL[family]
    return {
        "family": family,
        "shape_hwf": [height, width, frames],
        "world_size": world_size,
        "dtype": dtype,
        "setup": f"{world_size} gloo rank processes sharing one GPU (memory per rank is honest; speed is not)",
        "per_rank_peak_gib": [round(r["peak_gib"], 3) for r in ranks],
        "max_rank_peak_gib": round(worst, 3),
        "per_rank_reserved_peak_gib": [round(r["reserved_peak_gib"], 3) for r in ranks],
        "memory_fraction": memory_fraction or None,
        "band_measured_gib": round(band, 3),
        "ratio_to_measured_band": round(worst / band, 3),
        "band_recorded_gib": recorded,
        "ratio_to_recorded_band": round(worst / recorded, 3) if recorded else None,
        "output_shape": ranks[0]["output_shape"],
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
    }


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(CANONICAL_SMALL), choices=list(CANONICAL_SMALL))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.0,
        help="cap each rank's CUDA allocator at this fraction of the GPU (ranks sharing one GPU); 0 = no cap",
    )
    parser.add_argument("--shape", default=None, help="HEIGHTxWIDTHxFRAMES instead of each family's canonical shape")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    shape = None
    if args.shape:
        try:
            parts = [int(v) for v in args.shape.lower().split("x")]
            shape = (parts[0], parts[1], parts[2] if len(parts) > 2 else 1)
        except (ValueError, IndexError):
            parser.error(f"--shape must be HEIGHTxWIDTH or HEIGHTxWIDTHxFRAMES (got {args.shape!r})")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    results: List[Dict] = []
    if args.out and os.path.exists(args.out):  # several invocations (one shape each) append to one record
        with open(args.out) as f:
            results = json.load(f)
    for family in args.families:
        for n in args.ranks:
            try:
                row = measure(family, n, args.dtype, args.memory_fraction, shape)
            except Exception as exc:  # keep measuring the other cases; the error is part of the record
                row = {"family": family, "world_size": n, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            results.append(row)
            if "error" in row:
                print(f"{family:17s} N={n}: FAILED {row['error'][:300]}", flush=True)
            else:
                print(
                    f"{family:17s} N={n}: per-rank peak {row['max_rank_peak_gib']:7.2f} GiB | band measured "
                    f"{row['band_measured_gib']:7.2f} (x{row['ratio_to_measured_band']:.3f}) | recorded "
                    f"{row['band_recorded_gib']} (x{row['ratio_to_recorded_band']})",
                    flush=True,
                )
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
