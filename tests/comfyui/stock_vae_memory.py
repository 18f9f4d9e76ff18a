"""What ComfyUI's own VAE Decode does with a full-size video VAE at a real video size, on one GPU (run by hand).

For each VAE: build it from ComfyUI's own classes with random non-constant weights (``make_models``), load it the way
the stock VAE Loader does (``comfy.sd.VAE``), decode a random latent of the size with ``VAE.decode`` (what the stock
VAE Decode node calls) and record the peak GPU memory (``torch.cuda.max_memory_allocated``), the time, and whether
ComfyUI fell back to its tiled decode (it logs "Ran out of memory when regular VAE decoding, retrying with tiled VAE
decoding"). Then ComfyUI's tiled decode (``VAE.decode_tiled``, its defaults: what a card too small for the untiled
decode gets) on the same latent, and how far that is from the untiled result (max and mean absolute difference on the
0..1 image; random weights exaggerate tile seams, so read them as an upper bound).

Usage (the Python that runs ComfyUI, CUDA visible)::

    python tests/comfyui/stock_vae_memory.py <ComfyUI dir> --out stock_vae_memory.json [--only wan22 ...]
"""

import argparse
import json
import logging
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: name -> (file written by make_models, latent shape [B, C, T, h, w] at the size, size label)
CASES = {
    # Wan 2.2 TI2V-5B: 1280x704, 121 frames -> 31 latent frames of 44x80 (16x)
    "wan22": ("wan2.2_vae.safetensors", (1, 48, 31, 44, 80), "704x1280x121"),
    # HunyuanVideo: 1280x720, 129 frames -> 33 latent frames of 90x160 (8x)
    "hunyuan_video": ("hunyuan_video_vae_bf16.safetensors", (1, 16, 33, 90, 160), "720x1280x129"),
    # HunyuanVideo at its 540p size: 960x544, 129 frames -> 33 latent frames of 68x120
    "hunyuan_video_540p": ("hunyuan_video_vae_bf16.safetensors", (1, 16, 33, 68, 120), "544x960x129"),
    # HunyuanVideo 540p with half the frames: 65 frames -> 17 latent frames (whole-clip row bands of N = 2 and 4
    # ranks fit one shared H200 at this size; at 129 frames they do not)
    "hunyuan_video_540p_65": ("hunyuan_video_vae_bf16.safetensors", (1, 16, 17, 68, 120), "544x960x65"),
    # LTX-Video 0.9.5+: 1216x704, 121 frames -> 16 latent frames of 22x38 (32x)
    "ltx_video": ("ltxv_095_vae.safetensors", (1, 128, 16, 22, 38), "704x1216x121"),
}


def _tiled_decode(vae, z, tile_size=512, overlap=64, temporal_size=64, temporal_overlap=8):
    """What the stock "VAE Decode (Tiled)" node does with its default widgets (nodes.py VAEDecodeTiled.decode)."""
    t = vae.temporal_compression_decode()
    if t is not None:
        temporal_size = max(2, temporal_size // t)
        temporal_overlap = max(1, min(temporal_size // 2, temporal_overlap // t))
    else:
        temporal_size = temporal_overlap = None
    c = vae.spacial_compression_decode()
    return vae.decode_tiled(z, tile_x=tile_size // c, tile_y=tile_size // c, overlap=overlap // c, tile_t=temporal_size,
                            overlap_t=temporal_overlap)


def _untiled_reference(vae, z, device):
    """The untiled decode of the same weights, for when ComfyUI itself fell back to tiles: PatchRay's conversion of
    ComfyUI's VAE to the diffusers model (exact to 1/255 against the stock decode where that decode fits, as the
    opt-in suite shows) decoding the whole latent in one process."""
    import torch

    from patchray.distributed.vae.families import instantiate
    from patchray.distributed.vae.row import _decode_band
    from patchray.nodes.bridge import convert as cv

    spec = cv.vae_spec(vae)
    with torch.device("meta"):
        model = instantiate(spec.family, spec.config)
    model.load_state_dict(dict(spec.state_dict), assign=True)
    model = model.to(device=device, dtype=vae.vae_dtype).eval()
    with torch.no_grad():
        x = _decode_band(model, cv.latent_to_library(spec, z).to(device, vae.vae_dtype))
    del model
    return cv.decoded_to_image(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("comfy_dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None, choices=list(CASES))
    parser.add_argument("--no-tiled", action="store_true", help="skip the tiled decode and the comparison")
    parser.add_argument("--cpu", action="store_true", help="a smoke run without a GPU (memory figures read 0)")
    parser.add_argument("--latent-scale", type=int, default=1, help="divide each latent size by this (smoke runs)")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.comfy_dir)
    sys.path.insert(0, HERE)
    import torch

    if args.cpu:
        sys.argv = [sys.argv[0], "--cpu"]
        import comfy.options

        comfy.options.enable_args_parsing()
    gpu = torch.cuda.is_available() and not args.cpu

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def reset():
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak():
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else 0.0
    from safetensors.torch import save_file

    import comfy.sd
    import comfy.utils
    import make_models

    warnings = []

    class Catch(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger().addHandler(Catch(level=logging.WARNING))
    vae_dir = tempfile.mkdtemp(prefix="patchray-stock-vae-")

    def save(sd, path):
        if not os.path.exists(path):
            save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}, path)

    results = []

    def flush(row=None):  # after every stage, so a run cut short by a time limit keeps what it measured
        with open(args.out, "w") as f:
            cases = results + ([row] if row is not None else [])
            json.dump({"device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__, "cases": cases}, f, indent=2)

    for name in args.only or list(CASES):
        fname, shape, size = CASES[name]
        if args.latent_scale > 1:
            shape = shape[:2] + tuple(max(2, d // args.latent_scale) for d in shape[2:])
        row = {"vae": name, "file": fname, "size_hwf": size, "latent_shape": list(shape)}
        try:
            if name.startswith("hunyuan_video"):
                make_models._hunyuan_vaes(vae_dir, save, only=[fname])
            else:
                make_models.write_video_vaes(vae_dir, save, only=[fname])
            vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(os.path.join(vae_dir, fname)))
            row["comfy_class"] = f"{type(vae.first_stage_model).__module__}.{type(vae.first_stage_model).__name__}"
            row["vae_dtype"] = str(vae.vae_dtype)
            z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            warnings.clear()
            reset()
            t0 = time.perf_counter()
            images = vae.decode(z)
            sync()
            row["decode_s"] = round(time.perf_counter() - t0, 2)
            row["decode_peak_gib"] = peak()
            row["fell_back_to_tiled"] = any("tiled" in w for w in warnings)
            row["warnings"] = warnings[:5]
            row["image_shape"] = list(images.shape)
            flush(row)
            if not args.no_tiled:
                reset()
                t0 = time.perf_counter()
                tiled = _tiled_decode(vae, z)
                sync()
                row["tiled_decode_s"] = round(time.perf_counter() - t0, 2)
                row["tiled_peak_gib"] = peak()
                untiled = images
                if row["fell_back_to_tiled"]:  # ComfyUI's own "untiled" result is already tiles: rebuild the untiled one
                    try:
                        untiled = _untiled_reference(vae, z, "cuda" if gpu else "cpu")
                        row["untiled_reference"] = "PatchRay's diffusers rebuild of the same weights, one process"
                    except Exception as exc:
                        untiled = None
                        row["untiled_reference_error"] = f"{type(exc).__name__}: {exc}"[:800]
                if untiled is not None:
                    a, b = tiled.float().reshape(-1), untiled.float().reshape(-1).to(tiled.device)
                    if a.shape == b.shape:
                        d = (a - b).abs()
                        row["tiled_vs_untiled_max_abs"] = round(d.max().item(), 4)
                        row["tiled_vs_untiled_mean_abs"] = round(d.mean().item(), 5)
                    else:
                        row["tiled_shape"] = list(tiled.shape)
                if row["fell_back_to_tiled"]:
                    d = (images.float().reshape(-1) - untiled.float().reshape(-1).to(images.device)).abs() if untiled is not None else None
                    if d is not None:
                        row["stock_fallback_vs_untiled_max_abs"] = round(d.max().item(), 4)
                        row["stock_fallback_vs_untiled_mean_abs"] = round(d.mean().item(), 5)
                del tiled, untiled
            del images, vae
        except Exception as exc:  # keep going: the failure is part of the record
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        print(json.dumps(row), flush=True)
        results.append(row)
        flush()
        reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
