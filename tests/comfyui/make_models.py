"""Write random-weight model files of the right architectures under the names the shared workflows use.

Run with the Python that runs ComfyUI: ``python make_models.py <ComfyUI dir> <models dir>``. It uses ComfyUI's
own model classes (and diffusers for the KL VAEs, which ComfyUI converts on load), so every file loads through
the stock loaders exactly as a downloaded one would:

* ``vae/sdxl_vae.safetensors``: SD/SDXL KL VAE (4 latent channels, quant convs), full size, diffusers layout.
* ``vae/ae.safetensors``: FLUX.1 KL VAE (16 latent channels, no quant convs), full size, diffusers layout.
* ``vae/wan_2.1_vae.safetensors``: Wan 2.1 VAE, full size, the released layout (``comfy.ldm.wan.vae.WanVAE``).
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
