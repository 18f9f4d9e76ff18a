"""The Distributed KSampler's DiT/CFG/batch rank side against ComfyUI's stock sampling, on N spawned gloo ranks.

Runs exactly what the node's ranks run — ``nodes/bridge/ksampler_rank.sample`` (ComfyUI's ``comfy.sample.sample``
with PatchRay's CALC_COND_BATCH and DIFFUSION_MODEL wrappers and its ``optimized_attention_override``) — on
``spawn.run_ranks`` processes, and compares the final latent with ``comfy.sample.sample`` of the same ModelPatcher on
rank 0 without any wrapper (the stock KSampler's call). Transport (Ray, shipping the model) is left out here; the
server test covers it.

Models are ComfyUI's own classes (``comfy.supported_models`` configs -> ``BaseModel`` -> ``ModelPatcher``), small
widths, every weight seeded random and non-constant: FLUX.1 (``Flux``), Wan 2.1 text-to-video and image-to-video
(``WanModel`` t2v / i2v with CLIP-vision features), Wan 2.2 5B (``WAN22``: 48 channels, per-frame timesteps from a
first-frame mask), Wan VACE (``VaceWanModel``: two VACE blocks, two control contexts), SD3 and SD3.5 Medium
(``OpenAISignatureMMDITWrapper``; the latter with its image-only attention), Lumina 2 (``NextDiT``), and an
SD-style UNet for CFG.
Latents have odd sizes (Wan VACE: odd token rows); videos an odd frame count.

    python tests/comfyui/dit_ranks.py --comfy /path/to/ComfyUI --ranks 2 --cases flux-seq wan21-cfg ... [--out r.json]
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from rank_harness import each_case, patcher, random_model, rank_main, sample_case, sampling_inputs

# name -> (model, parallelism, attention, sampler, batch)
CASES = {
    "flux-seq": ("flux", "sequence", "gathered", "euler", 1),
    "flux-seq-ulysses": ("flux", "sequence", "ulysses", "euler", 1),
    "flux-seq-overlapped": ("flux", "sequence", "overlapped", "euler", 1),
    "flux-seq-ring": ("flux", "sequence", "ring", "euler", 1),
    "flux-cfg": ("flux", "cfg", "auto", "euler", 1),
    "flux-cfgseq": ("flux", "cfg+sequence", "auto", "euler", 1),
    "flux-batch": ("flux", "batch", "auto", "euler_ancestral", 3),
    "chroma-seq": ("chroma", "sequence", "gathered", "euler", 1),
    "wan21-seq": ("wan21", "sequence", "gathered", "euler", 1),
    "wan21-seq-ulysses": ("wan21", "sequence", "ulysses", "dpmpp_2m", 1),
    "wan21-seq-overlapped": ("wan21", "sequence", "overlapped", "dpmpp_2m", 1),
    "wan21-seq-ring": ("wan21", "sequence", "ring", "dpmpp_2m", 1),
    "wan21-cfg": ("wan21", "cfg", "auto", "euler", 1),
    "wan21-cfgseq": ("wan21", "cfg+sequence", "auto", "euler", 1),
    "wan21-batch": ("wan21", "batch", "auto", "euler_ancestral", 2),
    "wan21i2v-seq": ("wan21i2v", "sequence", "gathered", "euler", 1),
    "wan22-seq": ("wan22", "sequence", "auto", "euler", 1),
    "vace-seq": ("vace", "sequence", "gathered", "euler", 1),
    "vace-seq-ulysses": ("vace", "sequence", "ulysses", "dpmpp_2m", 1),
    "vace-cfgseq": ("vace", "cfg+sequence", "auto", "euler", 1),
    "sd3-seq": ("sd3", "sequence", "gathered", "euler", 1),
    "sd3-seq-ulysses": ("sd3", "sequence", "ulysses", "dpmpp_2m", 1),
    "sd3-cfgseq": ("sd3", "cfg+sequence", "auto", "euler", 1),
    "sd35m-seq": ("sd35m", "sequence", "gathered", "euler", 1),
    "lumina2-seq": ("lumina2", "sequence", "gathered", "euler", 1),
    "lumina2-seq-ulysses": ("lumina2", "sequence", "ulysses", "dpmpp_2m", 1),
    "lumina2-cfgseq": ("lumina2", "cfg+sequence", "auto", "euler", 1),
    "unet-cfg": ("unet", "cfg", "auto", "euler", 1),
    # cfg = 1 on a model without a sequence split (forced here: FLUX has a row): every rank samples the whole graph
    "flux-replicated": ("flux", "replicated", "auto", "euler", 1),
    "unet-cfgseq": ("unet", "cfg+sequence", "auto", "euler", 1),
    # the Distributed KSampler (Advanced)'s two halves of a two-expert schedule (Wan 2.2 14B): noise in, steps 0-1,
    # leftover noise out; then no noise added to a noisy latent, step 2 to the end, denoised fully
    "wan21-seq-first": ("wan21", "sequence", "gathered", "euler", 1),
    "wan21-seq-second": ("wan21", "sequence", "gathered", "euler", 1),
    # steps 0-1 of 3, denoised fully at the last of them (return_with_leftover_noise disable): the cut sigma set to 0
    "wan21-seq-first-full": ("wan21", "sequence", "gathered", "euler", 1),
}
#: the KSampler (Advanced) inputs of those cases, as the node ships them (``nodes/bridge/ksampler.py``)
SCHEDULES = {
    "wan21-seq-first": {"disable_noise": False, "start_step": 0, "last_step": 2, "force_full_denoise": False},
    "wan21-seq-second": {"disable_noise": True, "start_step": 2, "last_step": 10000, "force_full_denoise": True},
    "wan21-seq-first-full": {"disable_noise": False, "start_step": 0, "last_step": 2, "force_full_denoise": True},
}


def _model(kind):
    """(ModelPatcher, conditioning maker, latent shape) of a small model of ComfyUI's own classes."""
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
    elif kind == "vace":  # Wan VACE: two VACE blocks (the first projects the hint stream in), two contexts
        cfg = {"image_model": "wan2.1", "model_type": "vace", "dim": 192, "ffn_dim": 256, "num_heads": 6,
               "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 64, "text_dim": 40, "in_dim": 16, "out_dim": 16,
               "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "vace_layers": 2,
               "vace_in_dim": 96}
        conf = sm.WAN21_Vace(cfg)
        # ComfyUI pads the video latent to the patch, not the VACE context: even latent sizes (5 odd token rows)
        shape = (1, 16, 5, 10, 6)

        def cond(g, b=1):
            # the WanVaceToVideo node's keys: control frames (32 channels: inactive and reactive latents), their mask
            # (64 channels), a strength per context
            extra = {"vace_frames": [torch.randn(1, 32, 5, 10, 6, generator=g) for _ in range(2)],
                     "vace_mask": [torch.rand(1, 64, 5, 10, 6, generator=g) for _ in range(2)], "vace_strength": [1.0, 0.5]}
            return [[torch.randn(b, 7, 40, generator=g), extra]]
    elif kind in ("sd3", "sd35m"):  # SD3's MMDiT (sizes as make_sd3_model.py: depth 2, 2 heads of 64); SD3.5 Medium
        # adds an image-only attention (x_block_self_attn) in its first block and RMS q/k norms
        cfg = {"in_channels": 16, "patch_size": 2, "depth": 2, "adm_in_channels": 2048, "out_channels": 16,
               "pos_embed_max_size": 16, "num_patches": 256,
               "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 128}}}
        if kind == "sd35m":
            cfg.update(x_block_self_attn_layers=[0], qk_norm="rms")
        conf = sm.SD3(cfg)
        shape = (1, 16, 13, 10)  # 7 x 5 tokens

        def cond(g, b=1):
            return [[torch.randn(b, 7, 4096, generator=g), {"pooled_output": torch.randn(b, 2048, generator=g)}]]
    elif kind == "lumina2":  # Lumina 2's NextDiT: one text refiner, one image refiner, two main layers
        cfg = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 192, "n_layers": 2,
               "n_refiner_layers": 1, "n_heads": 6, "n_kv_heads": 3, "multiple_of": 16, "norm_eps": 1e-5, "qk_norm": True,
               "cap_feat_dim": 40, "axes_dims": [8, 12, 12], "axes_lens": [64, 64, 64]}
        conf = sm.Lumina2(cfg)
        shape = (1, 16, 13, 10)  # padded to 14 x 10: 7 x 5 tokens

        def cond(g, b=1):
            # the text encoder's mask, every token kept: ComfyUI passes its count (num_tokens), no padding mask
            return [[torch.randn(b, 7, 40, generator=g), {"attention_mask": torch.ones(b, 7, dtype=torch.long)}]]
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
    return patcher(random_model(conf)), cond, shape


def _inputs(kind, cond, shape, sampler, batch, parallelism, attention, cfg_scale):
    g =  torch.Generator().manual_seed(3)
    latent = torch.zeros((batch,) + tuple(shape[1:]))
    noise_mask = None
    if kind == "wan22":  # Wan 2.2 5B image-to-video: the first frame kept (mask 0), per-frame timesteps
        noise_mask = torch.ones((1, 1) + tuple(shape[2:]))
        noise_mask[:, :, 0] = 0.0
        latent = 0.5 * torch.randn((batch,) + tuple(shape[1:]), generator=g)
    pos, neg = cond(g), cond(g)
    return sampling_inputs(latent, noise_mask, pos, neg, sampler, cfg_scale, parallelism=parallelism, attention=attention)


def _rank(ctx, opts):
    from patchray.nodes.bridge.dit_layout import plan_layout
    from patchray.nodes.bridge.dit_models import find_row

    results = {}
    for name, (kind, parallelism, attention, sampler, batch), (mp, cond, shape) in each_case(ctx, opts, CASES, _model):
        inputs = _inputs(kind, cond, shape, sampler, batch, parallelism, attention, opts["cfg"])
        if name in SCHEDULES:
            inputs.update(SCHEDULES[name])
            if inputs["disable_noise"]:  # the node's zeros, on a latent that holds the first half's leftover noise
                inputs["latent_image"] = torch.randn(inputs["latent_image"].shape, generator=torch.Generator().manual_seed(5))
                inputs["noise"] = torch.zeros_like(inputs["latent_image"])
        dm = mp.model.diffusion_model
        is_unet = type(dm).__name__ == "UNetModel"
        if parallelism == "replicated":
            inputs["cfg"] = 1.0
            layout = plan_layout("cfg", ctx.world_size, 1.0, batch, sequence_refusal="(forced: no sequence split)")
        else:
            layout = plan_layout(parallelism, ctx.world_size, inputs["cfg"], batch,
                                 sequence_refusal=None if (is_unet or find_row(type(dm).__name__)) else "no row")
        results[name] = sample_case(ctx, ("model", kind), mp, inputs, layout, "unet" if is_unet else "dit", attention)
    return results


def main(argv=None):
    return rank_main(_rank, __doc__, CASES, argv,
                     lambda results: {"calls_per_rank": [{k: v["calls"] for k, v in r.items()} for r in results]})


if __name__ == "__main__":
    sys.exit(main())
