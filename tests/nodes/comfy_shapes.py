"""ComfyUI-shaped test inputs built without ComfyUI.

* :func:`kl_to_ldm` writes a diffusers ``AutoencoderKL`` state dict in the key layout ComfyUI's VAE holds
  (``comfy.sd.VAE.first_stage_model.state_dict()``: ``encoder.down.{i}.block.{j}``, ``mid.attn_1.q`` as 1x1
  convs, ``decoder.up`` numbered from the lowest resolution...). It is the inverse of diffusers'
  ``convert_ldm_vae_checkpoint``, written out here so the test does not check the converter against itself.
* :func:`fixture_state_dict` fills a layout fixture (key names and shapes recorded from ComfyUI's own classes,
  ``tests/fixtures/comfy_*_vae_layouts.json``) with meta or seeded random tensors.
* :class:`ComfyLikeVAE` carries such a state dict the way ``comfy.sd.VAE`` does (``first_stage_model``,
  ``vae_dtype``, ``decode``/``encode`` with ComfyUI's pre/post-processing) with diffusers doing the maths.
  ComfyUI's decode and diffusers' decode of the same weights agreed within 1.1e-5 when this stand-in was written;
  the opt-in test in tests/comfyui checks against the real ComfyUI.
"""

from __future__ import annotations

import re

import torch

_RESNET = {"conv_shortcut": "nin_shortcut"}
_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def kl_to_ldm(sd: dict, n_levels: int) -> dict:
    out = {}
    for k, v in sd.items():
        new = k
        m = re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", k)
        if m:
            new = f"{m[1]}.mid.block_{int(m[2]) + 1}.{_RESNET.get(m[3].split('.')[0], m[3].split('.')[0])}.{m[3].split('.', 1)[1]}"
        m = re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(weight|bias)", k)
        if m:
            new = f"{m[1]}.mid.attn_1.{_ATTN[m[2]]}.{m[3]}"
            if m[3] == "weight" and m[2] != "group_norm":
                v = v[:, :, None, None]
        m = re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(weight|bias)", k)
        if m:
            new = f"encoder.down.{m[1]}.block.{m[2]}.{_RESNET.get(m[3], m[3])}.{m[4]}"
        m = re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(weight|bias)", k)
        if m:
            new = f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
        m = re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(weight|bias)", k)
        if m:
            new = f"decoder.up.{n_levels - 1 - int(m[1])}.block.{m[2]}.{_RESNET.get(m[3], m[3])}.{m[4]}"
        m = re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(weight|bias)", k)
        if m:
            new = f"decoder.up.{n_levels - 1 - int(m[1])}.upsample.conv.{m[2]}"
        new = new.replace("conv_norm_out", "norm_out")
        out[new] = v.clone()
    return out


class _Holder:
    def __init__(self, sd):
        self._sd = sd

    def state_dict(self):
        return dict(self._sd)


class ComfyLikeVAE:
    """What the nodes read from ``comfy.sd.VAE``, backed by a diffusers model for ``decode``/``encode``."""

    def __init__(self, model, ldm_sd: dict, vae_dtype=torch.float32):
        self.model = model.eval()
        self.first_stage_model = _Holder(ldm_sd)
        self.vae_dtype = vae_dtype
        self.decode_calls = 0

    def decode(self, z):  # comfy.sd.VAE.decode: latent as given -> IMAGE [B, H, W, C] (video: [B, T, H, W, C])
        self.decode_calls += 1
        with torch.no_grad():
            x = self.model.decode(z.float()).sample
        return torch.clamp((x + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1)

    def encode(self, pixels):  # comfy.sd.VAE.encode: IMAGE -> latent mean
        with torch.no_grad():
            return self.model.encode(pixels.movedim(-1, 1) * 2.0 - 1.0).latent_dist.mean


def tiny_kl(seed: int = 0, latent_channels: int = 4, quant: bool = True):
    """A tiny diffusers AutoencoderKL with ComfyUI's GroupNorm(32), random weights (incl. norms and biases)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    model = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[32, 64],
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=32,
        use_quant_conv=quant,
        use_post_quant_conv=quant,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # move norms/biases off their 1/0 init so a mis-mapped key shows
    return model


def fixture_state_dict(fixture: str, layout: str, device: str = "cpu", seed: int = 0) -> dict:
    """The state dict of ``layout`` in ``tests/fixtures/<fixture>``: meta tensors (``device="meta"``), else seeded
    random ones of the recorded shapes."""
    import json
    from pathlib import Path

    shapes = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / fixture).read_text())[layout]
    if device == "meta":
        return {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}
