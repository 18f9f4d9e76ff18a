"""Write the key names and shapes of ComfyUI's Hunyuan VAEs (tiny widths) for the conversion tests in CI.

Run once with the Python that runs ComfyUI, from the pack root:

    python tests/comfyui/make_hunyuan_layout_fixtures.py <ComfyUI dir> tests/fixtures/comfy_hunyuan_vae_layouts.json

Each model is built from ComfyUI's own classes exactly as ``comfy.sd.VAE.__init__`` builds it (the same
classes, regularizers and ``ddconfig`` keys), with widths reduced so a test can allocate random tensors of every
shape; ``first_stage_model.state_dict()`` of those models is what the bridge converts. CI (without ComfyUI)
fills the shapes with random tensors and checks the conversion: tests/nodes/test_vae_convert_hunyuan.py.
"""

import json
import sys

#: name -> (module of Encoder/Decoder or "kl3d", regularizer, ddconfig); the 64/32-channel detection keys kept
LAYOUTS = {
    "hunyuan_image": (
        "comfy.ldm.hunyuan_video.vae",
        "DiagonalGaussianRegularizer",
        dict(block_out_channels=[32, 32, 64, 64, 128, 128], in_channels=3, out_channels=3, num_res_blocks=1,
             ffactor_spatial=32, downsample_match_channel=True, upsample_match_channel=True, z_channels=64),
    ),
    "hunyuan_image_refiner": (
        "comfy.ldm.hunyuan_video.vae_refiner",
        "EmptyRegularizer",
        dict(block_out_channels=[16, 16, 32, 64, 64], in_channels=3, out_channels=3, num_res_blocks=1,
             ffactor_spatial=16, ffactor_temporal=4, downsample_match_channel=True, upsample_match_channel=True,
             z_channels=32),
    ),
    "plain_conv3d_32ch": (
        "comfy.ldm.hunyuan_video.vae_refiner",
        "DiagonalGaussianRegularizer",
        dict(block_out_channels=[32, 32, 32, 64, 64], in_channels=3, out_channels=3, num_res_blocks=1,
             ffactor_spatial=16, ffactor_temporal=4, downsample_match_channel=True, upsample_match_channel=True,
             refiner_vae=False, z_channels=32),
    ),
    "hunyuan_video": (
        "kl3d",
        None,
        {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
         "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0, "conv3d": True,
         "time_compress": 4},
    ),
}


def build(comfy_dir, name):
    """The ComfyUI model of ``name`` (ComfyUI importable from ``comfy_dir``)."""
    if comfy_dir not in sys.path:
        sys.path.insert(0, comfy_dir)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management is first imported (it picks the device then)
    from comfy.ldm.models.autoencoder import AutoencoderKL, AutoencodingEngine

    module, reg, ddconfig = LAYOUTS[name]
    if module == "kl3d":
        return AutoencoderKL(ddconfig=dict(ddconfig), embed_dim=ddconfig["z_channels"])
    return AutoencodingEngine(
        regularizer_config={"target": f"comfy.ldm.models.autoencoder.{reg}"},
        encoder_config={"target": f"{module}.Encoder", "params": dict(ddconfig)},
        decoder_config={"target": f"{module}.Decoder", "params": dict(ddconfig)},
    )


def main(comfy_dir, out_path):
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path.insert(0, comfy_dir)
    import comfy.options

    comfy.options.enable_args_parsing()
    out = {}
    for name in LAYOUTS:
        sd = build(comfy_dir, name).state_dict()
        out[name] = {k: list(v.shape) for k, v in sorted(sd.items())}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
