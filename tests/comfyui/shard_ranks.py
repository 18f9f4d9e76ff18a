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

Scaled fp8 (``*-scaled``): a Wan 2.1 t2v written in ComfyUI's scaled-fp8 checkpoint layout (a ``scaled_fp8`` marker key,
every Linear's weight stored as ``weight / scale`` in float8_e4m3fn beside its 0-d ``scale_weight`` and
``scale_input``) and loaded back by ``comfy.sd.load_diffusion_model``, whose detection builds it with
``comfy.ops.scaled_fp8_ops`` (compute in fp32); sampled with sequence and with cfg parallelism, and with a LoRA
(``*-scaled-lora``: ComfyUI patches such a weight through the layer's ``convert_weight`` / ``set_weight``).
LTX-Video (``ltxv-seq``, ``dit_ranks_qwen_hunyuan_ltxv._model``: ComfyUI's ``LTXVModel`` through its stock loader) with sequence
parallelism: its RoPE reaches each block as an argument, cut per rank by a hook on the (then FSDP-wrapped) block;
HunyuanVideo image-to-video "v2" (``hunyuani2v-seq``, cfg 1 as in ``dit_ranks_qwen_hunyuan_ltxv``): its first-frame modulation
boundary is moved per rank by a hook on each (then FSDP-wrapped) block too.

    python tests/comfyui/shard_ranks.py --comfy /path/to/ComfyUI --ranks 2 [--out r.json]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_harness import rank_main, rank_run_inputs, stock_sample  # noqa: E402

# name -> (model kind, parallelism, weights: None, "fp8" (per-layer cast), "scaled" (scaled-fp8 checkpoint), "scaled-lora")
CASES = {
    "flux-seq": ("flux", "sequence", None),
    "wan21-seq": ("wan21", "sequence", None),
    "unet-cfg": ("unet", "cfg", None),
    "flux-seq-fp8": ("flux", "sequence", "fp8"),
    "wan21-seq-scaled": ("wan21s", "sequence", "scaled"),
    "wan21-cfg-scaled": ("wan21s", "cfg", "scaled"),
    "wan21-seq-scaled-lora": ("wan21s", "sequence", "scaled-lora"),
    "ltxv-seq": ("ltxv", "sequence", None),
    "hunyuani2v-seq": ("hunyuani2v", "sequence", None),
    "vace-seq": ("vace", "sequence", None),
    "sd3-seq": ("sd3", "sequence", None),
    "lumina2-seq": ("lumina2", "sequence", None),
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


def _scaled_wan(lora):
    """A small Wan 2.1 t2v in ComfyUI's scaled-fp8 checkpoint layout, loaded by ComfyUI's own detection (dim 256: its
    detection reads the heads as dim / 128; text width 4096, its default), compute in fp32; with ``lora`` a rank-4
    LoRA over every Linear of the blocks (about 10 % of each weight), added the way the stock LoraLoader adds it."""
    import tempfile

    import comfy.sd
    import comfy.supported_models as sm
    import comfy.utils
    from rank_harness import random_model
    from safetensors.torch import save_file

    cfg = {"image_model": "wan2.1", "model_type": "t2v", "dim": 256, "ffn_dim": 256, "num_heads": 2, "num_layers": 2,
           "patch_size": (1, 2, 2), "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16,
           "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
    dm = random_model(sm.WAN21_T2V(cfg)).diffusion_model
    sd = {k: v.contiguous() for k, v in dm.state_dict().items()}
    g = torch.Generator().manual_seed(11)
    linears = [name for name, m in dm.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in linears:  # the checkpoint's layout: weight / scale in fp8, the 0-d scales beside it
        w = sd[name + ".weight"]
        scale = (w.abs().max() / 448.0 * (1 + torch.rand((), generator=g))).float()
        sd[name + ".weight"] = (w / scale).to(torch.float8_e4m3fn)
        sd[name + ".scale_weight"] = scale.reshape(())
        sd[name + ".scale_input"] = torch.ones(())  # read only by fp8 matrix multiplication (not on CPU)
    sd["scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)  # the marker, as comfy.model_base writes it
    with tempfile.TemporaryDirectory(prefix="patchray-scaled-") as d:
        path = os.path.join(d, "wan_scaled_fp8.safetensors")
        save_file(sd, path)
        mp = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
    base = mp.model
    q = base.diffusion_model.blocks[0].self_attn.q
    assert base.model_config.scaled_fp8 == torch.float8_e4m3fn and type(base.diffusion_model).__name__ == "WanModel"
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale_weight.dim() == 0 and hasattr(q, "set_weight"), q
    assert torch.equal(q.scale_weight, sd["blocks.0.self_attn.q.scale_weight"])
    if lora:
        lo = {}
        for name in (n for n in linears if n.startswith("blocks.")):
            out_f, in_f = sd[name + ".weight"].shape
            key = "diffusion_model." + name
            lo[key + ".lora_down.weight"] = torch.randn(4, in_f, generator=g) / in_f**0.5
            lo[key + ".lora_up.weight"] = torch.randn(out_f, 4, generator=g) * 0.1 / in_f**0.5 * 4
            lo[key + ".alpha"] = torch.tensor(4.0)
        mp, _ = comfy.sd.load_lora_for_models(mp, None, lo, 1.0, 0.0)
        assert len(mp.patches) == len([n for n in linears if n.startswith("blocks.")]), sorted(mp.patches)[:3]

    def cond(g, b=1):
        return [[torch.randn(b, 7, 4096, generator=g), {}]]

    return mp, cond, (1, 16, 5, 9, 6)


def _build(kind, weights, parallelism, cfg_scale):
    """(ModelPatcher, the KSampler's inputs) of a case."""
    if kind in ("ltxv", "hunyuani2v"):
        from dit_ranks_qwen_hunyuan_ltxv import CFG, _inputs as more_inputs, _model as more_model

        mp, cond, shape, mask = more_model(kind)
        return mp, more_inputs(kind, cond, shape, mask, "euler", 1, parallelism, "gathered", CFG.get(kind, cfg_scale))
    from dit_ranks import _inputs, _model

    if kind == "wan21s":
        mp, cond, shape = _scaled_wan(lora=weights == "scaled-lora")
    else:
        mp, cond, shape = _model(kind)
    if weights == "fp8":
        _fp8(mp)
    return mp, _inputs(kind, cond, shape, "euler", 1, parallelism, "gathered", cfg_scale)


def _comfy_patched(mp):
    """The weights ComfyUI's own patching writes into the model (``ModelPatcher.patch_weight_to_device`` per patched
    key, on the host as on CPU ranks; the model unpatched after)."""
    import comfy.utils

    m = mp.clone()
    out = {}
    with torch.no_grad():  # as ComfyUI's loader calls it
        for k in m.patches:
            m.patch_weight_to_device(k)
            out[k] = comfy.utils.get_attr(m.model, k).detach().clone()
    m.unpatch_model()
    return out


def _rank(ctx, opts):
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
        kind, parallelism, weights = CASES[name]
        torch.manual_seed(0)
        mp, inputs = _build(kind, weights, parallelism, opts["cfg"])
        is_unet = kind == "unet"
        layout = plan_layout(parallelism, ctx.world_size, inputs["cfg"], 1, sequence_refusal=None)
        comfy_patched = _comfy_patched(mp) if weights == "scaled-lora" else None
        ref = None
        if ctx.rank == 0:
            ref = stock_sample(mp, inputs).float()
        inputs = rank_run_inputs(mp, inputs, layout, "unet" if is_unet else "dit", "gathered")
        _, make_skeleton, names, tensor, sizes = portable_parts(mp, layout.mode)
        rec = {"layout": layout.mode}
        if weights == "scaled-lora":  # what ships for the LoRA's weights: fp8 (ComfyUI's set_weight), changed by it
            live = dict(mp.model.named_parameters())
            shipped = {k: tensor(k) for k in mp.patches}
            rec["lora_weights"] = len(shipped)
            rec["lora_dtypes"] = sorted({str(t.dtype) for t in shipped.values()})
            rec["lora_changed"] = sum(not torch.equal(t.view(torch.uint8), (mp.backup[k].weight if k in mp.backup else live[k])
                                                      .detach().cpu().view(torch.uint8)) for k, t in shipped.items())
            rec["lora_equal_comfy"] = sorted(shipped) == sorted(comfy_patched) and all(
                t.dtype == comfy_patched[k].dtype and torch.equal(t.view(torch.uint8), comfy_patched[k].view(torch.uint8))
                for k, t in shipped.items())
        finals = {}
        for sharding in ("none", "blocks", "blocks+offload"):
            # what ship_model does, without Ray: the skeleton, then the weights in parts (numpy, viewed)
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
                # the 0-d parameters of the blocks (scaled fp8's scales): whole on every rank, equal to the driver's
                want = dict(mp.model.diffusion_model.named_parameters())
                scalars = {f"{path}.{n}": p for path, u in handle.units for n, p in u.named_parameters() if p.dim() == 0}
                rec["block_scalars"] = len(scalars)
                rec["block_scalars_whole"] = all(not comm.is_sharded_tensor(p) and torch.equal(p.detach().cpu(), want[k].detach().cpu())
                                                 for k, p in scalars.items())
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
