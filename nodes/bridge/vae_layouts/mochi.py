"""Mochi's VAE as ComfyUI loads it (``comfy/ldm/genmo/vae/model.py``, genmo's release) -> the diffusers
``AutoencoderKLMochi`` layout, built as ``AutoencoderKLMochiGenmo`` (family ``mochi``,
``distributed/vae/variants.py``).

The modules are the same: per-frame GroupNorm(32) resnets (``GroupNormSpatial`` / ``MochiChunkedGroupNorm3D``),
causal 3-D convolutions padded by replication in time and space (``PConv3d`` / ``CogVideoXCausalConv3d``), 1x1
projections as linear layers, depth-to-space upsampling, Fourier input features and, in the encoder, attention
over the frames of each pixel. Two steps differ from diffusers' class, which the derived class restores: genmo's
decoder drops the first ``temporal_expansion - 1`` frames inside every upsampling block (diffusers drops them all at
the end), and its encoder attention is not causal.

Key map: ComfyUI keeps genmo's ``blocks.{i}`` (decoder) and ``layers.{i}`` (encoder) sequences; each sequence is
read group by group (input projection, resnets, resamplers) and renamed to diffusers' ``block_in`` /
``up_blocks`` / ``down_blocks`` / ``block_out``. ComfyUI's fused ``qkv`` projection is split into ``to_q``,
``to_k``, ``to_v`` (views of the same tensor, in that order, as ComfyUI unbinds them).
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch

from ....distributed.vae.convert import UnsupportedVaeError
from .table import LayoutRow, indices

__all__ = ["ROWS", "MOCHI_KEYS"]

#: the keys ``comfy.sd.VAE.__init__`` detects Mochi's VAE by (decoder-only and encoder-only files, prefixed or not)
MOCHI_KEYS = (
    "blocks.2.blocks.3.stack.5.weight",
    "decoder.blocks.2.blocks.3.stack.5.weight",
    "layers.4.layers.1.attn_block.attn.qkv.weight",
    "encoder.layers.4.layers.1.attn_block.attn.qkv.weight",
)

# ResBlock.stack: GroupNormSpatial, SiLU, PConv3d, GroupNormSpatial, SiLU, PConv3d
_STACK = {"stack.0.": "norm1.norm_layer.", "stack.2.": "conv1.conv.", "stack.3.": "norm2.norm_layer.", "stack.5.": "conv2.conv."}
_SPATIAL_EXPANSION = 2  # genmo's VideoVAE (and diffusers' default): every resampler doubles rows and columns


def _is_mochi(sd) -> bool:
    return any(k in sd for k in MOCHI_KEYS)


def _block(sd, src: str, dst: str, j: int, out: dict, attention: bool) -> None:
    """ComfyUI ``ResBlock`` at ``src`` -> diffusers resnet ``j`` (and its attention) of the block at ``dst``."""
    for a, b in _STACK.items():
        for leaf in ("weight", "bias"):
            if f"{src}.{a}{leaf}" in sd:
                out[f"{dst}.resnets.{j}.{b}{leaf}"] = sd[f"{src}.{a}{leaf}"]
    has = f"{src}.attn_block.attn.qkv.weight" in sd
    if has != attention:
        raise UnsupportedVaeError(f"Mochi VAE block {src} {'has' if has else 'lacks'} the attention of its group's other blocks")
    if has:
        for leaf in ("weight", "bias"):
            out[f"{dst}.norms.{j}.norm_layer.{leaf}"] = sd[f"{src}.attn_block.norm.{leaf}"]
        qkv = sd[f"{src}.attn_block.attn.qkv.weight"]
        if f"{src}.attn_block.attn.qkv.bias" in sd:
            raise UnsupportedVaeError("Mochi VAE attention with a qkv bias, which diffusers' class does not have")
        q, k, v = qkv.chunk(3, dim=0)
        out[f"{dst}.attentions.{j}.to_q.weight"] = q
        out[f"{dst}.attentions.{j}.to_k.weight"] = k
        out[f"{dst}.attentions.{j}.to_v.weight"] = v
        for leaf in ("weight", "bias"):
            out[f"{dst}.attentions.{j}.to_out.0.{leaf}"] = sd[f"{src}.attn_block.attn.out.{leaf}"]


def _is_res_block(sd, prefix: str) -> bool:
    return f"{prefix}.stack.2.weight" in sd


def _width(sd, prefix: str) -> int:
    return int(sd[f"{prefix}.stack.2.weight"].shape[0])


def _decoder(sd, out: dict):
    """Decoder groups -> ``(widths from the image side, layers per group from the image side, temporal expansions)``."""
    groups = indices(sd, r"decoder\.blocks\.(\d+)\.")
    if len(groups) < 3 or "decoder.blocks.0.0.weight" not in sd:
        raise UnsupportedVaeError("Mochi VAE decoder without its input convolution and up blocks")
    if any(".attn_block." in k for k in sd if k.startswith("decoder.")):
        raise UnsupportedVaeError("Mochi VAE decoder with attention, which diffusers' class does not build")
    out["decoder.conv_in.weight"] = sd["decoder.blocks.0.0.weight"]
    out["decoder.conv_in.bias"] = sd["decoder.blocks.0.0.bias"]
    first = [j for j in indices(sd, r"decoder\.blocks\.0\.(\d+)\.stack\.") if j > 0]
    for j in first:
        _block(sd, f"decoder.blocks.0.{j}", "decoder.block_in", j - 1, out, False)
    widths, layers, texp = [], [len(first)], []  # widths from the latent side: each up block's, then block_out's
    for i in groups[1:-1]:
        res = indices(sd, rf"decoder\.blocks\.{i}\.blocks\.(\d+)\.stack\.")
        for j in res:
            _block(sd, f"decoder.blocks.{i}.blocks.{j}", f"decoder.up_blocks.{i - 1}", j, out, False)
        out[f"decoder.up_blocks.{i - 1}.proj.weight"] = sd[f"decoder.blocks.{i}.proj.weight"]
        out[f"decoder.up_blocks.{i - 1}.proj.bias"] = sd[f"decoder.blocks.{i}.proj.bias"]
        layers.append(len(res))
        widths.append(_width(sd, f"decoder.blocks.{i}.blocks.0"))
    last = groups[-1]
    res = indices(sd, rf"decoder\.blocks\.{last}\.(\d+)\.stack\.")
    for j in res:
        _block(sd, f"decoder.blocks.{last}.{j}", "decoder.block_out", j, out, False)
    layers.append(len(res))
    widths.append(_width(sd, f"decoder.blocks.{last}.0"))
    if first and _width(sd, "decoder.blocks.0.1") != widths[0]:
        raise UnsupportedVaeError("Mochi VAE whose first decoder resnets and first up block differ in width")
    for i in groups[1:-1]:  # proj: width -> next width x temporal x spatial^2 (ComfyUI's d2st channel order)
        proj, nxt = sd[f"decoder.blocks.{i}.proj.weight"].shape[0], widths[i]
        t, rem = divmod(int(proj), nxt * _SPATIAL_EXPANSION**2)
        if rem:
            raise UnsupportedVaeError(f"Mochi VAE up block {i}: projection of {proj} channels is not {nxt} x t x 4")
        texp.append(t)
    out["decoder.proj_out.weight"] = sd["decoder.output_proj.weight"]
    out["decoder.proj_out.bias"] = sd["decoder.output_proj.bias"]
    # diffusers lists widths and layers from the image side; the expansions from the image side too
    return tuple(reversed(widths)), tuple(reversed(layers)), tuple(reversed(texp))


def _encoder(sd, out: dict, n_down: int):
    """Encoder ``layers`` sequence -> ``(widths, layers per group, temporal reductions, attention per group)``."""
    seq = indices(sd, r"encoder\.layers\.(\d+)\.")
    if not seq or "encoder.layers.0.weight" not in sd:
        raise UnsupportedVaeError("Mochi VAE without an encoder (a decoder-only file): load the full VAE")
    out["encoder.proj_in.weight"] = sd["encoder.layers.0.weight"]
    out["encoder.proj_in.bias"] = sd["encoder.layers.0.bias"]
    groups = []  # [(kind, [sequence indices])]: resnets before the first downsampler ("in"), each downsampler, the rest
    for i in seq[1:]:
        if not _is_res_block(sd, f"encoder.layers.{i}"):
            groups.append(("down", [i]))
        elif groups and groups[-1][0] != "down":
            groups[-1][1].append(i)
        else:
            groups.append(("in" if not groups else "out", [i]))
    if len(groups) != n_down + 2 or groups[0][0] != "in" or groups[-1][0] != "out":
        raise UnsupportedVaeError(f"Mochi VAE encoder with {len(groups)} groups; the decoder implies {n_down + 2}")
    widths, layers, treduce, attention = [], [], [], []
    for g, (kind, members) in enumerate(groups):
        if kind == "down":
            i = members[0]
            w = sd[f"encoder.layers.{i}.layers.0.weight"]  # the strided PConv3d [out, in, t, s, s]
            out[f"encoder.down_blocks.{g - 1}.conv_in.conv.weight"] = w
            out[f"encoder.down_blocks.{g - 1}.conv_in.conv.bias"] = sd[f"encoder.layers.{i}.layers.0.bias"]
            if tuple(w.shape[-2:]) != (_SPATIAL_EXPANSION,) * 2:
                raise UnsupportedVaeError(f"Mochi VAE downsampler with a {tuple(w.shape[-2:])} spatial kernel")
            treduce.append(int(w.shape[2]))
            res = indices(sd, rf"encoder\.layers\.{i}\.layers\.(\d+)\.stack\.")
            srcs = [f"encoder.layers.{i}.layers.{j}" for j in res]
            dst = f"encoder.down_blocks.{g - 1}"
        else:
            srcs = [f"encoder.layers.{i}" for i in members]
            dst = "encoder.block_in" if kind == "in" else "encoder.block_out"
        has = f"{srcs[0]}.attn_block.attn.qkv.weight" in sd
        for j, src in enumerate(srcs):
            _block(sd, src, dst, j, out, has)
        widths.append(_width(sd, srcs[0]))
        layers.append(len(srcs))
        attention.append(has)
    for leaf in ("weight", "bias"):
        out[f"encoder.norm_out.norm_layer.{leaf}"] = sd[f"encoder.output_norm.{leaf}"]
    out["encoder.proj_out.weight"] = sd["encoder.output_proj.weight"]
    return tuple(widths[:1] + widths[1:-1]), tuple(layers), tuple(treduce), tuple(attention)


def _convert_mochi(sd: Mapping[str, torch.Tensor], **_):
    sd = _Reads(sd)
    out: Dict[str, torch.Tensor] = {}
    dec_widths, dec_layers, texp = _decoder(sd, out)
    enc_widths, enc_layers, treduce, attention = _encoder(sd, out, len(texp))
    if enc_layers != dec_layers:
        # diffusers' class takes one layers_per_block for both halves, as genmo's VideoVAE builds them
        raise UnsupportedVaeError(f"Mochi VAE with encoder layers {enc_layers} but decoder layers {dec_layers}")
    if treduce != texp:
        raise UnsupportedVaeError(f"Mochi VAE with temporal reductions {treduce} but expansions {texp}")
    config = dict(
        in_channels=int(sd["encoder.layers.0.weight"].shape[1]),
        out_channels=int(sd["decoder.output_proj.weight"].shape[0]),
        encoder_block_out_channels=enc_widths,
        decoder_block_out_channels=dec_widths,
        latent_channels=int(sd["decoder.blocks.0.0.weight"].shape[1]),
        layers_per_block=dec_layers,
        temporal_expansions=texp,
        spatial_expansions=(_SPATIAL_EXPANSION,) * len(texp),
        add_attention_block=attention,
    )
    unmapped = set(sd) - sd.read
    if unmapped:
        raise UnsupportedVaeError(f"keys PatchRay does not map for this Mochi VAE: {sorted(unmapped)[:4]}")
    return "AutoencoderKLMochiGenmo", config, out


class _Reads(dict):
    """A state dict that records the keys read from it (to refuse one with weights the map would silently drop)."""

    def __init__(self, sd):
        super().__init__(sd)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


ROWS = [LayoutRow("Mochi VAE", "mochi", _is_mochi, _convert_mochi)]
