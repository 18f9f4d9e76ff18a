"""nodes/bridge/vae_layouts/: ComfyUI's VAE state dict -> the diffusers model PatchRay shards (checked by the library)."""

import pytest
import torch

from patchray.distributed.vae.convert import UnsupportedVaeError, state_dict_key
from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, detect_family

from .comfy_shapes import kl_to_ldm, tiny_kl


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
        ({"decoder.middle.0.residual.0.gamma": torch.zeros(1), "decoder.upsamples.0.upsamples.0.residual.2.weight": torch.zeros(1)}, "Wan 2.2"),
        ({"decoder.conv_in.weight": torch.zeros(128, 4, 3, 3), "decoder.mid.block_1.mix_factor": torch.zeros(1)}, "SVD"),
        ({"decoder.up_blocks.0.res_blocks.0.conv1.conv.weight": torch.zeros(1)}, "LTX"),
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
