"""ComfyUI's own VAE Encode in fp64: the exact reference the fp32 encodes (stock and PatchRay) are both measured against.

Used by the opt-in server test when PatchRay's fp32 encode and the stock fp32 encode differ by more than the 1e-4
tolerance: with random weights and a smooth image, single-process fp32 GroupNorm statistics can be that far from
the exact result themselves (measured: SDXL-class VAE at 200x136, stock fp32 vs fp64 1.36e-4, PatchRay's row mode,
whose group statistics are merged in fp64, 3.0e-6). The reference is ComfyUI's class and ComfyUI's ``VAE.encode``,
not PatchRay's code.

Usage (ComfyUI's Python): ``python reference_encode.py <ComfyUI dir> <vae file> <image> WIDTH HEIGHT FRAMES <out>``
(the image scaled as the stock ImageScale node does with ``bilinear`` / ``center``, repeated FRAMES times, as
RepeatImageBatch; the latent written with safetensors under ``latent``). An ``<image>`` ending in ``.safetensors`` is an
IMAGE tensor (key ``image``, as the test-only save node writes it) encoded as it is.
"""

import sys


def main(comfy_dir, vae_file, image, width, height, frames, out):
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path.insert(0, comfy_dir)
    import comfy.options

    comfy.options.enable_args_parsing()
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    import comfy.sd
    import comfy.utils

    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(vae_file))
    vae.first_stage_model.double()
    vae.vae_dtype = torch.float64
    if image.endswith(".safetensors"):  # an IMAGE batch saved as it entered the encode nodes (WIDTH HEIGHT FRAMES unused)
        from safetensors.torch import load_file

        pixels = load_file(image)["image"].double()
    else:
        pixels = torch.from_numpy(np.asarray(Image.open(image).convert("RGB"), dtype=np.float32) / 255.0)[None]
        pixels = comfy.utils.common_upscale(pixels.movedim(-1, 1), int(width), int(height), "bilinear", "center").movedim(1, -1)
        pixels = pixels.repeat(int(frames), 1, 1, 1).double()
    with torch.no_grad():
        z = vae.encode(pixels)
    save_file({"latent": z.double().contiguous()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:8])
