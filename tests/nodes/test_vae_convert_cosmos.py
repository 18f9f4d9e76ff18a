"""The Cosmos row of nodes/bridge/vae_layouts/: ComfyUI's tokenizer layout -> the diffusers Cosmos layout, built as
``AutoencoderKLCosmosLatentStats``.

The key names and shapes come from ComfyUI's own class (tests/fixtures/comfy_cosmos_vae_layouts.json, written by
tests/comfyui/make_cosmos_layout_fixture.py): ``full`` as ``comfy.sd.VAE`` builds it, ``narrow`` as the opt-in test
builds it. Here they are filled with meta or random tensors, converted and loaded strictly. That ComfyUI and the
converted model compute the same outputs is checked where ComfyUI is present (tests/comfyui/test_cosmos_vae.py).
"""

from pathlib import Path

import pytest
import torch

from patchray.distributed.vae.convert import UnsupportedVaeError
from patchray.distributed.vae.families import instantiate
from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, detect_family, latent_layout

from .comfy_shapes import fixture_state_dict

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "comfy_cosmos_vae_layouts.json"


def _comfy_sd(layout, device="cpu", seed=0):
    return fixture_state_dict(FIXTURE.name, layout, device, seed)


def test_the_released_layout_converts_to_the_released_diffusers_config():
    import diffusers

    conv = convert_comfy_vae(_comfy_sd("full", device="meta"))
    assert (conv.family, conv.diffusers_class) == ("cosmos", "AutoencoderKLCosmosLatentStats")
    with torch.device("meta"):
        defaults = diffusers.AutoencoderKLCosmos().config  # the class defaults are the released tokenizer's
    for key, value in conv.config.items():
        want = defaults[key]
        assert (tuple(value) if isinstance(value, (list, tuple)) else value) == (
            tuple(want) if isinstance(want, (list, tuple)) else want), key
    assert latent_layout("cosmos") is None  # ComfyUI's latent is the model's (it normalises inside the model)


def test_narrow_layout_loads_strictly_with_decoder_levels_renumbered():
    sd = _comfy_sd("narrow")
    conv = convert_comfy_vae(sd)
    vae = instantiate(conv.family, conv.config)
    vae.load_state_dict(conv.state_dict, strict=True)
    n = len([k for k in sd if k.startswith("decoder.up.") and k.endswith(".block.0.norm1.norm.weight")])
    # ComfyUI's decoder.up.0 works at full resolution, diffusers' up_blocks.0 next to the latent
    assert torch.equal(conv.state_dict[f"decoder.up_blocks.{n - 1}.resnets.0.conv1.conv_s.weight"],
                       sd["decoder.up.0.block.0.conv1.0.conv3d.weight"])
    assert torch.equal(vae.latent_std, sd["latent_std"])
    with torch.no_grad():
        out = vae.eval().decode(torch.randn(1, 16, 2, 3, 2)).sample
    assert out.shape == (1, 3, 9, 24, 16)  # (T - 1) x 8 + 1 frames, 8x rows and columns


def test_detected_by_comfyuis_key_and_by_the_models_own():
    assert detect_family({"decoder.unpatcher3d.wavelets": torch.zeros(2)}) == "cosmos"
    assert detect_family({"decoder.conv_in.0.conv3d.weight": torch.zeros(1), "latent_mean": torch.zeros(1)}) == "cosmos"


def test_decoder_only_and_unknown_keys_are_refused_with_the_reason():
    sd = {k: v for k, v in _comfy_sd("narrow", device="meta").items() if not k.startswith("encoder.")}
    with pytest.raises(UnsupportedVaeError, match="full tokenizer"):
        convert_comfy_vae(sd)
    sd = _comfy_sd("narrow", device="meta")
    sd["decoder.up.0.block.0.extra.weight"] = torch.empty(3, device="meta")
    with pytest.raises(UnsupportedVaeError, match="unexpected"):
        convert_comfy_vae(sd)
