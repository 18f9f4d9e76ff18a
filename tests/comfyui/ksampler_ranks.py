"""The Distributed KSampler's rank side on N spawned processes, without Ray: for machines where Ray is absent.

The lent H200 machine has no Ray (and no network), so the node itself cannot run there. This script runs exactly
what the node's ranks run — ``nodes/bridge/ksampler_rank.py`` (ComfyUI's ``comfy.sample.sample`` with PatchRay's
DIFFUSION_MODEL wrapper) and ``sampling.remote.RankSession`` (the patch-parallel denoiser, the exact final gather) —
on ``spawn.run_ranks`` processes, and compares each preset with the stock sampling of the same ModelPatcher on
rank 0 (no wrapper). What it leaves out is only the transport (Ray, the model shipping; covered on CPU ranks by
``tests/distributed/test_remote_sampling.py`` and the opt-in server test).

Model: ``--ckpt FILE`` (a ComfyUI checkpoint) or ``--sdxl-random`` (the SDXL base UNet architecture with seeded
random weights, built with diffusers and loaded through ComfyUI's own diffusers-format loader). Conditioning is
synthetic (seeded tensors of the model's shapes).

    python tests/comfyui/ksampler_ranks.py --comfy /path/to/ComfyUI --sdxl-random --device cuda --ranks 2 \\
        --size 1024 --steps 10 --presets full_sync displaced otil --dtype fp32 --out ksampler.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from rank_harness import rank_run_inputs, sampling_inputs, stock_sample, write_report

GIB = 1024**3


def _load(opts):
    import comfy.sd

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[opts["dtype"]]
    if opts["ckpt"]:
        mp = comfy.sd.load_checkpoint_guess_config(opts["ckpt"], output_vae=False, output_clip=False)[0]
        return mp, 768
    from patchray.distributed.sampling import sdxl

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sd = {k: v.to("cpu") for k, v in sdxl.build_unet(False, seed=0, device=dev).state_dict().items()}
    mp = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": dtype})
    del sd
    return mp, 2048


def _inputs(opts, ctx_dim):
    g = torch.Generator().manual_seed(3)
    h = w = opts["size"] // 8
    latent = torch.zeros(1, 4, h, w)
    extra = {"pooled_output": torch.randn(1, 1280, generator=g)} if ctx_dim == 2048 else {}
    pos = [[torch.randn(1, 77, ctx_dim, generator=g), dict(extra)]]
    neg = [[torch.randn(1, 77, ctx_dim, generator=g), {k: torch.randn_like(v) for k, v in extra.items()}]]
    return sampling_inputs(latent, None, pos, neg, opts["sampler"], 6.0, steps=opts["steps"], scheduler="karras")


def _sync(ctx):
    from patchray.distributed import comm

    comm.all_reduce(torch.zeros(1, device=ctx.device), ctx)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _rank(ctx, opts):
    from patchray.distributed.sampling.comm_manager import Traffic
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.nodes.bridge import ksampler_rank as kr

    kr.prepare(ctx, opts["comfy"])

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: the exactness check compares fp32 runs
    torch.backends.cudnn.allow_tf32 = False
    cuda = ctx.device.type == "cuda"
    mp, ctx_dim = _load(opts)
    inputs = _inputs(opts, ctx_dim)
    out = {"rank": ctx.rank, "runs": {}}
    ref = None
    if ctx.rank == 0:  # the stock path: the same ModelPatcher, no wrapper, one process
        for attempt in ("warm-up", "measured"):
            if cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            t0 = time.perf_counter()
            ref = stock_sample(mp, inputs)
            if cuda:
                torch.cuda.synchronize(ctx.device)
            out["stock"] = {"seconds": round(time.perf_counter() - t0, 3),
                            "peak_gib": round(torch.cuda.max_memory_allocated(ctx.device) / GIB, 3) if cuda else None}
    inputs = rank_run_inputs(mp, inputs, None, "unet", "auto")
    _sync(ctx)
    for name in opts["presets"]:
        session = RankSession(ctx, "model", preset(name, split_batch=False))
        for attempt in ("warm-up", "measured"):
            _sync(ctx)
            if cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            t0 = time.perf_counter()
            session.begin()
            before = session.traffic.snapshot() if session.traffic is not None else None
            latent = kr.sample(ctx, mp, session, inputs)
            final = session.finalize(latent).to("cpu")
            if cuda:
                torch.cuda.synchronize(ctx.device)
            seconds = time.perf_counter() - t0
        after = session.traffic.snapshot()
        rec = {"seconds_shared_gpu": round(seconds, 3), "unet_calls": session.calls,
               "peak_gib": round(torch.cuda.max_memory_allocated(ctx.device) / GIB, 3) if cuda else None,
               "traffic_bytes": (Traffic.diff(after, before) if before else after)["bytes"]}
        if ref is not None:
            rec["rel_l2_vs_stock"] = ((final - ref.float()).norm() / ref.float().norm()).item()
            rec["max_abs_vs_stock"] = (final - ref.float()).abs().max().item()
        session.close()
        out["runs"][name] = rec
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy", required=True, help="the ComfyUI folder")
    p.add_argument("--ckpt", default="", help="a ComfyUI checkpoint file (else --sdxl-random)")
    p.add_argument("--sdxl-random", action="store_true", help="SDXL base UNet architecture, seeded random weights")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", type=int, default=1024, help="image side in pixels (latent = size / 8)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sampler", default="euler")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--presets", nargs="+", default=["full_sync", "displaced", "otil", "balanced"])
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if not args.ckpt and not args.sdxl_random:
        p.error("give --ckpt FILE or --sdxl-random")
    from patchray.distributed.spawn import run_ranks

    opts = {k: getattr(args, k) for k in ("comfy", "ckpt", "steps", "sampler", "dtype", "presets", "size")}
    opts["comfy"] = os.path.abspath(opts["comfy"])
    results = run_ranks(_rank, args.ranks, opts, backend="gloo", device=args.device, timeout_s=1800.0)
    report = {
        "setup": f"{args.ranks} gloo rank processes on {args.device}" + (" sharing one GPU (memory per rank is honest; speed is not)" if args.device == "cuda" else ""),
        "model": "ckpt " + os.path.basename(args.ckpt) if args.ckpt else "SDXL base UNet architecture, random weights (sdxl.build_unet(seed=0))",
        "size": args.size, "steps": args.steps, "sampler": args.sampler, "scheduler": "karras", "dtype": args.dtype,
        "torch": torch.__version__, "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "stock_rank0": results[0].get("stock"),
        "runs": {name: {"rank0": results[0]["runs"][name], "per_rank_peak_gib": [r["runs"][name]["peak_gib"] for r in results]}
                 for name in args.presets},
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
