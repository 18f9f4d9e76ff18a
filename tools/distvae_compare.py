#!/usr/bin/env python3
"""PatchRay's row decode against DistVAE's on the same CPU cores: seconds per decode of a kl VAE (SD/SDXL/FLUX.1's
convolutional layout, diffusers' AutoencoderKL) at several image sizes and rank counts.

Every rank holds the same seeded random-weight VAE and latent. For each size: one rank decodes whole
(``vae.decode``, all the cores), then at each rank count N the ranks (gloo, ``cores / N`` threads each) decode with
PatchRay (``distributed/vae/row.row_decode``) and with DistVAE (``distvae.vae.parallelize_decoder`` on a copy of the
VAE), alternating, after a warm-up of each; the best of ``--repeats`` per library. Both results are compared with
the whole decode (fp32). Needs ``pip install distvae==0.1.0``.

    python tools/distvae_compare.py --cores 16 --ranks 2 4 --sizes 200x136 256x256 512x512 --out distvae.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

#: SD / SDXL's kl VAE (latent 4 channels, four levels, 2 resnets per level)
KL = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
          down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
          sample_size=512)


def _vae():
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**KL).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return vae


def _latent(size):
    w, h = size
    return torch.randn(1, 4, h // 8, w // 8, generator=torch.Generator().manual_seed(3))


def _timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def _rank(ctx, opts):
    import torch.distributed as dist
    from distvae.vae import parallelize_decoder

    from patchray.distributed.vae.row import row_decode

    vae = _vae()
    theirs = copy.deepcopy(vae)
    parallelize_decoder(theirs, ctx.group)
    records = []
    for size in opts["sizes"]:
        z = _latent(size)
        ref = torch.load(os.path.join(opts["refs"], f"{size[0]}x{size[1]}.pt"), weights_only=True)

        def ours():
            with torch.no_grad():
                return row_decode(vae, z, ctx)

        def dv():
            with torch.no_grad():
                return theirs.decode(z).sample

        best = {"patchray": float("inf"), "distvae": float("inf")}
        outs = {}
        for i in range(opts["repeats"] + 1):  # the first round warms up
            for name, fn in (("patchray", ours), ("distvae", dv)):
                seconds, out = _timed(fn, lambda: dist.barrier(group=ctx.group))
                outs[name] = out
                if i:
                    best[name] = min(best[name], seconds)
        rec = {"size": list(size), "ranks": ctx.world_size, "seconds": best}
        if ctx.rank == 0:
            for name, out in outs.items():
                rec[f"{name}_max_abs_vs_whole"] = float((out.float() - ref).abs().max())
        records.append(rec)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", nargs="+", default=["200x136", "256x256", "512x512"], help="WIDTHxHEIGHT in pixels")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import tempfile

    import distvae

    from patchray.distributed.spawn import run_ranks

    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes]
    torch.set_num_threads(args.cores)
    vae = _vae()
    whole = {}
    refs = tempfile.mkdtemp(prefix="distvae-compare-")
    for size in sizes:
        z = _latent(size)
        with torch.no_grad():
            vae.decode(z)  # warm-up
            times = []
            for _ in range(args.repeats):
                t, out = _timed(lambda: vae.decode(z).sample, lambda: None)
                times.append(t)
        whole[f"{size[0]}x{size[1]}"] = min(times)
        torch.save(out, os.path.join(refs, f"{size[0]}x{size[1]}.pt"))
    rows = []
    for n in args.ranks:
        threads = max(1, args.cores // n)
        per_rank = run_ranks(_rank, n, {"sizes": sizes, "repeats": args.repeats, "refs": refs}, backend="gloo",
                             device="cpu", threads=threads, timeout_s=1800.0)
        for rec in per_rank[0]:
            key = f"{rec['size'][0]}x{rec['size'][1]}"
            s = rec["seconds"]
            rows.append(dict(rec, threads_per_rank=threads, whole_seconds=whole[key],
                             speedup={k: whole[key] / v for k, v in s.items()},
                             patchray_over_distvae=s["distvae"] / s["patchray"]))
    doc = {"cores": args.cores, "torch": torch.__version__, "distvae": getattr(distvae, "__version__", "0.1.0"),
           "cpu": _cpu_name(), "whole_seconds": whole, "rows": rows}
    for r in rows:
        print(f"{r['size'][0]}x{r['size'][1]} N={r['ranks']}: whole {r['whole_seconds']:.3f} s; PatchRay "
              f"{r['seconds']['patchray']:.3f} s ({r['speedup']['patchray']:.2f}x), DistVAE {r['seconds']['distvae']:.3f} s "
              f"({r['speedup']['distvae']:.2f}x); PatchRay ahead by {100 * (r['patchray_over_distvae'] - 1):+.1f}%")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
