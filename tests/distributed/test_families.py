"""The family table: every row resolves, builds deterministically, and reports shapes the VAEs produce."""

import inspect

import pytest
import torch

from patchray.distributed.vae.families import (
    FAMILIES, build_vae, family_of, get_family, image_channels, instantiate, latent_shape, resolve_class, split_options,
)

SEVEN = ("kl", "flux2", "qwen_image", "wan", "hunyuan_video", "hunyuan_video_15", "ltx2")
VIDEO = ("wan22", "ltx_video", "ltx_video_090")
HUNYUAN_IMAGE = ("hunyuan_image", "hunyuan_image_refiner", "hunyuan_video_full_attention")
DERIVED = ("mochi", "hunyuan_refiner_conv3d", "cosmos")


def test_the_seven_families_are_listed():
    assert set(FAMILIES) == set(SEVEN) | set(VIDEO) | set(HUNYUAN_IMAGE) | set(DERIVED)
    for name, spec in FAMILIES.items():
        assert spec.name == name
        assert spec.spatial_ratio in (8, 16, 32) and spec.temporal_ratio >= 1
        # a 5-D VAE may keep the frame count (the HunyuanImage refiner's diffusers class does)
        assert spec.is_video or spec.temporal_ratio == 1


@pytest.mark.parametrize("family", SEVEN + VIDEO + HUNYUAN_IMAGE + DERIVED)
def test_configs_name_real_constructor_arguments(family):
    spec = FAMILIES[family]
    params = inspect.signature(resolve_class(family).__init__).parameters
    for config in (spec.tiny_config, spec.full_config):
        unknown = set(split_options(config)[0]) - set(params)
        assert not unknown, f"{family}: {unknown} are not arguments of {spec.diffusers_class}"


def test_kl_full_config_is_the_sd_flux1_layout():
    full = FAMILIES["kl"].full_config
    assert full["block_out_channels"] == (128, 256, 512, 512) and full["layers_per_block"] == 2
    assert full["latent_channels"] == 16 and not full["use_quant_conv"] and not full["use_post_quant_conv"]
    assert full["sample_size"] == 1024


def test_build_vae_is_deterministic_and_seeded():
    a, b, c = build_vae("kl"), build_vae("kl"), build_vae("kl", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    state = torch.random.get_rng_state()
    build_vae("kl")
    assert torch.equal(state, torch.random.get_rng_state()), "build_vae must not move the global RNG"


def test_build_vae_dtype_and_errors():
    assert next(build_vae("kl", dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="size must be"):
        build_vae("kl", size="medium")


@pytest.mark.parametrize(
    "family, args, want",
    [
        ("kl", (1024, 1024), (1, 16, 128, 128)),
        ("flux2", (2048, 2048), (1, 32, 256, 256)),
        ("qwen_image", (1024, 1024), (1, 16, 1, 128, 128)),
        ("wan", (480, 832, 81), (1, 16, 21, 60, 104)),
        ("hunyuan_video", (720, 1280, 129), (1, 16, 33, 90, 160)),
        ("hunyuan_video_15", (480, 832, 129), (1, 32, 33, 30, 52)),
        ("ltx2", (1280, 1920, 121), (1, 128, 16, 40, 60)),
        ("wan22", (704, 1280, 121), (1, 48, 31, 44, 80)),
        ("ltx_video", (704, 1216, 121), (1, 128, 16, 22, 38)),
        ("hunyuan_image", (2048, 2048), (1, 64, 64, 64)),
        ("hunyuan_image_refiner", (2048, 2048, 1), (1, 32, 1, 128, 128)),
        ("hunyuan_video_full_attention", (720, 1280, 129), (1, 16, 33, 90, 160)),
    ],
)
def test_latent_shape_of_canonical_sizes(family, args, want):
    assert latent_shape(family, *args) == want


def test_latent_shape_refuses_sizes_the_vae_cannot_take():
    with pytest.raises(ValueError, match="divisible by 8"):
        latent_shape("kl", 1000, 1001)
    with pytest.raises(ValueError, match="frames"):
        latent_shape("wan", 480, 832, frames=80)


def test_family_of_and_unknown_families():
    for family in SEVEN + VIDEO + HUNYUAN_IMAGE + DERIVED:
        assert family_of(build_vae(family)) == family
    for call in (lambda: family_of(torch.nn.Conv2d(1, 1, 1)), lambda: get_family("sd3"), lambda: build_vae("sd3")):
        with pytest.raises(ValueError, match="known families") as info:
            call()
        assert "kl" in str(info.value) and "ltx2" in str(info.value)


def test_families_sharing_a_class_are_told_apart_by_config():
    # Wan 2.1 and 2.2 are both AutoencoderKLWan; LTX-Video 0.9.0 and 0.9.5+ both AutoencoderKLLTXVideo
    assert FAMILIES["wan22"].diffusers_class == FAMILIES["wan"].diffusers_class
    assert family_of(instantiate("wan22", dict(FAMILIES["wan22"].tiny_config))) == "wan22"
    assert family_of(instantiate("wan", {"base_dim": 8, "num_res_blocks": 1})) == "wan"
    assert family_of(build_vae("ltx_video_090")) == "ltx_video_090" and family_of(build_vae("ltx_video")) == "ltx_video"


def test_model_options_are_applied_and_recorded():
    vae = build_vae("ltx_video")
    assert {m.padding_mode for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d)} == {"reflect"}
    assert {m.padding_mode for m in vae.encoder.modules() if isinstance(m, torch.nn.Conv3d)} == {"zeros"}
    assert vae.config["patchray_decode_timestep"] == 0.05 and vae.config["patchray_latents_normalized"]
    with pytest.raises(ValueError, match="unknown PatchRay model option"):
        split_options({"patchray_nonsense": 1})
    # the Wan 2.2 encoder takes 12 patchified channels: the image has 3
    assert image_channels("wan22", FAMILIES["wan22"].full_config) == 3 and image_channels("kl", None) == 3
