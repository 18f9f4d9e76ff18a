"""LTX-Video VAEs ComfyUI loads with ``comfy/ldm/lightricks/vae/causal_video_autoencoder.py`` -> diffusers
``AutoencoderKLLTXVideo`` (family ``ltx_video``).

ComfyUI builds three versions (``comfy.sd.VAE.__init__`` tells them apart by width; a file's metadata ``config`` can
override the guess): 0 = LTX-Video 0.9.0 (strided-conv encoder, plain depth-to-space decoder), 1 = 0.9.1 (the
decoder is conditioned on the decode timestep and injects fresh spatial noise in most resnets), 2 = 0.9.5 / 0.9.7 /
0.9.8 (space-to-depth encoder, residual decoder conditioned on the timestep, no noise injection). The key map here
reads the block structure from the weights (a plain list of residual stacks, resamplers and channel-changing
resnets), so it serves each version at any width; diffusers groups the same modules into down/up blocks.

What ComfyUI does around the model, carried as PatchRay model options (``distributed/vae/families.py`` OPTIONS):
its decoder pads every convolution by reflection (``spatial_padding_mode`` default ``"reflect"``; the encoder
zeros), it normalises latents with ``per_channel_statistics`` (mean-of-means, std-of-means) inside ``encode`` and
``decode``, and a timestep-conditioned decoder gets ``timestep=0.05``. The latent noise ComfyUI mixes in before a
timestep-conditioned decode (``x = randn_like(x) * 0.025 + 0.975 * x``, from the global RNG) is the row's
``latents.to_library`` (:class:`DecodeNoise`).

Not covered, each refused with the reason: the 0.9.1 decoder (its per-layer spatial noise is drawn per position at
every layer: a band cannot reproduce the whole image's draw), GroupNorm/LayerNorm variants (diffusers' class has
pixel norms only), log-variance layouts other than ``uniform``. ComfyUI options that only a file's metadata config
changes (``causal_decoder``, ``spatial_padding_mode``, the stride of plain ``compress_*`` blocks, the ``residual``
flag of decoder upsamplers) are taken at the values ComfyUI's own version guess uses.
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Tuple

import torch

from ....distributed.vae.convert import UnsupportedVaeError
from .table import LayoutRow, indices, refuse

__all__ = ["ROWS", "DecodeNoise", "DECODE_TIMESTEP", "DECODE_NOISE_SCALE"]

#: ``VideoVAE.decode(x, timestep=0.05, noise_scale=0.025)``: ComfyUI's defaults, which no ComfyUI 0.3.64 node changes
DECODE_TIMESTEP = 0.05
DECODE_NOISE_SCALE = 0.025

_KEY = re.compile(r"(encoder|decoder)\.(down_blocks|up_blocks)\.(\d+)\.(.+)$")
_RENAMES = (("res_blocks.", "resnets."), ("conv_shortcut.", "conv_shortcut.conv."), ("norm3.norm.", "norm3."))


def _is_ltx(sd) -> bool:
    return "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight" in sd


def _injects_noise(sd) -> bool:
    return _is_ltx(sd) and any(k.startswith("decoder.") and ".per_channel_scale" in k for k in sd)


def _element(sd, half: str, i: int) -> Tuple[str, int]:
    """``(kind, channels)`` of ComfyUI's ``{half}.{down,up}_blocks.{i}``: res_x, res_x_y or a resampler."""
    p = f"{half}.{'down' if half == 'encoder' else 'up'}_blocks.{i}."
    if p + "res_blocks.0.conv1.conv.weight" in sd:
        return "res_x", len(indices(sd, re.escape(p) + r"res_blocks\.(\d+)\.conv1\.conv\.weight"))
    if p + "conv1.conv.weight" in sd:
        return "res_x_y", 1
    if p + "conv.conv.weight" in sd:
        return "resample_res" if half == "encoder" else "upsample", 1
    if p + "conv.weight" in sd:
        return "resample", 1
    raise UnsupportedVaeError(f"LTX-Video VAE: unrecognised block {p[:-1]}")


def _encoder_groups(sd) -> Tuple[List[dict], int]:
    """diffusers down blocks as ``{"resnets": i, "down": i, "conv_out": i}`` (ComfyUI indices) and the mid block's."""
    n = len(indices(sd, r"encoder\.down_blocks\.(\d+)\."))
    kinds = [_element(sd, "encoder", i)[0] for i in range(n)]
    if not kinds or kinds[-1] != "res_x":
        raise UnsupportedVaeError("LTX-Video VAE: the encoder does not end in a residual stack")
    groups: List[dict] = []
    for i, kind in enumerate(kinds[:-1]):
        if kind == "res_x":  # every residual stack but the last starts a diffusers down block
            groups.append({"resnets": i})
        elif not groups:
            raise UnsupportedVaeError("LTX-Video VAE: the encoder starts with a resampler")
        elif kind in ("resample", "resample_res"):
            groups[-1]["down"] = i
        else:  # res_x_y
            groups[-1]["conv_out"] = i
    return groups, n - 1


def _decoder_groups(sd) -> Tuple[int, List[dict]]:
    """The mid block's ComfyUI index and the diffusers up blocks as ``{"conv_in", "up", "resnets"}`` indices."""
    n = len(indices(sd, r"decoder\.up_blocks\.(\d+)\."))
    kinds = [_element(sd, "decoder", i)[0] for i in range(n)]
    if not kinds or kinds[0] != "res_x":
        raise UnsupportedVaeError("LTX-Video VAE: the decoder does not start with a residual stack")
    groups: List[dict] = []
    for i, kind in enumerate(kinds[1:], start=1):
        if kind == "res_x":
            if not groups or "resnets" in groups[-1]:
                groups.append({})
            groups[-1]["resnets"] = i
        else:
            if not groups or "resnets" in groups[-1]:
                groups.append({})
            groups[-1]["up" if kind == "upsample" else "conv_in"] = i
    if not groups or any("resnets" not in g for g in groups):
        raise UnsupportedVaeError("LTX-Video VAE: a decoder stage without a residual stack")
    return 0, groups


def _w(sd, key) -> torch.Tensor:
    if key not in sd:
        raise UnsupportedVaeError(f"LTX-Video VAE without {key}")
    return sd[key]


def _config(sd) -> dict:
    latent = int(_w(sd, "decoder.conv_in.conv.weight").shape[1])
    if "decoder.conv_norm_out.weight" in sd or "encoder.conv_norm_out.weight" in sd:
        raise UnsupportedVaeError("LTX-Video VAE with GroupNorm/LayerNorm layers: diffusers' class (and PatchRay) has pixel norms only")
    if int(_w(sd, "encoder.conv_out.conv.weight").shape[0]) != latent + 1:
        raise UnsupportedVaeError("LTX-Video VAE whose encoder is not in the 'uniform' log-variance layout")
    patch = int(round((int(_w(sd, "encoder.conv_in.conv.weight").shape[1]) / 3) ** 0.5))
    # encoder
    groups, _mid = _encoder_groups(sd)
    is_095 = any(_element(sd, "encoder", g["down"])[0] == "resample_res" for g in groups if "down" in g)
    boc = [int(_w(sd, "encoder.conv_in.conv.weight").shape[0])]
    layers, scaling, down_types = [], [], []
    for g in groups:
        res = f"encoder.down_blocks.{g['resnets']}."
        layers.append(_element(sd, "encoder", g["resnets"])[1])
        width = int(_w(sd, res + "res_blocks.0.conv1.conv.weight").shape[0])
        scaling.append("down" in g)
        if is_095:
            if "down" not in g:
                raise UnsupportedVaeError("LTX-Video 0.9.5+ VAE: an encoder stage without a downsampler")
            conv = _w(sd, f"encoder.down_blocks.{g['down']}.conv.conv.weight")
            ratio = width * 2 // int(conv.shape[0])  # out = 2 x width channels, spread over the stride's cells
            down_types.append({4: "spatial", 2: "temporal", 8: "spatiotemporal"}.get(ratio))
            if down_types[-1] is None:
                raise UnsupportedVaeError(f"LTX-Video VAE: a space-to-depth block of unknown stride ({ratio} cells)")
            boc.append(width * 2)
        else:
            down_types.append("conv")
            if "conv_out" in g:
                boc.append(int(_w(sd, f"encoder.down_blocks.{g['conv_out']}.conv1.conv.weight").shape[0]))
            elif len(boc) < len(groups):
                boc.append(width)
    layers.append(_element(sd, "encoder", _mid)[1])
    # decoder
    _, ups = _decoder_groups(sd)
    dec_layers = [_element(sd, "decoder", 0)[1]]
    dec_boc, dec_scaling, residual, factor = [], [], [], []
    for g in ups:
        width = int(_w(sd, f"decoder.up_blocks.{g['resnets']}.res_blocks.0.conv1.conv.weight").shape[0])
        dec_layers.append(_element(sd, "decoder", g["resnets"])[1])
        f = 1
        if "up" in g:
            conv = _w(sd, f"decoder.up_blocks.{g['up']}.conv.conv.weight")
            f = 8 * int(conv.shape[1]) // int(conv.shape[0])
        dec_scaling.append("up" in g)
        factor.append(f)
        residual.append(f == 2)  # ComfyUI's version guess: the halving upsamplers (0.9.1+) are the residual ones
        dec_boc.append(width * f)
    timestep = "decoder.last_scale_shift_table" in sd
    config = dict(
        in_channels=3,
        out_channels=int(_w(sd, "decoder.conv_out.conv.weight").shape[0]) // patch**2,
        latent_channels=latent,
        block_out_channels=tuple(boc),
        down_block_types=(("LTXVideo095DownBlock3D" if is_095 else "LTXVideoDownBlock3D"),) * len(groups),
        decoder_block_out_channels=tuple(reversed(dec_boc)),
        layers_per_block=tuple(layers),
        decoder_layers_per_block=tuple(reversed(dec_layers)),
        spatio_temporal_scaling=tuple(scaling),
        decoder_spatio_temporal_scaling=tuple(reversed(dec_scaling)),
        decoder_inject_noise=(False,) * (len(ups) + 1),
        downsample_type=tuple(down_types),
        upsample_residual=tuple(reversed(residual)),
        upsample_factor=tuple(reversed(factor)),
        timestep_conditioning=timestep,
        patch_size=patch,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        spatial_compression_ratio=patch * 2 ** sum(dec_scaling),
        temporal_compression_ratio=2 ** sum(dec_scaling),
        patchray_decoder_padding_mode="reflect",
        patchray_latents_normalized=True,
    )
    if timestep:
        config["patchray_decode_timestep"] = DECODE_TIMESTEP
    return config


def _targets(sd) -> Dict[Tuple[str, int], str]:
    """ComfyUI block -> its diffusers prefix."""
    out = {}
    groups, mid = _encoder_groups(sd)
    for j, g in enumerate(groups):
        out["encoder", g["resnets"]] = f"encoder.down_blocks.{j}."
        if "down" in g:
            out["encoder", g["down"]] = f"encoder.down_blocks.{j}.downsamplers.0."
        if "conv_out" in g:
            out["encoder", g["conv_out"]] = f"encoder.down_blocks.{j}.conv_out."
    out["encoder", mid] = "encoder.mid_block."
    _, ups = _decoder_groups(sd)
    out["decoder", 0] = "decoder.mid_block."
    for j, g in enumerate(ups):
        out["decoder", g["resnets"]] = f"decoder.up_blocks.{j}."
        if "up" in g:
            out["decoder", g["up"]] = f"decoder.up_blocks.{j}.upsamplers.0."
        if "conv_in" in g:
            out["decoder", g["conv_in"]] = f"decoder.up_blocks.{j}.conv_in."
    return out


_TOP = {"decoder.last_time_embedder.": "decoder.time_embedder.", "decoder.last_scale_shift_table": "decoder.scale_shift_table",
        "per_channel_statistics.mean-of-means": "latents_mean", "per_channel_statistics.std-of-means": "latents_std"}
_DROP = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")


def _convert_ltx(sd: Mapping[str, torch.Tensor], **_):
    config = _config(sd)
    targets = _targets(sd)
    out: Dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.startswith(_DROP):
            continue  # statistics ComfyUI keeps but never uses (mean-of-stds*, channel)
        new = key
        for old, rep in _TOP.items():
            if key.startswith(old):
                new = rep + key[len(old):]
        m = _KEY.match(key)
        if m:
            half, _, i, rest = m.groups()
            for old, rep in _RENAMES:
                rest = rest.replace(old, rep)
            new = targets[half, int(i)] + rest
        if new in out:
            raise UnsupportedVaeError(f"LTX-Video VAE: two weights map to {new}")
        out[new] = value
    return "AutoencoderKLLTXVideo", config, out


class DecodeNoise:
    """ComfyUI's LATENT -> what the library decodes, for a timestep-conditioned LTX-Video decoder: ComfyUI mixes
    noise into the latent first (``VideoVAE.decode``: ``randn_like(x) * 0.025 + (1 - 0.025) * x`` from the global
    RNG). Drawn here, once, on the driver, from the same global RNG and in the same shape, so a decode after the
    same seed matches the stock decode on the same device. Encoding needs no change."""

    images_are_batch = False

    def __init__(self, noise_scale: float = DECODE_NOISE_SCALE):
        self.noise_scale = noise_scale

    def to_library(self, z: torch.Tensor) -> torch.Tensor:
        z = z.float()
        return torch.randn_like(z) * self.noise_scale + (1.0 - self.noise_scale) * z

    def from_library(self, z: torch.Tensor) -> torch.Tensor:
        return z


def _timestep_conditioned(sd) -> bool:
    return _is_ltx(sd) and "decoder.last_scale_shift_table" in sd


ROWS = [
    refuse(
        "LTX-Video 0.9.1 VAE",
        _injects_noise,
        "LTX-Video 0.9.1 VAE: its decoder adds fresh random noise at every position in most layers, which a "
        "row-sharded decode cannot reproduce",
    ),
    # ComfyUI's VideoVAE.encode (every version) raises for a frame count other than 1 + 8k
    LayoutRow("LTX-Video 0.9.5 / 0.9.7 / 0.9.8 VAE", "ltx_video", _timestep_conditioned, _convert_ltx, latents=DecodeNoise(),
              encode_frame_step=8),
    LayoutRow("LTX-Video 0.9.0 VAE", "ltx_video_090", _is_ltx, _convert_ltx, encode_frame_step=8),
]
