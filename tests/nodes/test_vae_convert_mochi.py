"""The Mochi row of nodes/bridge/vae_layouts/: ComfyUI's key layout (genmo's ``VideoVAE``) -> the diffusers Mochi
layout, built as ``AutoencoderKLMochiGenmo``.

The key names and shapes come from ComfyUI's own classes (tests/fixtures/comfy_mochi_vae_layouts.json, written by
tests/comfyui/make_mochi_layout_fixture.py): ``full`` as ``comfy.sd.VAE`` builds it, ``narrow`` as the opt-in test
builds it. Here they are filled with meta or random tensors, converted and loaded strictly. That ComfyUI and the
converted model compute the same outputs is checked where ComfyUI is present (tests/comfyui/test_mochi_vae.py).
"""

from pathlib import Path

import pytest
import torch

from patchray.distributed.vae.convert import UnsupportedVaeError
from patchray.distributed.vae.families import image_channels, instantiate
from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, detect_family, latent_layout

from .comfy_shapes import fixture_state_dict

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "comfy_mochi_vae_layouts.json"


def _comfy_sd(layout, device="cpu", seed=0):
    return fixture_state_dict(FIXTURE.name, layout, device, seed)


def test_the_released_layout_converts_to_the_released_diffusers_config():
    import diffusers

    conv = convert_comfy_vae(_comfy_sd("full", device="meta"))
    assert (conv.family, conv.diffusers_class) == ("mochi", "AutoencoderKLMochiGenmo")
    with torch.device("meta"):
        defaults = diffusers.AutoencoderKLMochi().config  # the class defaults are the released VAE's
    for key, value in conv.config.items():
        want = defaults[key]
        assert (tuple(value) if isinstance(value, (list, tuple)) else value) == (
            tuple(want) if isinstance(want, (list, tuple)) else want), key
    assert image_channels("mochi", conv.config) == 3  # 15 = 3 channels x (value, sin, cos at two frequencies)
    assert latent_layout("mochi") is None  # ComfyUI's latent is the model's


def test_narrow_layout_loads_strictly_and_runs():
    conv = convert_comfy_vae(_comfy_sd("narrow"))
    vae = instantiate(conv.family, conv.config)
    vae.load_state_dict(conv.state_dict, strict=True)
    # the fused qkv projection is split into views of ComfyUI's tensor, in ComfyUI's q, k, v order
    sd = _comfy_sd("narrow")
    qkv = sd["encoder.layers.2.layers.1.attn_block.attn.qkv.weight"]
    q, k, v = qkv.chunk(3)
    assert torch.equal(vae.encoder.down_blocks[0].attentions[0].to_q.weight, q)
    assert torch.equal(vae.encoder.down_blocks[0].attentions[0].to_v.weight, v)
    with torch.no_grad():
        out = vae.eval().decode(torch.randn(1, 12, 2, 3, 2)).sample
    assert out.shape == (1, 3, 7, 24, 16)  # (T - 1) x 6 + 1 frames, 8x rows and columns


@pytest.mark.parametrize("prefix", ["", "decoder."])
def test_detected_by_the_keys_comfyui_uses(prefix):
    assert detect_family({f"{prefix}blocks.2.blocks.3.stack.5.weight": torch.zeros(1)}) == "mochi"
    assert detect_family({"encoder.layers.4.layers.1.attn_block.attn.qkv.weight": torch.zeros(1)}) == "mochi"


def test_decoder_only_file_is_refused_with_the_reason():
    # the released widths: ComfyUI detects a decoder-only Mochi file by a resnet the narrow decoder does not have
    sd = {k: v for k, v in _comfy_sd("full", device="meta").items() if k.startswith("decoder.")}
    with pytest.raises(UnsupportedVaeError, match="decoder-only"):
        convert_comfy_vae(sd)


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda sd: sd.__setitem__("encoder.layers.2.layers.1.attn_block.attn.qkv.bias", torch.zeros(96)), "qkv bias"),
        (lambda sd: sd.__setitem__("decoder.blocks.1.blocks.0.extra.weight", torch.zeros(3)), "does not map"),
        # an attention without its qkv would leave its norm and output projection unread
        (lambda sd: sd.pop("encoder.layers.2.layers.1.attn_block.attn.qkv.weight"), "does not map"),
    ],
)
def test_layouts_the_map_would_lose_weights_of_are_refused(edit, reason):
    sd = _comfy_sd("narrow")
    edit(sd)
    with pytest.raises(UnsupportedVaeError, match=reason):
        convert_comfy_vae(sd)
