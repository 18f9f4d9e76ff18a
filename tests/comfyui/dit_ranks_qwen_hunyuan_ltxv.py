"""Qwen-Image, HunyuanVideo / HunyuanImage 2.1 and LTX-Video: the Distributed KSampler's sequence/CFG/batch rank
side against ComfyUI's stock sampling, on N spawned gloo ranks (the companion of ``dit_ranks.py``; same method).

Models are ComfyUI's own classes, every weight seeded random and non-constant, loaded the way ComfyUI loads a
downloaded file where its detection allows a small model:

* HunyuanVideo, HunyuanImage 2.1 and LTX-Video: built small, saved as a safetensors file and loaded back with
  ``comfy.sd.load_diffusion_model`` (the stock "Load Diffusion Model" path: ComfyUI's detection picks the class and
  reads the widths from the weights). Detection fixes what it does not read: HunyuanVideo's head width (128: 6 heads
  -> hidden 768) and pooled width (768); LTX-Video's 32 heads (head width 8 -> hidden 256), its 128 latent channels
  and text width 4096 (the conditioning is 4096 wide).
* Qwen-Image: ComfyUI's detection reads only the layer count and input channels (the rest is the full 20B
  configuration), so the small model is built from ``comfy.supported_models.QwenImage`` with small widths and the
  text width 3584 (conditioning 3584 wide); its saved file is checked to be detected as QwenImage.

Latents have odd token rows; videos an odd frame count (HunyuanVideo pads odd latent sizes but cannot unpatchify
them in ComfyUI 0.3.64, so its latent rows are even, its token rows odd).

    python tests/comfyui/dit_ranks_qwen_hunyuan_ltxv.py --comfy /path/to/ComfyUI --ranks 2 --cases qwen-seq ltxv-cfg ... [--out r.json]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_harness import each_case, patcher, random_model, rank_main, sample_case, sampling_inputs  # noqa: E402

# name -> (model, parallelism, attention, sampler, batch)
CASES = {
    "qwen-seq": ("qwen", "sequence", "gathered", "euler", 1),
    "qwen-seq-ulysses": ("qwen", "sequence", "ulysses", "euler", 1),
    "qwen-cfg": ("qwen", "cfg", "auto", "euler", 1),
    "qwen-cfgseq": ("qwen", "cfg+sequence", "auto", "euler", 1),
    "qwen-batch": ("qwen", "batch", "auto", "euler_ancestral", 3),
    "hunyuan-seq": ("hunyuan", "sequence", "gathered", "euler", 1),
    "hunyuan-seq-ulysses": ("hunyuan", "sequence", "ulysses", "dpmpp_2m", 1),
    "hunyuan-cfg": ("hunyuan", "cfg", "auto", "euler", 1),
    "hunyuan-cfgseq": ("hunyuan", "cfg+sequence", "auto", "euler", 1),
    "hunyuan-batch": ("hunyuan", "batch", "auto", "euler_ancestral", 3),
    "hunyuani2v-seq": ("hunyuani2v", "sequence", "gathered", "euler", 1),
    "hunyuani2vc-seq": ("hunyuani2vc", "sequence", "gathered", "euler", 1),
    "hyimage-seq": ("hyimage", "sequence", "gathered", "euler", 1),
    "hyimage-seq-ulysses": ("hyimage", "sequence", "ulysses", "euler", 1),
    "ltxv-seq": ("ltxv", "sequence", "gathered", "euler", 1),
    "ltxv-seq-ulysses": ("ltxv", "sequence", "ulysses", "euler", 1),
    "ltxv-cfg": ("ltxv", "cfg", "auto", "euler", 1),
    "ltxv-cfgseq": ("ltxv", "cfg+sequence", "auto", "euler", 1),
    "ltxv-batch": ("ltxv", "batch", "auto", "euler_ancestral", 3),
    "ltxvi2v-seq": ("ltxvi2v", "sequence", "gathered", "euler", 1),
    "ltxvkf-seq": ("ltxvkf", "sequence", "gathered", "euler", 1),
    "ltxvkf-seq-ulysses": ("ltxvkf", "sequence", "ulysses", "euler", 1),
    "ltxvi2v-seq-ulysses": ("ltxvi2v", "sequence", "ulysses", "euler", 1),
    # the K/V exchange hidden behind the attention (a call with a mask runs gathered)
    "qwen-seq-ring": ("qwen", "sequence", "ring", "euler", 1),
    "qwen-seq-overlapped": ("qwen", "sequence", "overlapped", "euler", 1),
    "hunyuan-seq-ring": ("hunyuan", "sequence", "ring", "euler", 1),
    "hyimage-seq-overlapped": ("hyimage", "sequence", "overlapped", "euler", 1),
    "ltxv-seq-ring": ("ltxv", "sequence", "ring", "euler", 1),
    "ltxvkf-seq-overlapped": ("ltxvkf", "sequence", "overlapped", "euler", 1),
}

# HunyuanVideo is guidance-distilled (run at cfg 1); its image-to-video "v2" first-frame modulation broadcasts only
# over one row (ComfyUI 0.3.64's stock sampler fails on cond and uncond batched together), so that case runs at cfg 1
CFG = {"hunyuani2v": 1.0}

EXPECT_CLASS = {"qwen": "QwenImageTransformer2DModel", "hunyuan": "HunyuanVideo", "hunyuani2v": "HunyuanVideo", "hunyuani2vc": "HunyuanVideo",
                "hyimage": "HunyuanVideo", "ltxv": "LTXVModel", "ltxvi2v": "LTXVModel", "ltxvkf": "LTXVModel"}
EXPECT_CONFIG = {"qwen": "QwenImage", "hunyuan": "HunyuanVideo", "hunyuani2v": "HunyuanVideo", "hunyuani2vc": "HunyuanVideoI2V",
                 "hyimage": "HunyuanImage21", "ltxv": "LTXV", "ltxvi2v": "LTXV", "ltxvkf": "LTXV"}


def _through_file(conf, kind):
    """Build ``conf``'s model, seed every weight, save it, load it back through ComfyUI's stock loader."""
    import comfy.model_detection
    import comfy.sd
    import comfy.utils
    from safetensors.torch import save_file

    base = random_model(conf)
    sd = {k: v.contiguous() for k, v in base.diffusion_model.state_dict().items()}
    with tempfile.TemporaryDirectory(prefix="patchray-more-") as d:
        path = os.path.join(d, f"{kind}.safetensors")
        save_file(sd, path)
        detected = comfy.model_detection.model_config_from_unet(comfy.utils.load_torch_file(path), "")
        assert type(detected).__name__ == EXPECT_CONFIG[kind], (kind, type(detected).__name__)
        if kind == "qwen":
            return None  # detection would build the full-width model: the small one is used as built
        mp = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
    got = mp.model.diffusion_model.state_dict()
    assert all(torch.equal(got[k], sd[k]) for k in sd), kind
    return mp


def _model(kind):
    """(ModelPatcher, conditioning maker, latent shape, noise mask maker) of a small model of ComfyUI's classes."""
    import comfy.supported_models as sm

    mask = None
    if kind == "qwen":
        cfg = {"image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 2,
               "attention_head_dim": 32, "num_attention_heads": 6, "joint_attention_dim": 3584, "axes_dims_rope": (8, 12, 12)}
        conf = sm.QwenImage(cfg)
        _through_file(sm.QwenImage(dict(cfg)), kind)
        mp = patcher(random_model(conf))
        shape = (1, 16, 1, 13, 10)  # Qwen-Image latents are [B, 16, 1, H, W]; 7 x 5 tokens

        def cond(g, b=1):
            return [[torch.randn(b, 7, 3584, generator=g), {}]]
    elif kind in ("hunyuan", "hunyuani2v", "hunyuani2vc", "hyimage"):
        image = kind == "hyimage"
        cfg = {"image_model": "hunyuan_video", "in_channels": 64 if image else 33 if kind == "hunyuani2vc" else 16, "out_channels": 64 if image else 16,
               "vec_in_dim": None if image else 768, "context_in_dim": 4096 if not image else 3584, "hidden_size": 768,
               "mlp_ratio": 4.0, "num_heads": 6, "depth": 1, "depth_single_blocks": 1,
               "axes_dim": [64, 64] if image else [16, 56, 56], "theta": 256, "patch_size": [1, 1] if image else [1, 2, 2],
               "qkv_bias": True, "guidance_embed": True, "byt5": image, "meanflow": False}
        mp = _through_file((sm.HunyuanImage21 if image else sm.HunyuanVideoI2V if kind == "hunyuani2vc" else sm.HunyuanVideo)(cfg), kind)
        shape = (1, 64, 7, 5) if image else (1, 16, 5, 10, 6)  # image: 7 x 5 tokens; video: 5 frames of 5 x 3

        def cond(g, b=1):
            if image:  # a padded prompt: the text mask's zeros reach every attention (local-length mask)
                m = torch.ones(b, 7, dtype=torch.long)
                m[:, 5:] = 0
                return [[torch.randn(b, 7, 3584, generator=g), {"attention_mask": m}]]
            extra = {"pooled_output": torch.randn(b, 768, generator=g)}
            if kind == "hunyuani2v":  # image-to-video "v2 (replace)": the first frame modulated apart
                extra["guiding_frame_index"] = 0
            if kind == "hunyuani2vc":  # image-to-video "v1 (concat)": the image latent and a mask as channels
                extra["concat_latent_image"] = torch.randn(1, 16, 5, 10, 6, generator=g)
            return [[torch.randn(b, 7, 4096, generator=g), extra]]
    elif kind in ("ltxv", "ltxvi2v", "ltxvkf"):
        cfg = {"image_model": "ltxv", "num_layers": 2, "attention_head_dim": 8, "cross_attention_dim": 256}
        mp = _through_file(sm.LTXV(cfg), kind)
        shape = (1, 128, 3, 7, 5)  # 3 frames of 7 x 5 tokens (1x1x1 patches)
        if kind == "ltxvi2v":  # image-to-video: the first frame kept -> a timestep per token
            mask = torch.ones((1, 1) + shape[2:])
            mask[:, :, 0] = 0.0
        keyframes = None
        if kind == "ltxvkf":  # a keyframe guide (LTXVAddGuide, strength 1): the last latent frame, kept, with the
            # pixel coordinates of frame 16 that the model writes over the last tokens' before making the RoPE
            from comfy.ldm.lightricks.symmetric_patchifier import SymmetricPatchifier, latent_to_pixel_coords

            mask = torch.ones((1, 1) + shape[2:])
            mask[:, :, -1] = 0.0
            _, coords = SymmetricPatchifier(1).patchify(torch.zeros(1, 128, 1, 7, 5))
            keyframes = latent_to_pixel_coords(coords, (8, 32, 32), causal_fix=False)
            keyframes[:, 0] += 16

        def cond(g, b=1):  # LTX's T5 encoder gives a padding mask: the cross-attention masks its zeros
            m = torch.ones(b, 7, dtype=torch.long)
            m[:, 6:] = 0
            extra = {"attention_mask": m}
            if keyframes is not None:
                extra["keyframe_idxs"] = keyframes.clone()
            return [[torch.randn(b, 7, 4096, generator=g), extra]]
    else:
        raise ValueError(kind)
    assert type(mp.model.diffusion_model).__name__ == EXPECT_CLASS[kind]
    return mp, cond, shape, mask


def _inputs(kind, cond, shape, mask, sampler, batch, parallelism, attention, cfg_scale):
    g = torch.Generator().manual_seed(3)
    latent = torch.zeros((batch,) + tuple(shape[1:]))
    if mask is not None:
        latent = 0.5 * torch.randn((batch,) + tuple(shape[1:]), generator=g)
    pos, neg = cond(g, 1), cond(g, 1)
    if kind == "hyimage":
        # ComfyUI 0.3.64's HunyuanVideo class writes the text mask into a one-row attention mask: a masked prompt
        # only runs unbatched, so the negative has no mask (ComfyUI then evaluates the two apart)
        neg[0][1].pop("attention_mask")
    return sampling_inputs(latent, mask, pos, neg, sampler, cfg_scale, parallelism=parallelism, attention=attention)


def _rank(ctx, opts):
    from patchray.nodes.bridge.dit_layout import plan_layout
    from patchray.nodes.bridge.dit_models import find_row

    results = {}
    for name, (kind, parallelism, attention, sampler, batch), (mp, cond, shape, mask) in each_case(ctx, opts, CASES, _model):
        inputs = _inputs(kind, cond, shape, mask, sampler, batch, parallelism, attention, CFG.get(kind, opts["cfg"]))
        dm = mp.model.diffusion_model
        layout = plan_layout(parallelism, ctx.world_size, inputs["cfg"], batch,
                             sequence_refusal=None if find_row(type(dm).__name__) else "no row")
        results[name] = sample_case(ctx, ("model", kind), mp, inputs, layout, "dit", attention)
    return results


def main(argv=None):
    return rank_main(_rank, __doc__, CASES, argv,
                     lambda results: {"calls_per_rank": [{k: v["calls"] for k, v in r.items()} for r in results]})


if __name__ == "__main__":
    sys.exit(main())
