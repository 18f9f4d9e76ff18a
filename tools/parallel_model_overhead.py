#!/usr/bin/env python3
"""One rank's cost of PatchRay Parallel Model against ComfyUI's own sampling, on one GPU: s/step and peak memory, and
the one-time cost of the runtime exactness check.

What a rank runs for a patched MODEL (``nodes/bridge/ksampler_rank.sample``: the driver's guider rebuilt around the
rank's model, PatchRay's wrappers at ComfyUI's extension points, ComfyUI's sampler loop) against the stock call
(``comfy.sample.sample``) on the same ModelPatcher, seeded inputs and GPU, alternating, after a warm-up of each. The
model is a full-size random-weight model of ComfyUI's own classes (FLUX.1 dev's or Wan 2.1 14B's released
configuration) built on the GPU in bf16. Ray's one-time shipping of the weights to a rank is not part of a step and is
not measured here; with one rank no collective runs.

    python tools/parallel_model_overhead.py --comfy /path/to/ComfyUI --model flux --out flux.json
    python tools/parallel_model_overhead.py --comfy /path/to/ComfyUI --model wan14b --frames 33 --out wan.json

With ``--ranks N`` (N > 1) it runs N spawned ranks instead (gloo; on one GPU they share it), each building the same
seeded model: the runtime exactness check as a rank runs it before the first sequence-parallel step (seconds, each
rank's peak memory), and then sequence-parallel sampling steps of the full-size input (s/step, peak memory). Ranks
sharing one GPU run one after another's kernels, so these seconds bound a rank's cost from above.

    python tools/parallel_model_overhead.py --comfy /path/to/ComfyUI --model flux --ranks 2 --steps 2 --out flux_n2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

FLUX_DEV = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
            "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
            "axes_dim": [16, 56, 56], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
WAN_14B = {"image_model": "wan2.1", "model_type": "t2v", "dim": 5120, "ffn_dim": 13824, "num_heads": 40,
           "num_layers": 40, "patch_size": (1, 2, 2), "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16,
           "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
TINY = {"flux": dict(FLUX_DEV, hidden_size=96, num_heads=4, depth=1, depth_single_blocks=1, axes_dim=[8, 8, 8],
                     context_in_dim=64, vec_in_dim=32),
        "wan14b": dict(WAN_14B, dim=96, ffn_dim=128, num_heads=4, num_layers=2, text_dim=64, freq_dim=32)}


def build(kind: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    """A ModelPatcher of the model, its weights random (seeded) on ``device``, and its conditioning width."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models as sm

    cfg = dict(TINY[kind] if tiny else (FLUX_DEV if kind == "flux" else WAN_14B))
    conf = sm.Flux(cfg) if kind == "flux" else sm.WAN21_T2V(cfg)
    conf.set_inference_dtype(dtype, None)
    base = conf.get_model({}, device=device)
    g = torch.Generator(device=device).manual_seed(7)
    with torch.no_grad():
        for name, p in base.diffusion_model.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype) / p[0].numel() ** 0.5)
            else:
                p.copy_((1.0 if "norm" in name or name.endswith("scale") else 0.0)
                        + 0.02 * torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype))
    mp = comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())
    width = cfg["context_in_dim"] if kind == "flux" else cfg["text_dim"]
    return mp, width, cfg.get("vec_in_dim")


def _inputs(kind, tiny, height, width, frames, steps, width_cond, pooled):
    """The seeded latent, conditionings and KSampler inputs of one run (the same on every rank)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "comfyui"))
    from rank_harness import sampling_inputs

    g = torch.Generator().manual_seed(3)
    h = height or (1024 if kind == "flux" else 480)
    w = width or (1024 if kind == "flux" else 832)
    if tiny:
        h, w = 64, 64
    if kind == "flux":
        latent = torch.zeros(1, 16, h // 8, w // 8)
        extra = {"pooled_output": torch.randn(1, pooled, generator=g)}
        cond = lambda: [[torch.randn(1, 256, width_cond, generator=g), dict(extra, guidance=3.5)]]  # noqa: E731
        cfg_scale = 1.0  # FLUX dev: guidance distilled, one conditioning per step
    else:
        latent = torch.zeros(1, 16, (frames - 1) // 4 + 1, h // 8, w // 8)
        cond = lambda: [[torch.randn(1, 512, width_cond, generator=g), {}]]  # noqa: E731
        cfg_scale = 5.0
    return latent, cfg_scale, sampling_inputs(latent, None, cond(), cond(), "euler", cfg_scale, steps=steps)


def _rank(ctx, opts):
    """One of N ranks: the exactness check, then sequence-parallel sampling steps; this rank's figures."""
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.nodes.bridge import ksampler_rank as kr
    from patchray.nodes.bridge import rank_call
    from patchray.nodes.bridge.dit_layout import plan_layout

    kr.prepare(ctx, opts["comfy"])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "comfyui"))
    from rank_harness import rank_run_inputs

    import comfy.model_management as mm

    cuda = ctx.device.type == "cuda"
    device = mm.get_torch_device()
    dtype = torch.bfloat16 if cuda or opts["bf16"] else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    mp, width, pooled = build(opts["model"], opts["tiny"], device, dtype)
    latent, cfg_scale, inputs = _inputs(opts["model"], opts["tiny"], opts["height"], opts["width"], opts["frames"],
                                        opts["steps"], width, pooled)
    rank_call.travel_by_value = lambda *a, **k: None  # pickling for Ray is not what this measures (no Ray here)
    layout = plan_layout("sequence", ctx.world_size, cfg_scale, 1, sequence_refusal=None)
    run = rank_run_inputs(mp, dict(inputs), layout, "dit", "auto")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    from patchray.distributed import comm
    from patchray.nodes.bridge import dit_models
    from patchray.nodes.bridge.dit_models import find_row

    dm = mp.model.diffusion_model
    comm.barrier(ctx)
    sync()
    t0 = time.perf_counter()
    check = kr.verify_sequence(ctx, ctx, mp.clone(), find_row(type(dm).__name__), dm, dict(run))
    sync()
    record = {"rank": ctx.rank, "layout": layout.mode, "seq_ranks": layout.seq_ranks,
              "exactness_check": dict(check, wall_seconds=time.perf_counter() - t0),
              "weights_gib": sum(p.numel() * p.element_size() for p in dm.parameters()) / 2**30, "s_per_step": []}
    row = find_row(type(dm).__name__)
    flipped = {dit_models.PREFIX: dit_models.SUFFIX, dit_models.SUFFIX: dit_models.PREFIX}.get(getattr(row, "text", None))
    if flipped is not None:  # the same check on a wrong row (text on the other side of the image): must refuse
        from patchray.distributed.sampling.exactness import ExactnessMismatch

        try:
            record["flipped_row"] = kr.verify_sequence(ctx, ctx, mp.clone(), row._replace(text=flipped), dm, dict(run))
        except ExactnessMismatch as exc:
            record["flipped_row"] = {"refused": str(exc)}
    for _ in range(opts["repeats"] + 1):  # the first run warms up
        session = RankSession(ctx, "model", preset("full_sync", split_batch=False))
        session.begin()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        comm.barrier(ctx)
        sync()
        t0 = time.perf_counter()
        out = session.finalize(kr.sample(ctx, mp, session, dict(run)))
        sync()
        record["s_per_step"].append((time.perf_counter() - t0) / opts["steps"])
        session.close()
    record["s_per_step"] = record["s_per_step"][1:]
    record["peak_gib_sampling"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    record["latent"] = list(latent.shape)
    record["out_finite"] = bool(torch.isfinite(out.float()).all())
    return record


def _main_ranks(args) -> int:
    from patchray.distributed.spawn import run_ranks

    cuda = torch.cuda.is_available() and not args.tiny
    opts = {"comfy": os.path.abspath(args.comfy), "model": args.model, "tiny": args.tiny, "height": args.height,
            "width": args.width, "frames": args.frames, "steps": args.steps, "repeats": args.repeats,
            "bf16": args.bf16}
    per_rank = run_ranks(_rank, args.ranks, opts, backend="gloo", device="cuda" if cuda else "cpu", timeout_s=1800.0)
    record = {"model": args.model, "tiny": args.tiny, "ranks": args.ranks, "steps": args.steps,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "ranks_share_one_gpu": cuda, "per_rank": per_rank}
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy", required=True, help="the ComfyUI folder")
    p.add_argument("--model", choices=["flux", "wan14b"], default="flux")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a small model (checks the script on CPU)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights on CPU too (on a GPU they always are)")
    p.add_argument("--ranks", type=int, default=1, help="N > 1: the check and sequence-parallel steps on N ranks")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.ranks > 1:
        return _main_ranks(args)
    sys.path.append(os.path.abspath(args.comfy))
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
    from patchray.distributed.context import ParallelContext
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.nodes.bridge import ksampler_rank as kr
    from patchray.nodes.bridge import rank_call
    from patchray.nodes.bridge.dit_layout import plan_layout

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "comfyui"))
    from rank_harness import rank_run_inputs, sampling_inputs, stock_sample

    import comfy.model_management as mm

    device = mm.get_torch_device()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    mp, width, pooled = build(args.model, args.tiny, device, dtype)
    g = torch.Generator().manual_seed(3)
    h = args.height or (1024 if args.model == "flux" else 480)
    w = args.width or (1024 if args.model == "flux" else 832)
    if args.tiny:
        h, w = 64, 64
    if args.model == "flux":
        latent = torch.zeros(1, 16, h // 8, w // 8)
        extra = {"pooled_output": torch.randn(1, pooled, generator=g)}
        cond = lambda: [[torch.randn(1, 256, width, generator=g), dict(extra, guidance=3.5)]]  # noqa: E731
        cfg_scale = 1.0  # FLUX dev: guidance distilled, one conditioning per step
    else:
        latent = torch.zeros(1, 16, (args.frames - 1) // 4 + 1, h // 8, w // 8)
        cond = lambda: [[torch.randn(1, 512, width, generator=g), {}]]  # noqa: E731
        cfg_scale = 5.0
    inputs = sampling_inputs(latent, None, cond(), cond(), "euler", cfg_scale, steps=args.steps)
    rank_call.travel_by_value = lambda *a, **k: None  # pickling for Ray is not what this measures (no Ray here)
    layout = plan_layout("auto", 1, cfg_scale, 1, sequence_refusal=None)
    rank_inputs = rank_run_inputs(mp, dict(inputs), layout, "dit", "auto")
    ctx = ParallelContext.single(device)
    session = RankSession(ctx, "model", preset("full_sync", split_batch=False))

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def stock():
        return stock_sample(mp, inputs)

    def ours():
        session.begin()
        return session.finalize(kr.sample(ctx, mp, session, dict(rank_inputs)))

    record = {"model": args.model, "tiny": args.tiny, "latent": list(latent.shape), "steps": args.steps,
              "dtype": str(dtype), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "torch": torch.__version__, "runs": {"stock": [], "parallel_model_1_rank": []}, "peak_gib": {}}
    outs = {}
    for name, fn in (("stock", stock), ("parallel_model_1_rank", ours)):  # warm-up (kernels, allocator)
        outs[name] = fn()
    for _ in range(args.repeats):
        for name, fn in (("stock", stock), ("parallel_model_1_rank", ours)):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            sync()
            t0 = time.perf_counter()
            outs[name] = fn()
            sync()
            record["runs"][name].append((time.perf_counter() - t0) / args.steps)
            if cuda:
                record["peak_gib"][name] = torch.cuda.max_memory_allocated(device) / 2**30
    a, b = outs["stock"].float().cpu(), outs["parallel_model_1_rank"].float().cpu()
    record["rel_l2_vs_stock"] = ((b - a).norm() / a.norm()).item()
    best = {k: min(v) for k, v in record["runs"].items()}
    record["s_per_step"] = best
    record["overhead"] = best["parallel_model_1_rank"] / best["stock"] - 1.0
    record["model_calls"] = session.calls
    # the runtime exactness check's one-time cost (a rank's share: one step of a small crop, whole and split)
    from patchray.nodes.bridge.dit_models import find_row

    dm = mp.model.diffusion_model
    sync()
    t0 = time.perf_counter()
    check = kr.verify_sequence(ctx, ctx, mp.clone(), find_row(type(dm).__name__), dm, dict(rank_inputs))
    sync()
    record["exactness_check"] = dict(check, wall_seconds=time.perf_counter() - t0,
                                     weights_gib=sum(p.numel() * p.element_size() for p in dm.parameters()) / 2**30)
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
