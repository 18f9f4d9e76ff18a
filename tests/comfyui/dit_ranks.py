"""The Distributed KSampler's DiT/CFG/batch rank side against ComfyUI's stock sampling, on N spawned gloo ranks.

Runs exactly what the node's ranks run — ``nodes/bridge/ksampler_rank.sample`` (ComfyUI's ``comfy.sample.sample``
with PatchRay's CALC_COND_BATCH and DIFFUSION_MODEL wrappers and its ``optimized_attention_override``) — on
``spawn.run_ranks`` processes, and compares the final latent with ``comfy.sample.sample`` of the same ModelPatcher on
rank 0 without any wrapper (the stock KSampler's call). Transport (Ray, shipping the model) is left out here; the
server test covers it.

Models are ComfyUI's own classes (``comfy.supported_models`` configs -> ``BaseModel`` -> ``ModelPatcher``), small
widths, every weight seeded random and non-constant: FLUX.1 (``Flux``), Wan 2.1 text-to-video and image-to-video
(``WanModel`` t2v / i2v with CLIP-vision features), Wan 2.2 5B (``WAN22``: 48 channels, per-frame timesteps from a
first-frame mask), and an SD-style UNet for CFG. Latents have odd sizes; videos an odd frame count.

    python tests/comfyui/dit_ranks.py --comfy /path/to/ComfyUI --ranks 2 --cases flux-seq wan21-cfg ... [--out r.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from types import SimpleNamespace

import torch

# name -> (model, parallelism, attention, sampler, batch)
CASES = {
    "flux-seq": ("flux", "sequence", "gathered", "euler", 1),
    "flux-seq-ulysses": ("flux", "sequence", "ulysses", "euler", 1),
    "flux-cfg": ("flux", "cfg", "auto", "euler", 1),
    "flux-cfgseq": ("flux", "cfg+sequence", "auto", "euler", 1),
    "flux-batch": ("flux", "batch", "auto", "euler_ancestral", 3),
    "chroma-seq": ("chroma", "sequence", "gathered", "euler", 1),
    "wan21-seq": ("wan21", "sequence", "gathered", "euler", 1),
    "wan21-seq-ulysses": ("wan21", "sequence", "ulysses", "dpmpp_2m", 1),
    "wan21-cfg": ("wan21", "cfg", "auto", "euler", 1),
    "wan21-cfgseq": ("wan21", "cfg+sequence", "auto", "euler", 1),
    "wan21-batch": ("wan21", "batch", "auto", "euler_ancestral", 2),
    "wan21i2v-seq": ("wan21i2v", "sequence", "gathered", "euler", 1),
    "wan22-seq": ("wan22", "sequence", "auto", "euler", 1),
    "unet-cfg": ("unet", "cfg", "auto", "euler", 1),
    # cfg = 1 on a model without a sequence split (forced here: FLUX has a row): every rank samples the whole graph
    "flux-replicated": ("flux", "replicated", "auto", "euler", 1),
    "unet-cfgseq": ("unet", "cfg+sequence", "auto", "euler", 1),
}


def _init(module, seed):
    """Every parameter and buffer seeded random and non-constant (norm scales around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if not p.is_floating_point():
                continue
            if p.ndim > 1 and "modulation" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
            elif "norm" in name or name.endswith(("scale", "gamma")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


def _model(kind):
    """(ModelPatcher, conditioning maker, latent shape) of a small model of ComfyUI's own classes."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models as sm

    if kind in ("flux", "chroma"):
        cfg = {"image_model": kind, "in_channels": 16, "out_channels": 16, "vec_in_dim": 48, "context_in_dim": 40,
               "hidden_size": 192, "mlp_ratio": 2.0, "num_heads": 6, "depth": 1, "depth_single_blocks": 1,
               "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
        conf = sm.Flux(cfg)
        if kind == "chroma":
            cfg.update(in_dim=64, out_dim=192, hidden_dim=64, n_layers=2, in_channels=64, out_channels=64)
            cfg.pop("vec_in_dim"), cfg.pop("guidance_embed")
            conf = sm.Chroma(cfg)
        shape = (1, 16, 13, 10) if kind == "flux" else (1, 16, 11, 6)

        def cond(g, b=1):
            extra = {"pooled_output": torch.randn(b, 48, generator=g)}
            return [[torch.randn(b, 7, 40, generator=g), extra]]
    elif kind.startswith("wan"):
        i2v = kind == "wan21i2v"
        ch = 48 if kind == "wan22" else 16
        cfg = {"image_model": "wan2.1", "model_type": "i2v" if i2v else "t2v", "dim": 192, "ffn_dim": 256, "num_heads": 6,
               "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 64, "text_dim": 40, "in_dim": 36 if i2v else ch,
               "out_dim": ch, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
        conf = (sm.WAN22_T2V if kind == "wan22" else sm.WAN21_I2V if i2v else sm.WAN21_T2V)(cfg)
        shape = (1, ch, 5, 9, 6)

        def cond(g, b=1):
            extra = {}
            if i2v:
                extra = {"concat_latent_image": torch.randn(1, 16, 5, 9, 6, generator=g),
                         "clip_vision_output": SimpleNamespace(penultimate_hidden_states=torch.randn(1, 5, 1280, generator=g))}
            return [[torch.randn(b, 7, 40, generator=g), extra]]
    elif kind == "unet":
        cfg = {"image_size": 32, "in_channels": 4, "model_channels": 32, "out_channels": 4, "num_res_blocks": 1,
               "channel_mult": (1, 2), "num_heads": 2, "use_spatial_transformer": True, "transformer_depth": [1, 1],
               "transformer_depth_output": [1, 1, 1, 1], "transformer_depth_middle": 1, "context_dim": 40,
               "use_linear_in_transformer": True, "adm_in_channels": None}
        conf = sm.SD15(cfg)
        shape = (1, 4, 12, 10)

        def cond(g, b=1):
            return [[torch.randn(b, 7, 40, generator=g), {}]]
    else:
        raise ValueError(kind)
    conf.set_inference_dtype(torch.float32, None)
    base = conf.get_model({})
    _init(base.diffusion_model, 7)
    mp = comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())
    return mp, cond, shape


def _inputs(kind, cond, shape, sampler, batch, parallelism, attention, cfg_scale):
    import comfy.sample

    g = torch.Generator().manual_seed(3)
    latent = torch.zeros((batch,) + tuple(shape[1:]))
    noise_mask = None
    if kind == "wan22":  # Wan 2.2 5B image-to-video: the first frame kept (mask 0), per-frame timesteps
        noise_mask = torch.ones((1, 1) + tuple(shape[2:]))
        noise_mask[:, :, 0] = 0.0
        latent = 0.5 * torch.randn((batch,) + tuple(shape[1:]), generator=g)
    pos, neg = cond(g), cond(g)
    return {
        "noise": comfy.sample.prepare_noise(latent, 42), "latent_image": latent, "noise_mask": noise_mask, "seed": 42,
        "steps": 3, "cfg": cfg_scale, "sampler_name": sampler, "scheduler": "simple", "denoise": 1.0,
        "positive": pos, "negative": neg, "model_options": {"transformer_options": {}}, "object_patches": {},
        "parallelism": parallelism, "attention": attention,
    }


@contextlib.contextmanager
def _watch_text():
    """The text shard sizes of every sequence-parallel model call of the block (``()``: the text stayed whole), read
    from the rank's shard table after each call (the rank side's own state; nothing is replaced)."""
    from patchray.nodes.bridge import dit_rank

    seen = []
    original = dit_rank.DitSequence.wrapper

    def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(self.state.require_shards().text_sizes)
        return out

    dit_rank.DitSequence.wrapper = wrapper
    try:
        yield seen
    finally:
        dit_rank.DitSequence.wrapper = original


def _rank(ctx, opts):
    from patchray.distributed import comm
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.nodes.bridge import ksampler_rank as kr
    from patchray.nodes.bridge.dit_layout import plan_layout
    from patchray.nodes.bridge.dit_models import find_row

    kr.prepare(ctx, opts["comfy"])
    import comfy.sample

    torch.manual_seed(0)
    results = {}
    models = {}
    for name in opts["cases"]:
        kind, parallelism, attention, sampler, batch = CASES[name]
        if kind not in models:
            models = {kind: _model(kind)}  # one model at a time
        mp, cond, shape = models[kind]
        inputs = _inputs(kind, cond, shape, sampler, batch, parallelism, attention, opts["cfg"])
        dm = mp.model.diffusion_model
        is_unet = type(dm).__name__ == "UNetModel"
        if parallelism == "replicated":
            inputs["cfg"] = 1.0
            layout = plan_layout("cfg", ctx.world_size, 1.0, batch, sequence_refusal="(forced: no sequence split)")
        else:
            layout = plan_layout(parallelism, ctx.world_size, inputs["cfg"], batch,
                                 sequence_refusal=None if (is_unet or find_row(type(dm).__name__)) else "no row")
        inputs.update(layout=layout._asdict(), kind="unet" if is_unet else "dit", attention=attention)
        ref = None
        if ctx.rank == 0:
            with torch.inference_mode():
                ref = comfy.sample.sample(mp.clone(), inputs["noise"], 3, inputs["cfg"], sampler, "simple", inputs["positive"],
                                          inputs["negative"], inputs["latent_image"], denoise=1.0, noise_mask=inputs["noise_mask"],
                                          disable_pbar=True, seed=42).float()
        session = RankSession(ctx, ("model", kind), preset("full_sync", split_batch=False))
        session.begin()
        with comm.log_comm() as log, _watch_text() as texts:
            latent = kr.sample(ctx, mp, session, inputs)
            final = session.finalize(latent).float().cpu()
        rec = {"layout": layout.mode, "groups": layout.cfg_groups, "seq": layout.seq_ranks, "calls": session.calls,
               "note": layout.note, "comm_calls": dict(log.calls), "comm_bytes": log.total_bytes,
               "text_sizes": sorted({tuple(t) for t in texts})}
        if ref is not None:
            rec["rel_l2"] = ((final - ref).norm() / ref.norm()).item()
            rec["shape"] = list(final.shape)
            rec["ref_norm"] = ref.norm().item()
        session.close()
        results[name] = rec
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=sorted(CASES))
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from patchray.distributed.spawn import run_ranks

    opts = {"comfy": os.path.abspath(args.comfy), "cases": args.cases, "cfg": args.cfg}
    results = run_ranks(_rank, args.ranks, opts, backend="gloo", device="cpu", timeout_s=900.0)
    report = {"ranks": args.ranks, "torch": torch.__version__, "cases": results[0],
              "calls_per_rank": [{k: v["calls"] for k, v in r.items()} for r in results]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
