"""Write random-weight model files of the right architectures under the names the shared workflows use.

Run with the Python that runs ComfyUI: ``python make_models.py <ComfyUI dir> <models dir>``. It uses ComfyUI's
own model classes (and diffusers for the KL VAEs, which ComfyUI converts on load), so every file loads through
the stock loaders exactly as a downloaded one would:

* ``vae/sdxl_vae.safetensors``: SD/SDXL KL VAE (4 latent channels, quant convs), full size, diffusers layout.
* ``vae/ae.safetensors``: FLUX.1 KL VAE (16 latent channels, no quant convs), full size, diffusers layout.
* ``vae/wan_2.1_vae.safetensors``: Wan 2.1 VAE, full size, the released layout (``comfy.ldm.wan.vae.WanVAE``).
* ``vae/wan2.2_vae.safetensors``: Wan 2.2 VAE (the TI2V-5B model's: 48 latent channels, 16x), full size, released
  layout (``comfy.ldm.wan.vae2_2.WanVAE`` with the options ``comfy.sd.VAE`` uses).
* ``vae/ltxv_090_vae.safetensors``: the LTX-Video VAE as ``comfy.sd.VAE`` builds its version 0 (0.9.0), full size,
  with its latent statistics (``ltxv_095_vae.safetensors``, version 2, only when asked for by name).
  These video VAEs get non-constant weights everywhere (norm scales, biases, statistics: :func:`write_video_vaes`).
* ``vae/hunyuan_image_2.1_vae.safetensors``: HunyuanImage-2.1's 64-channel 32x VAE, full size
  (``comfy.ldm.hunyuan_video.vae``, built as ``comfy.sd.VAE`` builds it), every norm scale non-constant.
* ``vae/hunyuan_video_vae_bf16.safetensors``: HunyuanVideo's 3-D KL VAE, full size (``AutoencoderKL`` with
  ``conv3d=True``), every norm scale non-constant. Both files are loaded back through ``comfy.sd.VAE`` here to
  check that ComfyUI detects them as the intended class.
* ``checkpoints/sd_xl_base_1.0.safetensors``: a checkpoint ComfyUI loads as an SD1.x model (a one-level 320-channel
  UNet and the full CLIP-L text encoder): a full SDXL UNet (2.6 B parameters) is beyond a CPU test; the graph
  (checkpoint -> CLIP encode -> KSampler -> decode) is the same.
* ``loras/patchray_test_lora.safetensors``: a rank-4 LoRA (kohya ``lora_unet_*`` keys) over that UNet's linear layers,
  changing each by roughly 10%: the Distributed KSampler test samples the MODEL with it applied.
* ``diffusion_models/flux1-dev.safetensors``, ``wan2.1_t2v_1.3B_fp16.safetensors``,
  ``wan2.2_ti2v_5B_fp16.safetensors``: DiTs for the Distributed KSampler (:func:`make_dit_models`), detected by the
  stock UNet loader as FLUX.1 dev, Wan 2.1 text-to-video and Wan 2.2 5B.
"""

import os
import sys


def _init(module, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
            elif name.endswith(("gamma",)) or ("norm" in name and name.endswith("weight")):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return module


def _init_varied(module, seed):
    """Every parameter and float buffer non-constant: weights ~ 1/sqrt(fan-in), norm scales 1 +- 0.1, biases and the
    rest +- 0.02 around their kind's scale; LTX-Video's latent statistics (std 0.5..1.5, mean +- 0.3)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim > 1 and not name.endswith("scale_shift_table"):
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
            elif name.endswith("timestep_scale_multiplier"):
                p.copy_(1000.0 * (1 + 0.05 * torch.randn(p.shape, generator=g)))
            elif name.endswith("gamma") or ("norm" in name and name.endswith("weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for name, b in module.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.rand(b.shape, generator=g) + 0.5 if "std" in name else torch.randn(b.shape, generator=g) * 0.3)
    return module


def write_video_vaes(vae_dir, save, only=None):
    """The Wan 2.2 and LTX-Video VAE files (or the ``only`` ones, by file name), built from ComfyUI's own classes
    with the configs comfy.sd.VAE uses."""
    import os

    import comfy.ldm.wan.vae2_2
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    path = os.path.join(vae_dir, "wan2.2_vae.safetensors")
    if not os.path.exists(path) and (only is None or os.path.basename(path) in only):
        wan22 = comfy.ldm.wan.vae2_2.WanVAE(dim=160, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                           temperal_downsample=[False, True, True], dropout=0.0)
        save(_init_varied(wan22, 7).state_dict(), path)
    for version, name in ((0, "ltxv_090_vae.safetensors"), (2, "ltxv_095_vae.safetensors")):
        path = os.path.join(vae_dir, name)
        # the full-size 0.9.5 VAE (1.2 B parameters, 2.5 GB) only on request: the suite tests that version in process
        # with its config in the file (test_comfyui_ltx_decode_noise.py)
        wanted = name in only if only is not None else version == 0
        if not os.path.exists(path) and wanted:
            save(_init_varied(VideoVAE(version=version), 8 + version).state_dict(), path)


def _init_nonconstant(module, seed):
    """Every weight, bias and norm scale random and non-constant (norm scales around 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
            elif "norm" in name or name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return module


def _hunyuan_vaes(vae_dir, save, only=None):
    """HunyuanImage-2.1's VAE and HunyuanVideo's VAE with the configs ``comfy.sd.VAE.__init__`` builds them with
    (``only``: these file names)."""
    import comfy.ldm.hunyuan_video.vae
    import comfy.ldm.modules.diffusionmodules.model
    import comfy.sd
    import comfy.utils
    from comfy.ldm.models.autoencoder import AutoencoderKL as ComfyKL, AutoencodingEngine

    image = {"block_out_channels": [128, 256, 512, 512, 1024, 1024], "in_channels": 3, "out_channels": 3, "num_res_blocks": 2,
             "ffactor_spatial": 32, "downsample_match_channel": True, "upsample_match_channel": True, "z_channels": 64}
    video = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
             "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0, "conv3d": True, "time_compress": 4}
    builds = {
        "hunyuan_image_2.1_vae.safetensors": (
            lambda: AutoencodingEngine(regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                                       encoder_config={"target": "comfy.ldm.hunyuan_video.vae.Encoder", "params": image},
                                       decoder_config={"target": "comfy.ldm.hunyuan_video.vae.Decoder", "params": image}),
            comfy.ldm.hunyuan_video.vae.Decoder, 64, 2, 11),
        "hunyuan_video_vae_bf16.safetensors": (
            lambda: ComfyKL(ddconfig=video, embed_dim=16), comfy.ldm.modules.diffusionmodules.model.Decoder, 16, 3, 12),
    }
    for name, (build, decoder_cls, channels, latent_dim, seed) in builds.items():
        path = os.path.join(vae_dir, name)
        if os.path.exists(path) or (only is not None and name not in only):
            continue
        save(_init_nonconstant(build(), seed).state_dict(), path)
        loaded = comfy.sd.VAE(sd=comfy.utils.load_torch_file(path))  # what the stock VAE Loader builds
        assert type(loaded.first_stage_model.decoder) is decoder_cls, name
        assert (loaded.latent_channels, loaded.latent_dim) == (channels, latent_dim), name


def main(comfy_dir, models_dir):
    sys.path.insert(0, comfy_dir)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    import comfy.ldm.wan.vae
    import comfy.ops
    import comfy.sd1_clip
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    vae_dir = os.path.join(models_dir, "vae")
    ckpt_dir = os.path.join(models_dir, "checkpoints")
    os.makedirs(vae_dir, exist_ok=True)
    os.makedirs(ckpt_dir, exist_ok=True)

    def save(sd, path):
        if not os.path.exists(path):
            save_file({k: v.detach().to(torch.float16).contiguous() for k, v in sd.items()}, path)

    kl = dict(down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
              block_out_channels=[128, 256, 512, 512], layers_per_block=2)
    save(_init(AutoencoderKL(latent_channels=4, **kl), 1).state_dict(), os.path.join(vae_dir, "sdxl_vae.safetensors"))
    save(_init(AutoencoderKL(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, **kl), 2).state_dict(),
         os.path.join(vae_dir, "ae.safetensors"))
    wan = comfy.ldm.wan.vae.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                   temperal_downsample=[False, True, True], dropout=0.0)
    save(_init(wan, 3).state_dict(), os.path.join(vae_dir, "wan_2.1_vae.safetensors"))
    write_video_vaes(vae_dir, save)

    _hunyuan_vaes(vae_dir, save)

    ckpt = os.path.join(ckpt_dir, "sd_xl_base_1.0.safetensors")
    lora = os.path.join(models_dir, "loras", "patchray_test_lora.safetensors")
    if not os.path.exists(ckpt) or not os.path.exists(lora):
        unet = UNetModel(image_size=32, in_channels=4, model_channels=320, out_channels=4, num_res_blocks=1, channel_mult=(1,),
                         num_heads=8, use_spatial_transformer=True, transformer_depth=[1], transformer_depth_output=[1, 1],
                         transformer_depth_middle=1, context_dim=768, use_linear_in_transformer=False,
                         operations=comfy.ops.disable_weight_init, dtype=torch.float32)
        clip = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)
        sd = {"model.diffusion_model." + k: v for k, v in _init(unet, 4).state_dict().items()}
        sd.update({"cond_stage_model." + k: v for k, v in _init(clip, 5).state_dict().items()})
        save(sd, ckpt)
        os.makedirs(os.path.dirname(lora), exist_ok=True)
        g = torch.Generator().manual_seed(6)
        lo = {}
        for k, w in unet.state_dict().items():
            if w.ndim == 2 and k.endswith(".weight") and (".attn" in k or ".ff." in k):
                name = "lora_unet_" + k[: -len(".weight")].replace(".", "_")
                out_f, in_f = w.shape
                # delta = up @ down * alpha / rank: about 10% of the weight's scale (1/sqrt(in_f))
                lo[name + ".lora_down.weight"] = torch.randn(4, in_f, generator=g) / in_f**0.5
                lo[name + ".lora_up.weight"] = torch.randn(out_f, 4, generator=g) * 0.1 / in_f**0.5
                lo[name + ".alpha"] = torch.tensor(4.0)
        save(lo, lora)


def _random_state(module, seed, dtype):
    """Seeded random weights for every entry of ``module``'s state dict (built on the meta device: no memory for the
    model itself), non-constant: matrices ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1^2), the rest ~ N(0, 0.02^2)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in module.state_dict().items():
        if t.ndim > 1 and "modulation" not in name:
            v = torch.randn(t.shape, generator=g) / max(1, t[0].numel()) ** 0.5
        elif "norm" in name or name.endswith("scale"):
            v = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            v = 0.1 * torch.randn(t.shape, generator=g)
        out[name] = v.to(dtype)
    return out


def make_dit_models(models_dir):
    """DiTs the stock UNet loader detects, at the widths its detection hard-codes (FLUX hidden 3072, text 4096;
    Wan text 4096) and one or two blocks: FLUX.1 dev (one double-stream block, no single-stream block: 340 M parameters
    at full width; the single-stream blocks are covered by tests/comfyui/dit_ranks.py), Wan 2.1 t2v (dim 256, two heads,
    one block), Wan 2.2 5B (48 latent channels, dim 256, one block)."""
    import torch
    from safetensors.torch import save_file

    import comfy.ldm.flux.model
    import comfy.ldm.wan.model
    import comfy.ops

    out_dir = os.path.join(models_dir, "diffusion_models")
    os.makedirs(out_dir, exist_ok=True)
    ops = comfy.ops.disable_weight_init
    specs = {
        "flux1-dev.safetensors": lambda: comfy.ldm.flux.model.Flux(
            in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0,
            num_heads=24, depth=1, depth_single_blocks=0, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
            guidance_embed=True, device="meta", operations=ops),
        "wan2.1_t2v_1.3B_fp16.safetensors": lambda: comfy.ldm.wan.model.WanModel(
            model_type="t2v", dim=256, ffn_dim=512, num_heads=2, num_layers=1, in_dim=16, out_dim=16, text_dim=4096,
            device="meta", operations=ops),
        "wan2.2_ti2v_5B_fp16.safetensors": lambda: comfy.ldm.wan.model.WanModel(
            model_type="t2v", dim=256, ffn_dim=512, num_heads=2, num_layers=1, in_dim=48, out_dim=48, text_dim=4096,
            device="meta", operations=ops),
    }
    lora_dir = os.path.join(models_dir, "loras")
    os.makedirs(lora_dir, exist_ok=True)
    for i, (name, build) in enumerate(specs.items()):
        path = os.path.join(out_dir, name)
        lora = os.path.join(lora_dir, "patchray_test_" + name.split("_")[0].split("-")[0].replace(".", "") + "_lora.safetensors")
        if os.path.exists(path) and os.path.exists(lora):
            continue
        model = build()
        save_file(_random_state(model, 20 + i, torch.float16), path)
        # a rank-4 LoRA over every linear layer of the blocks (ComfyUI's generic "diffusion_model.<path>" keys),
        # changing each by roughly 10%: loras/patchray_test_flux1_lora, ..._wan21_lora, ..._wan22_lora
        g = torch.Generator().manual_seed(40 + i)
        lo = {}
        for k, w in model.state_dict().items():
            if w.ndim == 2 and k.endswith(".weight") and "blocks." in k:
                base = "diffusion_model." + k[: -len(".weight")]
                out_f, in_f = w.shape
                lo[base + ".lora_down.weight"] = (torch.randn(4, in_f, generator=g) / in_f**0.5).to(torch.float16)
                lo[base + ".lora_up.weight"] = (torch.randn(out_f, 4, generator=g) * 0.1 / in_f**0.5).to(torch.float16)
                lo[base + ".alpha"] = torch.tensor(4.0)
        save_file(lo, lora)


if __name__ == "__main__":
    comfy_dir, models_dir = sys.argv[1], sys.argv[2]  # main() rewrites sys.argv for ComfyUI's argument parser
    main(comfy_dir, models_dir)
    make_dit_models(models_dir)
