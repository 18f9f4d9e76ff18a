"""Write a tiny random SD3-class MMDiT that ComfyUI's stock UNet loader detects as SD3: a diffusion model PatchRay's
sequence split does not cover, and one whose forward (ComfyUI 0.3.64) calls no DIFFUSION_MODEL wrappers.

Run with the Python that runs ComfyUI: ``python make_sd3_model.py <ComfyUI dir> <models dir>`` ->
``diffusion_models/sd3_tiny.safetensors`` (depth 2: hidden size 128, two heads; 16 latent channels, patch 2, context
4096, pooled 2048; every weight, bias and norm scale non-constant).
"""

import os
import sys


def main(comfy_dir, models_dir):
    sys.path.insert(0, comfy_dir)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch
    from safetensors.torch import save_file

    import comfy.ops
    import comfy.sd
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_models import _random_state

    path = os.path.join(models_dir, "diffusion_models", "sd3_tiny.safetensors")
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # ComfyUI's detection reads the depth from the patch embedding's width (64 per block) and the rest from the keys
    model = MMDiT(patch_size=2, in_channels=16, depth=2, adm_in_channels=2048, out_channels=16, pos_embed_max_size=16,
                  num_patches=256, context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 128}},
                  device="meta", operations=comfy.ops.disable_weight_init)
    save_file(_random_state(model, 77, torch.float16), path)
    loaded = comfy.sd.load_diffusion_model(path)  # what the stock UNet loader builds
    assert type(loaded.model.model_config).__name__ == "SD3", type(loaded.model.model_config)
    assert type(loaded.model.diffusion_model).__name__ == "OpenAISignatureMMDITWrapper"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
