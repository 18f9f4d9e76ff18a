"""Record the state-dict layouts (key -> shape) of video VAEs as ComfyUI's own classes build them.

Run once with the Python that runs ComfyUI; the CI conversion tests read the JSON without ComfyUI:

    python tests/comfyui/make_layout_fixtures.py /path/to/ComfyUI tests/fixtures/comfy_vae_layouts.json

Layouts: ComfyUI's Wan 2.2 class (``comfy/ldm/wan/vae2_2.py``, the options ``comfy.sd.VAE`` passes, narrow widths),
its Wan 2.1 class (the layout the released Qwen-Image VAE uses, narrow), and LTX-Video's ``VideoVAE`` for each
version ``comfy.sd.VAE`` builds (0 = 0.9.0, 1 = 0.9.1, 2 = 0.9.5/0.9.7/0.9.8), with its own config but one resnet
per stack (its widths are fixed by the class). Shapes only: the tests fill them with random or meta tensors.
"""

import json
import sys


def _ltx_config(video_vae, version):
    cfg = video_vae.guess_config(None, version)
    for key in ("blocks", "encoder_blocks", "decoder_blocks"):
        if key in cfg:
            blocks = []
            for name, params in cfg[key]:
                if name == "res_x":
                    params = dict(params) if isinstance(params, dict) else {"num_layers": params}
                    params["num_layers"] = 1
                blocks.append([name, params])
            cfg[key] = blocks
    return cfg


def main(comfy_dir, out):
    sys.path.insert(0, comfy_dir)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch

    import comfy.ldm.wan.vae
    import comfy.ldm.wan.vae2_2
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    models = {
        "wan22": ("wan22", lambda: comfy.ldm.wan.vae2_2.WanVAE(dim=16, dec_dim=24, z_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                                              attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)),
        "wan21_qwen_image": ("wan", lambda: comfy.ldm.wan.vae.WanVAE(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                                                    attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)),
        "ltx_v0_090": ("ltx_video_090", lambda: VideoVAE(config=_ltx_config(VideoVAE, 0))),
        "ltx_v1_091": (None, lambda: VideoVAE(config=_ltx_config(VideoVAE, 1))),
        "ltx_v2_095": ("ltx_video", lambda: VideoVAE(config=_ltx_config(VideoVAE, 2))),
    }
    fixture = {}
    with torch.device("meta"):
        for name, (family, build) in models.items():
            fixture[name] = {"family": family, "shapes": {k: list(v.shape) for k, v in build().state_dict().items()}}
    with open(out, "w") as f:
        json.dump(fixture, f, indent=0, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
