"""Opt-in: the Cosmos tokenizer VAE, ComfyUI's own classes (``comfy/ldm/cosmos/vae.py``) against PatchRay's conversion
and row mode.

Runs only where ComfyUI is importable (``COMFYUI_DIR``), with the Python that runs ComfyUI:

    COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/python -m pytest -q -s tests/comfyui/test_cosmos_vae.py

* Detection: a full-size ``CausalContinuousVideoTokenizer`` state dict with the ``decoder.unpatcher3d.wavelets`` key a
  released file carries goes through ``comfy.sd.VAE``, the stock loader's constructor, which must pick the tokenizer;
  the state dict it keeps must convert to family ``cosmos`` with diffusers' released Cosmos config.
* Row mode: the tokenizer with ComfyUI's options except its width (32 base channels instead of 128), one resnet per
  level and attention at the first level (``resolution=128``), every weight, bias, norm scale and latent statistic
  non-constant (the Haar filters are constants and stay), converted by the node layer's table and run on 2 and 3
  CPU gloo ranks in fp32 on odd latent sizes (uneven bands), 1 and 3 latent frames. References: the ComfyUI
  module's ``decode`` / ``encode`` on the same tensors.

Tolerances: decode within one 8-bit level (1/255) of ComfyUI's image (``clamp((x + 1) / 2)``); encode within 1e-4
relative (max abs difference over max abs value). Row mode differs from ComfyUI only in summation order
(convolution strips, GroupNorm statistics merged across ranks, attention over gathered keys); the measured
differences (printed) are ~1e-6.
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

#: comfy.sd.VAE's ddconfig for the Cosmos tokenizer
DDCONFIG = {"z_channels": 16, "latent_channels": 16, "z_factor": 1, "resolution": 1024, "in_channels": 3, "out_channels": 3,
            "channels": 128, "channels_mult": [2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [32], "dropout": 0.0,
            "patch_size": 4, "num_groups": 1, "temporal_compression": 8, "spatial_compression": 8}
NARROW = dict(DDCONFIG, channels=32, num_res_blocks=1, resolution=128)

#: (latent [B, C, T, h, w], video [B, 3, F, H, W]): odd rows and columns, 1 and 3 latent frames (1 and 17 frames)
CASES = [((1, 16, 1, 7, 5), (1, 3, 1, 56, 40)), ((1, 16, 3, 5, 7), (1, 3, 17, 40, 56))]


def _narrow():
    import torch
    from comfy.ldm.cosmos.vae import CausalContinuousVideoTokenizer
    from make_models import _init_varied

    model = CausalContinuousVideoTokenizer(**NARROW)
    constants = {name: b.clone() for name, b in model.named_buffers()}  # the Haar filters
    model = _init_varied(model, 21).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(constants[name])
        model.latent_mean.copy_(torch.randn(model.latent_mean.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
        model.latent_std.copy_(torch.rand(model.latent_std.shape, generator=torch.Generator().manual_seed(3)) + 0.5)
    return model


def _rank_task(ctx, family, config, state_dict, z, x):
    import torch

    from patchray.distributed.vae.families import instantiate
    from patchray.distributed.vae.row import row_decode, row_encode

    with torch.device("meta"):  # as the ranks build it: the Haar constants are set at the first call
        vae = instantiate(family, config)
    vae.load_state_dict(state_dict, strict=True, assign=True)
    vae.eval()
    d, e = row_decode(vae, z, ctx), row_encode(vae, x, ctx)
    return None if d is None else (d.numpy(), e.numpy())


def test_stock_loader_detects_cosmos_and_patchray_converts_it(tmp_path):
    comfy_in_process(tmp_path)
    import diffusers
    import torch

    import comfy.sd
    from comfy.ldm.cosmos.vae import CausalContinuousVideoTokenizer
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae

    sd = CausalContinuousVideoTokenizer(**DDCONFIG).state_dict()
    sd["decoder.unpatcher3d.wavelets"] = torch.tensor([0.7071067811865476, 0.7071067811865476])  # as released files
    vae = comfy.sd.VAE(sd=sd)
    assert type(vae.first_stage_model) is CausalContinuousVideoTokenizer
    conv = convert_comfy_vae(vae.first_stage_model.state_dict())
    assert conv.family == "cosmos" and conv.diffusers_class == "AutoencoderKLCosmosLatentStats"
    with torch.device("meta"):  # the class defaults are the released tokenizer's config
        defaults = diffusers.AutoencoderKLCosmos().config
    for key, value in conv.config.items():
        want = defaults[key]
        assert (tuple(value) if isinstance(value, (list, tuple)) else value) == (
            tuple(want) if isinstance(want, (list, tuple)) else want), key


def test_diffusers_own_cosmos_class_differs_from_comfyui(tmp_path):
    """Negative control: diffusers' AutoencoderKLCosmos on the converted weights (no latent statistics in the model)
    does not reproduce ComfyUI; the derived class does."""
    comfy_in_process(tmp_path)
    import diffusers
    import torch

    from patchray.distributed.vae.families import instantiate
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae

    module = _narrow()
    conv = convert_comfy_vae(module.state_dict())
    ours = instantiate(conv.family, conv.config)
    ours.load_state_dict(conv.state_dict, strict=True)
    theirs = diffusers.AutoencoderKLCosmos(**conv.config)
    theirs.load_state_dict({k: v for k, v in conv.state_dict.items() if not k.startswith("latent_")}, strict=True)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, 16, 2, 3, 4, generator=g)
    x = torch.rand(1, 3, 9, 24, 32, generator=g) * 2 - 1
    with torch.no_grad():
        ref, ref_z = module.decode(z), module.encode(x)
        scale = ref.abs().max()
        # the same modules and weights: only fp32 reassociation separates the derived class from ComfyUI
        assert (ours.eval().decode(z).sample - ref).abs().max() < 1e-5 * scale
        assert (ours.encode(x).latent_dist.mode() - ref_z).abs().max() < 1e-4
        assert (theirs.eval().decode(z).sample - ref).abs().max() > 1e-2 * scale
        assert (theirs.encode(x).latent_dist.mode() - ref_z).abs().max() > 1e-2


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cosmos_row_mode_matches_the_comfyui_module(case, tmp_path):
    comfy_in_process(tmp_path)
    import torch

    from patchray.distributed.spawn import run_ranks
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, latent_layout

    module = _narrow()
    conv = convert_comfy_vae(module.state_dict())
    assert conv.family == "cosmos" and latent_layout(conv.family) is None  # ComfyUI's latent passes through
    zshape, xshape = CASES[case]
    g = torch.Generator().manual_seed(4 + case)
    z = torch.randn(zshape, generator=g)
    x = torch.rand(xshape, generator=g) * 2 - 1
    with torch.no_grad():
        ref, ref_z = module.decode(z), module.encode(x)
    pixels = ((ref + 1) / 2).clamp(0, 1)
    assert pixels.std() > 1e-2 and ref_z.std() > 1e-2  # non-trivial references
    state = {k: v.detach().clone() for k, v in conv.state_dict.items()}
    for n in (2, 3):
        out = run_ranks(_rank_task, n, conv.family, conv.config, state, z, x, timeout_s=900)[0]
        got, got_z = torch.from_numpy(out[0]), torch.from_numpy(out[1])
        assert got.shape == ref.shape and got_z.shape == ref_z.shape
        diff = (((got + 1) / 2).clamp(0, 1) - pixels).abs().max().item()
        rel = ((got_z - ref_z).abs().max() / ref_z.abs().max()).item()
        print(f"cosmos latent {zshape} N={n}: decode max |pixel diff| {diff:.2e} (0..1 scale), encode rel diff {rel:.2e}")
        assert diff <= 1 / 255 and rel <= 1e-4
