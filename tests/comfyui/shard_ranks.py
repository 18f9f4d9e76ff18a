"""The Distributed KSampler's rank side with sharding=blocks and blocks+offload vs none and ComfyUI's stock sampling.

Each rank builds the model exactly as the node's ranks do — ``ksampler_rank.begin_parts`` on the skeleton the driver
makes (``model.portable_parts``), then the weights part by part as numpy arrays (``sampling.ship.fill_tensors``; here
handed over in-process instead of through Ray's store), then ``ksampler_rank.end_parts`` — with ``sharding`` none or
blocks or blocks+offload (FSDP2's CPU offload: on CPU ranks a no-op copy, but FSDP2's offload path) — and runs
``ksampler_rank.sample`` (ComfyUI's ``comfy.sample.sample`` with PatchRay's
wrappers). The final latents of the shardings are compared with each other and with ``comfy.sample.sample`` on the
unsharded ModelPatcher on rank 0. ComfyUI's own classes at small widths (``dit_ranks._model``): FLUX.1, Wan 2.1 and
an SD-style UNet (cfg parallelism: the whole model per rank, its blocks still sharded over both ranks); one case
with fp8_e4m3fn weights cast per layer by ComfyUI (manual cast) checks fp8 stays fp8 in the shards.

    python tests/comfyui/shard_ranks.py --comfy /path/to/ComfyUI --ranks 2 [--out r.json]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_harness import rank_main, rank_run_inputs, stock_sample  # noqa: E402

# name -> (dit_ranks model kind, parallelism, fp8 weights)
CASES = {
    "flux-seq": ("flux", "sequence", False),
    "wan21-seq": ("wan21", "sequence", False),
    "unet-cfg": ("unet", "cfg", False),
    "flux-seq-fp8": ("flux", "sequence", True),
}


def _fp8(mp):
    """Every 2-D Linear weight of the blocks in fp8_e4m3fn, cast per layer to the compute dtype (ComfyUI's manual cast)."""
    dm = mp.model.diffusion_model
    with torch.no_grad():
        for name, m in dm.named_modules():
            if isinstance(m, torch.nn.Linear) and "blocks" in name:
                m.weight = torch.nn.Parameter(m.weight.to(torch.float8_e4m3fn), requires_grad=False)
                m.comfy_cast_weights = True
    return mp


def _rank(ctx, opts):
    from dit_ranks import _inputs, _model

    from patchray.distributed import comm
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.nodes.bridge import ksampler_rank as kr
    from patchray.nodes.bridge.dit_layout import plan_layout
    from patchray.distributed.sampling.ship import fill_tensors, parts_by_bytes
    from patchray.distributed.sampling.weights import from_arrays, to_arrays
    from patchray.nodes.bridge.model import portable_parts

    kr.prepare(ctx, opts["comfy"])

    results = {}
    for name in opts["cases"]:
        kind, parallelism, fp8 = CASES[name]
        torch.manual_seed(0)
        mp, cond, shape = _model(kind)
        if fp8:
            _fp8(mp)
        inputs = _inputs(kind, cond, shape, "euler", 1, parallelism, "gathered", opts["cfg"])
        is_unet = kind == "unet"
        layout = plan_layout(parallelism, ctx.world_size, inputs["cfg"], 1, sequence_refusal=None)
        ref = None
        if ctx.rank == 0:
            ref = stock_sample(mp, inputs).float()
        inputs = rank_run_inputs(mp, inputs, layout, "unet" if is_unet else "dit", "gathered")
        _, make_skeleton, names, tensor, sizes = portable_parts(mp, layout.mode)
        rec = {"layout": layout.mode}
        finals = {}
        for sharding in ("none", "blocks", "blocks+offload"):
            # what ship_model_in_parts does, without Ray: the skeleton, then the weights in parts (numpy, viewed)
            built, module = kr.begin_parts(ctx, dict(make_skeleton(), sharding=sharding))
            for group in parts_by_bytes(((n, sizes[n]) for n in names), 64 * 1024):
                arrays, views = to_arrays({n: tensor(n) for n in group})
                fill_tensors(module, from_arrays(arrays, views, copy=False), ctx)
            rank_mp = kr.end_parts(ctx, built)
            handle = rank_mp.model.__dict__.get("_patchray_shards")
            dm = rank_mp.model.diffusion_model
            if handle is not None and handle.offload:
                group = handle.units[0][1]._get_fsdp_state()._fsdp_param_group
                rec["offload_policy"] = type(group.offload_policy).__name__
                rec["offload_shard_devices"] = sorted({comm.local_shard(p).device.type for _, u in handle.units
                                                       for p in u.parameters()})
                rec["offload_mp_size"] = rank_mp.size
                in_units = {id(p) for _, u in handle.units for p in u.parameters()}
                rec["offload_rest_bytes"] = sum(p.numel() * p.element_size() for p in rank_mp.model.parameters()
                                                if id(p) not in in_units)
                rec["offload_largest_block"] = max(sum(p.numel() * p.element_size() for p in u.parameters())
                                                   for _, u in handle.units)
                rec["offload_units"] = len(handle.units)
            elif handle is not None:
                shapes = handle.local_shapes()
                rec["units"] = len(handle.units)
                rec["local_block_bytes"] = sum(comm.local_shard(p).numel() * comm.local_shard(p).element_size()
                                               for _, u in handle.units for p in u.parameters())
                rec["block_bytes"] = handle.sharded_bytes
                rec["fp8_local"] = sorted({str(dt) for _, _, dt in shapes.values() if "float8" in str(dt)})
                rec["dim0_ok"] = all(l[0] <= -(-f[0] // ctx.world_size) for f, l, _ in shapes.values())
            session = RankSession(ctx, ("model", name, sharding), preset("full_sync", split_batch=False))
            session.begin()
            if handle is not None:
                handle.tally.reset()
            latent = kr.sample(ctx, rank_mp, session, inputs)
            finals[sharding] = session.finalize(latent).float().cpu()
            rec[f"calls_{sharding}"] = session.calls
            if handle is not None:
                rec["gathered_bytes" if not handle.offload else "offload_gathered_bytes"] = handle.tally.gathered
            session.close()
            del rank_mp, dm, handle
        rec["blocks_vs_none"] = ((finals["blocks"] - finals["none"]).norm() / finals["none"].norm()).item()
        rec["offload_vs_none"] = ((finals["blocks+offload"] - finals["none"]).norm() / finals["none"].norm()).item()
        if ref is not None:
            rec["none_vs_stock"] = ((finals["none"] - ref).norm() / ref.norm()).item()
            rec["blocks_vs_stock"] = ((finals["blocks"] - ref).norm() / ref.norm()).item()
        results[name] = rec
    return results


def main(argv=None):
    return rank_main(_rank, __doc__, CASES, argv, lambda results: {"per_rank": results})


if __name__ == "__main__":
    sys.exit(main())
