"""The Hunyuan rows of nodes/bridge/vae_layouts/: ComfyUI's key layouts -> the diffusers models PatchRay shards.

The key names and shapes come from ComfyUI's own classes (tests/fixtures/comfy_hunyuan_vae_layouts.json, written by
tests/comfyui/make_hunyuan_layout_fixtures.py); here they are filled with random tensors, converted, and loaded strictly
into the family's model. That ComfyUI and the converted model compute the same outputs is checked where ComfyUI is
present (tests/comfyui/test_hunyuan_vae_layouts.py).
"""

from pathlib import Path

import pytest
import torch

from patchray.distributed.vae.convert import UnsupportedVaeError
from patchray.distributed.vae.families import get_family, resolve_class
from patchray.nodes.bridge import convert as cv
from patchray.nodes.bridge.vae_layouts import convert_comfy_vae, detect_family, latent_layout

from .comfy_shapes import fixture_state_dict

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "comfy_hunyuan_vae_layouts.json"

#: layout -> (family, diffusers class, spatial ratio, latent channels of the diffusers model)
EXPECTED = {
    "hunyuan_image": ("hunyuan_image", "AutoencoderKLHunyuanImage", 32, 64),
    "hunyuan_image_refiner": ("hunyuan_image_refiner", "AutoencoderKLHunyuanImageRefiner", 16, 32),
    "hunyuan_video": ("hunyuan_video_full_attention", "AutoencoderKLHunyuanVideoFullAttention", 8, 16),
    "plain_conv3d_32ch": ("hunyuan_refiner_conv3d", "AutoencoderKLHunyuanImageRefinerConv3d", 16, 32),
}


def _comfy_sd(layout, seed=0):
    return fixture_state_dict(FIXTURE.name, layout, seed=seed)


@pytest.mark.parametrize("layout", sorted(EXPECTED))
def test_comfy_layout_converts_and_loads_strictly(layout):
    family, cls_name, ratio, channels = EXPECTED[layout]
    sd = _comfy_sd(layout)
    conv = convert_comfy_vae(sd)
    assert (conv.family, conv.diffusers_class) == (family, cls_name)
    assert get_family(family).diffusers_class == cls_name
    model = resolve_class(family)(**conv.config)
    model.load_state_dict(conv.state_dict, strict=True)  # every key, every shape
    assert conv.config["latent_channels"] == channels
    levels = len(conv.config["block_out_channels"])
    assert conv.config.get("spatial_compression_ratio", 2 ** (levels - 1)) == ratio
    # every ComfyUI tensor lands in the model once, unchanged up to a reshape (1x1 conv -> linear)
    got = sorted(tuple(v.reshape(-1)[:4].tolist()) for v in conv.state_dict.values())
    want = sorted(tuple(v.reshape(-1)[:4].tolist()) for v in sd.values())
    assert len(conv.state_dict) == len(sd) and got == want


def test_hunyuan_video_decoder_levels_are_renumbered_from_the_latent():
    sd = _comfy_sd("hunyuan_video")
    conv = convert_comfy_vae(sd)
    # ComfyUI's decoder.up.0 works at full resolution, diffusers' up_blocks.0 next to the latent
    n = len(conv.config["block_out_channels"])
    assert torch.equal(conv.state_dict[f"decoder.up_blocks.{n - 1}.resnets.0.conv1.conv.weight"], sd["decoder.up.0.block.0.conv1.conv.weight"])
    assert torch.equal(conv.state_dict["decoder.up_blocks.0.upsamplers.0.conv.conv.weight"], sd[f"decoder.up.{n - 1}.upsample.conv.conv.weight"])
    q = sd["decoder.mid.attn_1.q.weight"]
    assert torch.equal(conv.state_dict["decoder.mid_block.attentions.0.to_q.weight"], q.reshape(q.shape[0], -1))


def test_the_plain_conv3d_variant_gets_groupnorm_and_zero_padded_convs():
    conv = convert_comfy_vae(_comfy_sd("plain_conv3d_32ch"))
    model = resolve_class(conv.family)(**conv.config)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and not any(type(m).__name__.endswith("RMS_norm") for m in model.modules())
    pads = {m.time_causal_padding + (m.pad_mode,) for m in model.modules() if hasattr(m, "time_causal_padding")}
    assert pads == {(1, 1, 1, 1, 1, 1, "constant")}  # Conv3d(padding=1): zeros on every side, not causal
    layout = latent_layout(conv.family)
    z = torch.zeros(2, 32, 1, 3, 3)
    assert layout.images_are_batch and layout.to_library(z) is z
    with pytest.raises(ValueError, match="one latent frame"):
        layout.to_library(torch.zeros(1, 32, 2, 3, 3))


@pytest.mark.parametrize("layout", ["hunyuan_image", "hunyuan_image_refiner", "hunyuan_video"])
def test_a_missing_weight_is_refused_by_name(layout):
    sd = _comfy_sd(layout)
    del sd["decoder.mid.block_2.norm1." + ("gamma" if layout == "hunyuan_image_refiner" else "weight")]
    with pytest.raises(UnsupportedVaeError, match="missing"):
        convert_comfy_vae(sd)


def test_an_unknown_key_is_refused_by_name():
    sd = _comfy_sd("hunyuan_image")
    sd["decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(UnsupportedVaeError, match="decoder.extra.weight"):
        convert_comfy_vae(sd)


def test_refiner_latents_are_packed_as_comfyui_packs_them():
    layout = latent_layout("hunyuan_image_refiner")
    mean = torch.randn(2, 32, 1, 5, 7)
    packed = layout.from_library(mean)
    # ComfyUI's encoder: cat(first frame, frames) then frame pairs folded into channels
    out = torch.cat((mean[:, :, :1], mean), dim=2).permute(0, 2, 1, 3, 4).reshape(2, 1, 64, 5, 7).permute(0, 2, 1, 3, 4)
    assert torch.equal(packed, out)
    # ComfyUI's decoder: channel pairs unfolded into frames, the first dropped
    z = torch.randn(2, 64, 1, 5, 7)
    unfolded = z.permute(0, 2, 1, 3, 4).reshape(2, 2, 32, 5, 7).permute(0, 2, 1, 3, 4)[:, :, 1:]
    assert torch.equal(layout.to_library(z), unfolded)
    with pytest.raises(ValueError, match="one latent frame"):
        layout.to_library(torch.randn(1, 64, 2, 5, 7))
    assert latent_layout("hunyuan_image") is None and latent_layout("hunyuan_video_full_attention") is None


class _Spec:
    def __init__(self, family, config):
        self.family, self.config = family, config


def test_encode_input_follows_comfyui_images_and_clips():
    pixels = torch.rand(3, 70, 40, 3)  # 3 images (or frames) of 70 x 40, cropped to the ratio like ComfyUI
    refiner = _Spec("hunyuan_image_refiner", {"block_out_channels": (1,) * 5})
    x = cv.encode_input(pixels, refiner)
    assert x.shape == (3, 3, 1, 64, 32)  # a batch of one-frame clips (ComfyUI's not_video)
    assert torch.equal(x[:, :, 0], pixels[:, 3:67, 4:36].movedim(-1, 1) * 2 - 1)
    video = _Spec("hunyuan_video_full_attention", {"block_out_channels": (1,) * 4})
    assert cv.encode_input(pixels, video).shape == (1, 3, 3, 64, 40)  # the frames of one clip
    image = _Spec("hunyuan_image", {"block_out_channels": (1,) * 6})
    assert cv.encode_input(pixels, image).shape == (3, 3, 64, 32)


@pytest.mark.parametrize("other", ["decoder.up_blocks.0.res_blocks.0.conv1.conv.weight", "decoder.blocks.2.blocks.3.stack.5.weight"])
def test_ltx_and_mochi_layouts_are_not_taken_for_hunyuan_video(other):
    # ComfyUI tells LTX-Video and Mochi apart before its generic 3-D KL branch; the Hunyuan rows do the same
    sd = {"decoder.conv_in.conv.weight": torch.zeros(512, 128, 3, 3, 3), other: torch.zeros(1)}
    try:
        family = detect_family(sd)
    except UnsupportedVaeError as exc:  # LTX's own row or Mochi's refusing row: never a Hunyuan row's reason
        assert ("LTX" in str(exc) or "Mochi" in str(exc)) and "Hunyuan" not in str(exc)
    else:
        assert not family.startswith("hunyuan")
