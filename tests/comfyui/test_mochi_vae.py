"""Opt-in: Mochi's VAE, ComfyUI's own classes (``comfy/ldm/genmo/vae/model.py``) against PatchRay's conversion and
row mode.

Runs only where ComfyUI is importable (``COMFYUI_DIR``), with the Python that runs ComfyUI:

    COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/python -m pytest -q -s tests/comfyui/test_mochi_vae.py

* Detection: a full-size ``VideoVAE`` state dict (uninitialised weights: only names and shapes matter) goes through
  ``comfy.sd.VAE``, the stock loader's constructor, which must pick genmo's ``VideoVAE``; the state dict it keeps
  must convert to family ``mochi`` with diffusers' released Mochi config.
* Row mode: genmo's ``Encoder`` / ``Decoder`` built as ``VideoVAE`` builds them but at a quarter of the width (32
  channels per group, GroupNorm(32)) and fewer resnets, every weight, bias and norm scale non-constant, converted by
  the node layer's table and run on 2 and 3 CPU gloo ranks in fp32 on odd latent sizes (uneven bands), 1 and 3
  latent frames (every upsampling block drops frames then). References: the ComfyUI module's ``decode`` /
  ``encode`` on the same tensors (what the stock VAE Decode / Encode compute before their pixel mapping).

Tolerances: decode within one 8-bit level (1/255) of ComfyUI's image (``clamp((x + 1) / 2)``); encode within 1e-4
relative (max abs difference over max abs value). Row mode differs from ComfyUI only in summation order
(convolution strips, GroupNorm statistics merged across ranks); the measured differences (printed) are ~1e-6.
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

#: (latent [B, C, T, h, w], video [B, 3, F, H, W]): odd rows and columns, 1 and 3 latent frames (1 and 13 frames)
CASES = [((1, 12, 1, 7, 5), (1, 3, 1, 56, 40)), ((1, 12, 3, 5, 7), (1, 3, 13, 40, 56))]


def _narrow():
    """genmo's ``VideoVAE`` with its own ``Encoder``/``Decoder`` at base 32 channels (every other option as released)."""
    import torch
    from comfy.ldm.genmo.vae.model import Decoder, Encoder, VideoVAE

    with torch.device("meta"):
        vae = VideoVAE()
    blocks = [1, 1, 2, 1, 1]  # the released [3, 3, 4, 6, 3], one to two resnets per group
    vae.encoder = Encoder(in_channels=15, base_channels=32, channel_multipliers=[1, 2, 4, 6], num_res_blocks=blocks,
                          latent_dim=12, temporal_reductions=[1, 2, 3], spatial_reductions=[2, 2, 2],
                          prune_bottlenecks=[False] * 5, has_attentions=[False, True, True, True, True], affine=True,
                          bias=True, input_is_conv_1x1=True, padding_mode="replicate")
    vae.decoder = Decoder(out_channels=3, base_channels=32, channel_multipliers=[1, 2, 4, 6], temporal_expansions=[1, 2, 3],
                          spatial_expansions=[2, 2, 2], num_res_blocks=blocks, latent_dim=12, has_attention=[False] * 5,
                          padding_mode="replicate", output_norm=False, nonlinearity="silu", output_nonlinearity="silu",
                          causal=True)
    return vae


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


def test_stock_loader_detects_mochi_and_patchray_converts_it(tmp_path):
    comfy_in_process(tmp_path)
    import torch

    import comfy.sd
    from comfy.ldm.genmo.vae.model import VideoVAE
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae

    sd = VideoVAE().state_dict()  # ComfyUI's ops leave the weights uninitialised: names and shapes only
    vae = comfy.sd.VAE(sd=sd)
    assert type(vae.first_stage_model) is VideoVAE
    conv = convert_comfy_vae(vae.first_stage_model.state_dict())
    assert conv.family == "mochi" and conv.diffusers_class == "AutoencoderKLMochiGenmo"
    import diffusers

    with torch.device("meta"):  # the class defaults are the released Mochi VAE's config
        defaults = diffusers.AutoencoderKLMochi().config
    assert {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in conv.config.items()} == {
        k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in defaults.items() if k in conv.config
    }


def test_diffusers_own_mochi_class_differs_from_comfyui(tmp_path):
    """Negative control: diffusers' AutoencoderKLMochi on the converted weights (frames dropped at the end, causal
    encoder attention) does not reproduce ComfyUI on a multi-frame clip; the derived class does."""
    comfy_in_process(tmp_path)
    import diffusers
    import torch

    from make_models import _init_varied
    from patchray.distributed.vae.families import instantiate
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae

    module = _init_varied(_narrow(), 21).eval()
    conv = convert_comfy_vae(module.state_dict())
    ours = instantiate(conv.family, conv.config)
    ours.load_state_dict(conv.state_dict, strict=True)
    theirs = diffusers.AutoencoderKLMochi(**conv.config)
    theirs.load_state_dict(conv.state_dict, strict=True)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, 12, 2, 3, 4, generator=g)
    x = torch.rand(1, 3, 7, 24, 32, generator=g) * 2 - 1
    with torch.no_grad():
        ref, ref_z = module.decode(z), module.encode(x)
        # the same modules and weights, so only fp32 reassociation separates the derived class from ComfyUI
        assert (ours.eval().decode(z).sample - ref).abs().max() < 1e-4
        assert (ours.encode(x).latent_dist.mean - ref_z).abs().max() < 1e-4
        assert (theirs.eval().decode(z).sample - ref).abs().max() > 1e-2
        assert (theirs.encode(x).latent_dist.mean - ref_z).abs().max() > 1e-2


@pytest.mark.parametrize("case", range(len(CASES)))
def test_mochi_row_mode_matches_the_comfyui_module(case, tmp_path):
    comfy_in_process(tmp_path)
    import torch

    from make_models import _init_varied
    from patchray.distributed.spawn import run_ranks
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, latent_layout

    module = _init_varied(_narrow(), 21).eval()
    conv = convert_comfy_vae(module.state_dict())
    assert conv.family == "mochi" and latent_layout(conv.family) is None  # ComfyUI's latent passes through
    zshape, xshape = CASES[case]
    g = torch.Generator().manual_seed(4 + case)
    z = torch.randn(zshape, generator=g)
    x = torch.rand(xshape, generator=g) * 2 - 1
    with torch.no_grad():
        ref, ref_z = module.decode(z), module.encode(x)
    assert ref.std() > 1e-2 and ref_z.std() > 1e-2  # non-trivial references
    state = {k: v.detach().clone() for k, v in conv.state_dict.items()}
    for n in (2, 3):
        out = run_ranks(_rank_task, n, conv.family, conv.config, state, z, x, timeout_s=900)[0]
        got, got_z = torch.from_numpy(out[0]), torch.from_numpy(out[1])
        assert got.shape == ref.shape and got_z.shape == ref_z.shape
        pixel = ((got + 1) / 2).clamp(0, 1) - ((ref + 1) / 2).clamp(0, 1)
        diff = pixel.abs().max().item()
        rel = ((got_z - ref_z).abs().max() / ref_z.abs().max()).item()
        print(f"mochi latent {zshape} N={n}: decode max |pixel diff| {diff:.2e} (0..1 scale), encode rel diff {rel:.2e}")
        assert diff <= 1 / 255 and rel <= 1e-4
