"""Opt-in: PatchRay's row decode/encode of the Hunyuan VAEs against ComfyUI's own classes, in-process.

Runs only where ComfyUI is importable (``COMFYUI_DIR``), with the Python that runs ComfyUI:

    COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/python -m pytest -q tests/comfyui/test_hunyuan_vae_layouts.py

For each Hunyuan layout ComfyUI loads, a random-weight model is built from ComfyUI's classes (reduced widths:
tests/comfyui/make_hunyuan_layout_fixtures.py; every weight, bias and norm scale non-constant), its state dict goes through
the bridge (``convert_comfy_vae``) into the diffusers model PatchRay shards, and PatchRay's row mode on N = 2 and
3 gloo ranks decodes and encodes in fp32. The references are ComfyUI's ``first_stage_model.decode`` /
``encode`` on the same tensors, i.e. what the stock VAE Decode / Encode compute before their pre/post-processing,
which PatchRay reproduces in the bridge (tests/nodes). Full-size models through the stock loader and the real
nodes: test_comfyui_server.py.

Tolerances: decode within one 8-bit level (1/255) of ComfyUI's image (``clamp((x + 1) / 2)``) on every pixel;
encode within 1e-4 relative (max abs difference over max abs value). Row mode differs from ComfyUI only in
summation order (convolution strips, GroupNorm statistics merged across ranks, attention over gathered keys);
the measured differences (printed) are ~1e-5, far inside both.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to compare against its classes"),
]

ROOT = Path(__file__).resolve().parents[2]

#: layout -> [(latent shape ComfyUI decodes, image shape ComfyUI encodes)]: odd sizes near 200x136, 9 and 33 frames
CASES = {
    "hunyuan_image": [((1, 64, 7, 5), (1, 3, 224, 160))],
    "hunyuan_image_refiner": [((1, 64, 1, 13, 9), (1, 3, 1, 208, 144))],
    "hunyuan_video": [((1, 16, 3, 17, 25), (1, 3, 9, 136, 200)), ((1, 16, 9, 9, 5), (1, 3, 33, 72, 40))],
    # the plain-Conv3d variant: images (one frame in, four frames encoded, the last frame decoded)
    "plain_conv3d_32ch": [((1, 32, 1, 13, 9), (1, 3, 1, 208, 144))],
}


def _paths():
    """ComfyUI and the pack (as ``patchray``) importable here and in the spawned ranks (spawn copies sys.path)."""
    if COMFYUI_DIR not in sys.path:
        sys.path.insert(0, COMFYUI_DIR)
    try:
        import patchray  # noqa: F401
    except ImportError:
        link_dir = tempfile.mkdtemp(prefix="patchray-path-")
        os.symlink(ROOT, os.path.join(link_dir, "patchray"))
        sys.path.insert(0, link_dir)


def _init(module, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
            elif "norm" in name or name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))  # non-constant norm scales
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return module.eval()


def _comfy_model(layout):
    from .make_hunyuan_layout_fixtures import build

    return _init(build(COMFYUI_DIR, layout), seed=7)


def _patchray_model(layout):
    from patchray.distributed.vae.families import resolve_class
    from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, latent_layout

    conv = convert_comfy_vae(_comfy_model(layout).state_dict())
    model = resolve_class(conv.family)(**conv.config)
    model.load_state_dict(conv.state_dict, strict=True)
    return model.eval(), latent_layout(conv.family)


def _rank_task(ctx, layout, z, x):
    import torch
    import torch.distributed as dist

    from patchray.distributed.comm import context_for_group
    from patchray.distributed.vae.row import row_decode, row_encode

    vae, latents = _patchray_model(layout)
    groups = {2: dist.new_group([0, 1]), 3: ctx.group}
    out = {}
    for n, group in groups.items():
        if ctx.rank < n:
            sub = context_for_group(group, ctx.device)
            zl = z if latents is None else latents.to_library(z)
            with torch.no_grad():
                dec = row_decode(vae, zl, sub)
                enc = row_encode(vae, x, sub)
            if enc is not None and latents is not None:
                enc = latents.from_library(enc)
            out[n] = None if dec is None else (dec.numpy(), enc.numpy())
    return out


@pytest.mark.parametrize("layout", sorted(CASES))
def test_row_mode_matches_comfyui_classes(layout):
    _paths()
    import torch

    from patchray.distributed.spawn import run_ranks

    comfy = _comfy_model(layout)
    for case, (zshape, xshape) in enumerate(CASES[layout]):
        g = torch.Generator().manual_seed(11 + case)
        z = torch.randn(zshape, generator=g)
        x = torch.rand(xshape, generator=g) * 2 - 1
        with torch.no_grad():
            ref_dec, ref_enc = comfy.decode(z), comfy.encode(x)
        assert ref_dec.std() > 1e-2 and ref_enc.std() > 1e-2  # non-trivial references
        results = run_ranks(_rank_task, 3, layout, z, x, timeout_s=900)[0]
        for n in (2, 3):
            dec, enc = (torch.from_numpy(a) for a in results[n])
            assert dec.shape == ref_dec.shape and enc.shape == ref_enc.shape
            pixel = ((dec + 1) / 2).clamp(0, 1) - ((ref_dec + 1) / 2).clamp(0, 1)
            dec_err = pixel.abs().max().item()
            enc_err = ((enc - ref_enc).abs().max() / ref_enc.abs().max()).item()
            print(f"{layout} latent {tuple(zshape)} N={n}: max pixel diff {dec_err:.3g}, encode rel diff {enc_err:.3g}")
            assert dec_err <= 1 / 255, f"{layout} N={n}: decode differs by {dec_err:.3g}"
            assert enc_err <= 1e-4, f"{layout} N={n}: encode differs by {enc_err:.3g} relative"


def test_diffusers_own_hunyuan_video_class_differs_from_comfyui():
    """Negative control: diffusers' AutoencoderKLHunyuanVideo (frame-causal mid attention) on the converted weights
    does not reproduce ComfyUI on a multi-frame latent; the derived class does."""
    _paths()
    import diffusers
    import torch

    comfy = _comfy_model("hunyuan_video")
    ours, _ = _patchray_model("hunyuan_video")
    theirs = diffusers.AutoencoderKLHunyuanVideo(**ours.config)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    z = torch.randn(1, 16, 3, 5, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = comfy.decode(z)
        assert (ours.eval().decode(z).sample - ref).abs().max() < 1e-4
        assert (theirs.eval().decode(z).sample - ref).abs().max() > 1e-2
