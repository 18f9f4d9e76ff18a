#!/usr/bin/env python3
"""What a rank holds and peaks at when ComfyUI's full-size DiTs are sharded by blocks, per weight format: bf16,
fp8_e4m3fn and ComfyUI's scaled fp8 (``scale_weight`` per layer), on N spawned ranks.

Each rank builds the same seeded random-weight model of ComfyUI's own classes (Wan 2.1 14B t2v, Qwen-Image 20B) in the
format asked for, on the host (the scaled layout through ComfyUI's scaled-fp8 operations, as its loader builds a
``scaled_fp8`` checkpoint), then receives it the way a Parallel Model rank does: ``model.portable_parts`` produces
the weights one by one, ``ksampler_rank.begin_parts`` / ``fill`` / ``end_parts`` build the rank's model with its
blocks sharded (FSDP2) in their storage dtype. Reported per rank: the GPU memory held after loading (weights), the
peak of sequence-parallel sampling steps at the full size, and the seconds per step. Ranks sharing one GPU take turns
on it and gloo stages their collectives through the host: their seconds bound a rank's cost from above and are not
a card's speed.

    python tools/sharded_formats_memory.py --comfy /path/to/ComfyUI --model wan14b --weights fp8_scaled --ranks 2
    python tools/sharded_formats_memory.py --comfy /path/to/ComfyUI --model wan14b --tiny --weights fp8_scaled  # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

WAN_14B = {"image_model": "wan2.1", "model_type": "t2v", "dim": 5120, "ffn_dim": 13824, "num_heads": 40,
           "num_layers": 40, "patch_size": (1, 2, 2), "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16,
           "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
#: ComfyUI's QwenImageTransformer2DModel defaults are Qwen-Image's released configuration (60 layers, 24 x 128 heads)
QWEN_20B = {"image_model": "qwen_image"}
TINY = {"wan14b": dict(WAN_14B, dim=256, ffn_dim=256, num_heads=2, num_layers=2, text_dim=64, freq_dim=32),
        "qwen": dict(QWEN_20B, num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                     axes_dims_rope=(8, 12, 12))}
WEIGHTS = ("bf16", "fp8_e4m3fn", "fp8_scaled")


def _config(kind, tiny, weights, compute):
    import comfy.supported_models as sm

    cfg = dict(TINY[kind] if tiny else (WAN_14B if kind == "wan14b" else QWEN_20B))
    conf = sm.WAN21_T2V(cfg) if kind == "wan14b" else sm.QwenImage(cfg)
    if weights == "fp8_scaled":  # what ComfyUI's loader sets for a checkpoint with the scaled_fp8 marker
        conf.scaled_fp8 = torch.float8_e4m3fn
        conf.set_inference_dtype(compute, None)
    elif weights == "fp8_e4m3fn":  # stored in fp8, cast per layer to the compute dtype (ComfyUI's manual cast)
        conf.set_inference_dtype(torch.float8_e4m3fn, compute)
    else:
        conf.set_inference_dtype(compute, None)
    return conf, cfg


def build(kind, tiny, weights, compute, gen_device):
    """The seeded random-weight BaseModel on the host in ``weights``' format (values drawn on ``gen_device``)."""
    conf, cfg = _config(kind, tiny, weights, compute)
    base = conf.get_model({}, device="meta")
    dm = base.diffusion_model
    dm.to_empty(device="cpu")
    g = torch.Generator(device=gen_device).manual_seed(7)
    with torch.no_grad():
        for name, p in dm.named_parameters():
            if name.endswith(("scale_weight", "scale_input")):
                continue  # set with their weight below
            fan = p[0].numel() if p.ndim > 1 else 1
            w = torch.randn(p.shape, generator=g, device=gen_device, dtype=torch.float32)
            if p.ndim > 1:
                w = w / fan ** 0.5
            else:
                w = (1.0 if "norm" in name or name.endswith("scale") else 0.0) + 0.02 * w
            owner = dm.get_submodule(name.rsplit(".", 1)[0]) if "." in name else dm
            scale = getattr(owner, "scale_weight", None) if name.endswith("weight") else None
            if scale is not None and p.dtype == torch.float8_e4m3fn:
                s = (w.abs().max() / 448.0).clamp_min(1e-12)
                scale.copy_(s.to(scale.dtype).cpu())
                w = w / s
                if getattr(owner, "scale_input", None) is not None:
                    owner.scale_input.fill_(1.0)
            p.copy_(w.to(p.dtype).cpu())
    return base, cfg


def _inputs(kind, tiny, cfg, frames, steps):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "comfyui"))
    from rank_harness import sampling_inputs

    g = torch.Generator().manual_seed(3)
    if kind == "wan14b":
        h, w = (64, 64) if tiny else (480, 832)
        latent = torch.zeros(1, 16, (frames - 1) // 4 + 1, h // 8, w // 8)
        width, tokens = cfg["text_dim"], 512
    else:
        h, w = (64, 64) if tiny else (1024, 1024)
        latent = torch.zeros(1, 16, 1, h // 8, w // 8)  # Qwen-Image's latent is a one-frame video latent
        width, tokens = cfg.get("joint_attention_dim", 3584), 256

    def cond():
        return [[torch.randn(1, tokens, width, generator=g), {}]]

    cfg_scale = 5.0 if kind == "wan14b" else 4.0
    return latent, sampling_inputs(latent, None, cond(), cond(), "euler", cfg_scale, steps=steps)


def _rank(ctx, opts):
    from patchray.distributed import comm
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.distributed.sampling.ship import fill_tensors, parts_by_bytes
    from patchray.distributed.sampling.weights import from_arrays, to_arrays
    from patchray.nodes.bridge import ksampler_rank as kr
    from patchray.nodes.bridge import rank_call
    from patchray.nodes.bridge.dit_layout import plan_layout
    from patchray.nodes.bridge.model import portable_parts

    kr.prepare(ctx, opts["comfy"])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "comfyui"))
    from rank_harness import patcher, rank_run_inputs

    cuda = ctx.device.type == "cuda"
    compute = torch.bfloat16 if cuda else torch.float32
    base, cfg = build(opts["model"], opts["tiny"], opts["weights"], compute, ctx.device)
    source = patcher(base)
    latent, inputs = _inputs(opts["model"], opts["tiny"], cfg, opts["frames"], opts["steps"])
    rank_call.travel_by_value = lambda *a, **k: None  # no Ray here: nothing is pickled
    layout = plan_layout("sequence", ctx.world_size, inputs["cfg"], 1, sequence_refusal=None)
    run = rank_run_inputs(source, dict(inputs), layout, "dit", "auto")
    _, make_skeleton, names, tensor, sizes = portable_parts(source, layout.mode)
    record = {"rank": ctx.rank, "weights": opts["weights"], "sharding": opts["sharding"], "layout": layout.mode,
              "model_bytes": sum(sizes.values()),
              "stored_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in base.diffusion_model.parameters()})}
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(ctx.device)
    t0 = time.perf_counter()
    built, module = kr.begin_parts(ctx, dict(make_skeleton(), sharding=opts["sharding"]))
    for group in parts_by_bytes(((n, sizes[n]) for n in names), 256 * 1024 * 1024):
        arrays, views = to_arrays({n: tensor(n) for n in group})
        fill_tensors(module, from_arrays(arrays, views, copy=False), ctx)
    rank_mp = kr.end_parts(ctx, built)
    record["load_seconds"] = time.perf_counter() - t0
    del source, base, tensor, make_skeleton
    gc.collect()
    handle = rank_mp.model.__dict__.get("_patchray_shards")
    if handle is not None:
        shapes = handle.local_shapes()
        record["shard_dtypes"] = sorted({str(dt).replace("torch.", "") for _, _, dt in shapes.values()})
        record["units"] = len(handle.units)
    record["rank_model_bytes"] = int(rank_mp.size)
    if cuda:
        torch.cuda.synchronize()
        record["held_gib_after_load"] = (torch.cuda.memory_allocated(ctx.device) - before) / 2**30
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times = []
    for _ in range(opts["repeats"] + 1):
        session = RankSession(ctx, "model", preset("full_sync", split_batch=False))
        session.begin()
        comm.barrier(ctx)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = session.finalize(kr.sample(ctx, rank_mp, session, dict(run)))
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / opts["steps"])
        session.close()
    record["s_per_step_shared"] = times  # the first run includes the warm-up
    record["peak_gib_sampling"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if cuda else None
    record["latent"] = list(latent.shape)
    record["out_finite"] = bool(torch.isfinite(out.float()).all())
    if handle is not None:
        record["gathered_bytes_per_run"] = int(handle.tally.gathered)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy", required=True, help="the ComfyUI folder")
    p.add_argument("--model", choices=["wan14b", "qwen"], default="wan14b")
    p.add_argument("--weights", choices=WEIGHTS, default="fp8_scaled")
    p.add_argument("--sharding", choices=["none", "blocks", "blocks+offload"], default="blocks")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="runs after the first (which includes the warm-up)")
    p.add_argument("--tiny", action="store_true", help="a small model (checks the script on CPU)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from patchray.distributed.spawn import run_ranks

    cuda = torch.cuda.is_available() and not args.tiny
    opts = dict(vars(args), comfy=os.path.abspath(args.comfy))
    per_rank = run_ranks(_rank, args.ranks, opts, backend="gloo", device="cuda" if cuda else "cpu", timeout_s=1800.0)
    record = {"model": args.model, "tiny": args.tiny, "ranks": args.ranks, "weights": args.weights,
              "sharding": args.sharding, "steps": args.steps, "frames": args.frames,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "ranks_share_one_gpu": cuda, "per_rank": per_rank}
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
