"""Opt-in: ComfyUI's own Wan 2.2 and LTX-Video modules against PatchRay's conversion and row mode, at narrow widths.

The full-size files (tests/comfyui/make_models.py: Wan 2.2 705 M, LTX-Video 0.9.5 1.2 B parameters) need the
stock VAE plus two or three fp32 CPU ranks in memory at once (13-20 GB). This test builds the same ComfyUI classes
narrow (Wan 2.2's ``WanVAE`` with ``dim=16``; LTX-Video's ``VideoVAE`` with its own ``Encoder``/``Decoder`` at
``base_channels=16`` and one resnet per stack, every other option as ``VideoVAE`` sets it for versions 0 and 2),
non-constant weights everywhere (norm scales, biases, latent statistics), converts them with the node layer's
table and runs PatchRay's row decode / encode on 2 and 3 CPU gloo ranks. References: the ComfyUI module's own
``decode`` / ``encode`` (for LTX-Video 0.9.5 with ComfyUI's latent noise under the same seed). Run with ComfyUI's
Python:

    COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/python -m pytest -q -s tests/comfyui/test_comfyui_video_classes.py
"""

import os
from pathlib import Path

import pytest

from .rank_harness import comfy_in_process

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout (and run with its Python)"),
]

ROOT = Path(__file__).resolve().parents[2]


def _wan22():
    import comfy.ldm.wan.vae2_2

    return comfy.ldm.wan.vae2_2.WanVAE(dim=16, dec_dim=24, z_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                       temperal_downsample=[False, True, True], dropout=0.0)


def _ltx(version):
    """``VideoVAE(version)`` as ComfyUI builds it, but its encoder/decoder at base_channels=16, one resnet per stack."""
    import torch
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import Decoder, Encoder, VideoVAE, processor
    from make_layout_fixtures import _ltx_config

    cfg = _ltx_config(VideoVAE, version)
    with torch.device("meta"):
        vae = VideoVAE(config=cfg)
    # the arguments VideoVAE.__init__ passes, plus base_channels
    vae.encoder = Encoder(dims=cfg["dims"], in_channels=3, out_channels=cfg["latent_channels"],
                          blocks=cfg.get("encoder_blocks", cfg.get("blocks")), patch_size=cfg["patch_size"],
                          latent_log_var=cfg["latent_log_var"], norm_layer=cfg["norm_layer"], base_channels=16,
                          spatial_padding_mode=cfg.get("spatial_padding_mode", "zeros"))
    vae.decoder = Decoder(dims=cfg["dims"], in_channels=cfg["latent_channels"], out_channels=3,
                          blocks=cfg.get("decoder_blocks", cfg.get("blocks")), patch_size=cfg["patch_size"],
                          norm_layer=cfg["norm_layer"], causal=cfg.get("causal_decoder", False), base_channels=16,
                          timestep_conditioning=vae.timestep_conditioning,
                          spatial_padding_mode=cfg.get("spatial_padding_mode", "reflect"))
    vae.per_channel_statistics = processor()
    return vae


# (name, builder, latent [C, T, h, w], video frames, spatial ratio)
# 9 and 33 frames, odd latent rows and columns (uneven bands at N = 2 and 3)
CASES = {
    "wan22": (_wan22, (8, 3, 7, 5), 9, 16),
    "wan22_33f": (_wan22, (8, 9, 7, 5), 33, 16),
    "ltx_090": (lambda: _ltx(0), (128, 2, 5, 3), 9, 32),
    "ltx_090_33f": (lambda: _ltx(0), (128, 5, 5, 3), 33, 32),
    "ltx_095": (lambda: _ltx(2), (128, 2, 5, 3), 9, 32),
    "ltx_095_33f": (lambda: _ltx(2), (128, 5, 5, 3), 33, 32),
}


def _rank_task(ctx, family, config, state_dict, z, x):
    import torch

    from patchray.distributed.vae.families import instantiate
    from patchray.distributed.vae.row import row_decode, row_encode

    with torch.device("meta"):
        vae = instantiate(family, config)
    vae.load_state_dict(state_dict, strict=True, assign=True)
    vae.eval()
    d, e = row_decode(vae, z, ctx), row_encode(vae, x, ctx)
    return None if d is None else (d.numpy(), e.numpy())


@pytest.mark.parametrize("name", sorted(CASES))
def test_comfyui_video_class_row_mode_matches_the_comfyui_module(name, tmp_path):
    comfy_in_process(tmp_path)
    import torch

    from make_models import _init_varied
    from patchray.distributed.spawn import run_ranks
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, latent_layout

    build, zshape, frames, ratio = CASES[name]
    module = _init_varied(build(), 21).eval()
    conv = convert_comfy_vae(module.state_dict())
    g = torch.Generator().manual_seed(4)
    z = torch.randn((1,) + zshape, generator=g)
    x = torch.rand(1, 3, frames, zshape[2] * ratio, zshape[3] * ratio, generator=g) * 2 - 1
    layout = latent_layout(conv.family)
    with torch.no_grad():
        torch.manual_seed(9)
        ref = module.decode(z).clamp(-1, 1)  # ComfyUI's process_output clamps (then maps to 0..1)
        ref_z = module.encode(x)
        ref_z = ref_z[0] if isinstance(ref_z, (tuple, list)) else ref_z
    torch.manual_seed(9)
    z_lib = layout.to_library(z) if layout is not None else z  # ComfyUI's decode noise, same seed
    state = {k: v.detach().clone() for k, v in conv.state_dict.items()}
    for n in (2, 3):
        out = run_ranks(_rank_task, n, conv.family, conv.config, state, z_lib, x)[0]
        got, got_z = torch.from_numpy(out[0]).clamp(-1, 1), torch.from_numpy(out[1])
        diff = (got - ref).abs().max().item() / 2  # [-1, 1] -> 0..1 pixels
        rel = ((got_z - ref_z).norm() / ref_z.norm()).item()
        print(f"{name} ({conv.family}) N={n}: decode max |pixel diff| {diff:.2e} (0..1 scale), encode rel L2 {rel:.2e}")
        assert got.shape == ref.shape and got_z.shape == ref_z.shape
        assert diff <= 1 / 255 and rel < 1e-4
