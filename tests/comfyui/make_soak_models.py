"""Write the few random-weight model files the soak harness (``soak.py``) loads: three models and three VAEs.

Run with the Python that runs ComfyUI: ``python make_soak_models.py <ComfyUI dir> <models dir>``. The files are the
ones ``make_models.py`` and ``make_sd3_model.py`` write under the same names, built by their recipes (the stock
loaders detect them as the real families), but only these, so a soak server is ready in a minute instead of the
full suite's set-up:

* ``checkpoints/sd_xl_base_1.0.safetensors``: the SD1-class one-level UNet with the full CLIP-L text encoder (the
  checkpoint ``make_models.main`` writes); its VAE is ``vae/sdxl_vae.safetensors`` (4 latent channels, full size).
* ``diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors``: Wan 2.1 text-to-video (dim 256, one block), with
  ``vae/wan_2.1_vae.safetensors`` (16 channels, video).
* ``diffusion_models/sd3_tiny.safetensors``: an SD3-class MMDiT (no sequence split in PatchRay: cfg and batch only),
  with ``vae/ae.safetensors`` (the 16-channel KL VAE without quant convs, the layout SD3's and FLUX.1's VAE share).
"""

import os
import sys


def main(comfy_dir, models_dir):
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [comfy_dir, here]
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    import comfy.ldm.wan.model
    import comfy.ldm.wan.vae
    import comfy.ops
    import comfy.sd1_clip
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from make_models import _init, _random_state

    import make_sd3_model

    def save(sd, path):
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_file({k: v.detach().to(torch.float16).contiguous() for k, v in sd.items()}, path)

    vae_dir = os.path.join(models_dir, "vae")
    # the VAEs as make_models.main builds them (same random generators, same configs)
    kl = dict(down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
              block_out_channels=[128, 256, 512, 512], layers_per_block=2)
    if not os.path.exists(os.path.join(vae_dir, "sdxl_vae.safetensors")):
        save(_init(AutoencoderKL(latent_channels=4, **kl), 1).state_dict(), os.path.join(vae_dir, "sdxl_vae.safetensors"))
    if not os.path.exists(os.path.join(vae_dir, "ae.safetensors")):
        save(_init(AutoencoderKL(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, **kl), 2).state_dict(),
             os.path.join(vae_dir, "ae.safetensors"))
    if not os.path.exists(os.path.join(vae_dir, "wan_2.1_vae.safetensors")):
        wan = comfy.ldm.wan.vae.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                       temperal_downsample=[False, True, True], dropout=0.0)
        save(_init(wan, 3).state_dict(), os.path.join(vae_dir, "wan_2.1_vae.safetensors"))

    ckpt = os.path.join(models_dir, "checkpoints", "sd_xl_base_1.0.safetensors")
    if not os.path.exists(ckpt):  # make_models.main's checkpoint (generators 4 and 5)
        unet = UNetModel(image_size=32, in_channels=4, model_channels=320, out_channels=4, num_res_blocks=1, channel_mult=(1,),
                         num_heads=8, use_spatial_transformer=True, transformer_depth=[1], transformer_depth_output=[1, 1],
                         transformer_depth_middle=1, context_dim=768, use_linear_in_transformer=False,
                         operations=comfy.ops.disable_weight_init, dtype=torch.float32)
        clip = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)
        sd = {"model.diffusion_model." + k: v for k, v in _init(unet, 4).state_dict().items()}
        sd.update({"cond_stage_model." + k: v for k, v in _init(clip, 5).state_dict().items()})
        save(sd, ckpt)

    wan_dit = os.path.join(models_dir, "diffusion_models", "wan2.1_t2v_1.3B_fp16.safetensors")
    if not os.path.exists(wan_dit):  # make_models.make_dit_models' Wan 2.1 (generator 21)
        model = comfy.ldm.wan.model.WanModel(model_type="t2v", dim=256, ffn_dim=512, num_heads=2, num_layers=1, in_dim=16,
                                             out_dim=16, text_dim=4096, device="meta", operations=comfy.ops.disable_weight_init)
        os.makedirs(os.path.dirname(wan_dit), exist_ok=True)
        save_file(_random_state(model, 21, torch.float16), wan_dit)

    make_sd3_model.main(comfy_dir, models_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
