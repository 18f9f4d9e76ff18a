"""nodes/bridge/vae_layouts/: ComfyUI's VAE state dict -> the diffusers model PatchRay shards (checked by the library)."""

import json
from pathlib import Path

import pytest
import torch

from patchray.distributed.vae.convert import UnsupportedVaeError, state_dict_key
from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, detect_family

from .comfy_shapes import kl_to_ldm, tiny_kl

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "comfy_vae_layouts.json"


@pytest.mark.parametrize("quant", [True, False], ids=["sd-layout", "flux-layout"])
def test_kl_round_trip_decodes_identically(quant):
    import diffusers

    model = tiny_kl(seed=1, quant=quant)
    ldm = kl_to_ldm(model.state_dict(), n_levels=2)
    conv = convert_comfy_vae(ldm)
    assert conv.family == "kl" and conv.diffusers_class == "AutoencoderKL"
    assert conv.config["block_out_channels"] == [32, 64] and conv.config["layers_per_block"] == 1
    assert conv.config["use_quant_conv"] is quant and conv.config["use_post_quant_conv"] is quant
    rebuilt = diffusers.AutoencoderKL(**conv.config)
    rebuilt.load_state_dict(conv.state_dict, strict=True)
    z = torch.randn(1, 4, 8, 8)
    x = torch.rand(1, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        # same weights, same modules, same input: bit-identical
        assert torch.equal(model.decode(z).sample, rebuilt.decode(z).sample)
        assert torch.equal(model.encode(x).latent_dist.mean, rebuilt.encode(x).latent_dist.mean)


def test_missing_weight_is_refused_with_its_name():
    ldm = kl_to_ldm(tiny_kl().state_dict(), n_levels=2)
    del ldm["decoder.mid.block_1.norm1.weight"]
    with pytest.raises(UnsupportedVaeError, match="missing"):
        convert_comfy_vae(ldm)


def test_wrong_shape_is_refused():
    ldm = kl_to_ldm(tiny_kl().state_dict(), n_levels=2)
    ldm["decoder.conv_out.bias"] = torch.zeros(5)
    with pytest.raises(UnsupportedVaeError, match="conv_out"):
        convert_comfy_vae(ldm)


@pytest.mark.parametrize(
    "keys, reason",
    [
        ({}, "no weights"),
        ({"taesd_decoder.1.weight": torch.zeros(64, 4, 3, 3)}, "TAESD"),
        ({"decoder.conv_in.weight": torch.zeros(128, 4, 3, 3), "decoder.mid.block_1.mix_factor": torch.zeros(1)}, "SVD"),
        ({"decoder.up_blocks.0.res_blocks.0.conv1.conv.weight": torch.zeros(1),
          "decoder.up_blocks.0.res_blocks.0.per_channel_scale1": torch.zeros(1)}, "0.9.1 VAE: its decoder adds fresh random noise"),
        ({"decoder.conv_in.weight": torch.zeros(8, 4, 3, 3), "decoder.up.1.upsample.conv.weight": torch.zeros(32, 8, 3, 3)}, "Hunyuan"),
        ({"something.else": torch.zeros(1)}, "unrecognised"),
    ],
)
def test_families_without_a_converter_say_why(keys, reason):
    with pytest.raises(UnsupportedVaeError, match=reason):
        detect_family(keys)


def test_state_dict_key_tells_weights_apart():
    a = tiny_kl(seed=1).state_dict()
    b = tiny_kl(seed=2).state_dict()
    assert state_dict_key(a) == state_dict_key({k: v.clone() for k, v in a.items()})
    assert state_dict_key(a) != state_dict_key(b)
    assert state_dict_key(a, "kl") != state_dict_key(a, "wan")


# ------------------------------------------------------------------------------ video VAEs (ComfyUI-recorded layouts)
# tests/fixtures/comfy_vae_layouts.json holds the key -> shape layouts ComfyUI 0.3.64's own classes build (Wan 2.2,
# Wan 2.1 = the Qwen-Image VAE's layout, LTX-Video versions 0/1/2), recorded by tests/comfyui/make_layout_fixtures.py.
# The numbers (decode and encode against ComfyUI's classes) are checked by the opt-in tests in tests/comfyui.


def _layouts():
    return json.loads(FIXTURES.read_text())


@pytest.mark.parametrize("name", sorted(_layouts()))
def test_comfyui_video_layouts_convert_and_load_strictly(name):
    from patchray.distributed.vae.families import FAMILIES, instantiate

    entry = _layouts()[name]
    with torch.device("meta"):
        sd = {k: torch.empty(shape) for k, shape in entry["shapes"].items()}
    if entry["family"] is None:
        with pytest.raises(UnsupportedVaeError, match="0.9.1"):
            convert_comfy_vae(sd)
        return
    conv = convert_comfy_vae(sd)
    assert conv.family == entry["family"] and conv.diffusers_class == FAMILIES[conv.family].diffusers_class
    with torch.device("meta"):
        model = instantiate(conv.family, conv.config)
    model.load_state_dict(conv.state_dict, strict=True, assign=True)  # every weight used, none left over
    from patchray.distributed.vae.families import family_of

    assert family_of(model) == conv.family
    if conv.family.startswith("ltx"):
        # ComfyUI pads its LTX decoder by reflection (the encoder by zeros) and normalises latents with the file's
        # per-channel statistics; a timestep-conditioned decoder gets t = 0.05 (comfy VideoVAE.decode's default)
        assert conv.config["patchray_decoder_padding_mode"] == "reflect" and conv.config["patchray_latents_normalized"]
        assert conv.config.get("patchray_decode_timestep") == (0.05 if conv.config["timestep_conditioning"] else None)
        assert conv.state_dict["latents_mean"].shape == (conv.config["latent_channels"],)
    if conv.family == "wan22":
        assert conv.config["z_dim"] == 8 and conv.config["is_residual"] and conv.config["patch_size"] == 2


def test_a_missing_video_weight_is_refused_with_its_name():
    for name in ("wan22", "ltx_v2_095"):
        with torch.device("meta"):
            sd = {k: torch.empty(shape) for k, shape in _layouts()[name]["shapes"].items()}
        victim = sorted(k for k in sd if "conv2" in k or "conv.conv" in k)[0]
        del sd[victim]
        with pytest.raises(UnsupportedVaeError):
            convert_comfy_vae(sd)


def test_ltx_decode_noise_is_comfyui_s_latent_mix():
    from patchray.nodes.bridge.vae_layouts import latent_layout

    layout = latent_layout("ltx_video")
    assert latent_layout("ltx_video_090") is None  # the 0.9.0 decoder takes the latent as it is
    z = torch.randn(1, 8, 2, 3, 4)
    torch.manual_seed(5)
    got = layout.to_library(z)
    torch.manual_seed(5)
    # comfy/ldm/lightricks/vae/causal_video_autoencoder.py VideoVAE.decode, written out
    want = torch.randn_like(z) * 0.025 + (1.0 - 0.025) * z
    assert torch.equal(got, want) and not torch.equal(got, z)
    assert layout.from_library(z) is z


def test_qwen_image_vae_is_the_wan_2_1_class():
    """ComfyUI loads the released Qwen-Image VAE (Wan 2.1 key layout, 16 channels) with its Wan 2.1 class, so it
    converts to the ``wan`` family; diffusers' own Qwen-Image class computes exactly what AutoencoderKLWan does with
    the same weights, so nothing is lost by that route."""
    import diffusers

    entry = _layouts()["wan21_qwen_image"]
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(shape, generator=g) * 0.2 + (1.0 if k.endswith("gamma") else 0.0) for k, shape in entry["shapes"].items()}
    conv = convert_comfy_vae(sd)
    assert conv.family == "wan" and conv.config["z_dim"] == 16
    wan = diffusers.AutoencoderKLWan(**conv.config).eval()
    qwen = diffusers.AutoencoderKLQwenImage(**conv.config).eval()
    wan.load_state_dict(conv.state_dict, strict=True)
    qwen.load_state_dict(conv.state_dict, strict=True)
    z = torch.randn(1, 16, 1, 3, 2, generator=g)
    x = torch.rand(1, 3, 1, 24, 16, generator=g) * 2 - 1
    with torch.no_grad():
        assert torch.equal(wan.decode(z).sample, qwen.decode(z).sample)
        assert torch.equal(wan.encode(x).latent_dist.mean, qwen.encode(x).latent_dist.mean)
