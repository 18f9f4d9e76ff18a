"""The row type of the ComfyUI VAE layout table (:data:`..vae_layouts.LAYOUTS`) and shared helpers."""

from __future__ import annotations

import re
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

__all__ = ["ConvertedVae", "LayoutRow", "indices", "refuse"]


class ConvertedVae(NamedTuple):
    """Result of ``convert_comfy_vae``.

    Args:
        family: the PatchRay family key, a key of ``distributed.vae.families.FAMILIES``.
        diffusers_class: the diffusers class name the config is for.
        config: keyword arguments for ``diffusers_class(**config)``.
        state_dict: the diffusers-layout state dict (tensors shared with the input where no reshape is needed).
    """

    family: str
    diffusers_class: str
    config: dict
    state_dict: Dict[str, torch.Tensor]


class LayoutRow(NamedTuple):
    """One VAE layout ComfyUI loads.

    Args:
        name: what users call it ("Wan 2.1 VAE", "FLUX.1 ae / SD / SDXL VAE"), shown in messages.
        family: the PatchRay family it converts to, or ``None`` for a row that refuses the layout.
        match: ``match(sd) -> bool``: does this state dict have this layout (follows ``comfy.sd.VAE.__init__``).
        convert: ``convert(sd, *, norm_num_groups) -> (diffusers_class, config, diffusers_state_dict)``; raises
            ``UnsupportedVaeError`` with the reason for a variant it cannot map. ``None`` for refusing rows.
        refusal: for refusing rows, the reason shown on the node.
        latents: how ComfyUI's LATENT / IMAGE for this layout differ from the diffusers model's (an object with
            ``to_library``, ``from_library`` and ``images_are_batch``, e.g. ``hunyuan.LatentLayout``); ``None``:
            the latent passes through and IMAGE batches of a 5-D VAE are the frames of one clip.
        encode_frame_step: ComfyUI's encoder of this layout takes only 1 + k x this many frames and raises for any
            other count (LTX-Video: 8); 1: any count.
    """

    name: str
    family: Optional[str]
    match: Callable[[Mapping[str, torch.Tensor]], bool]
    convert: Optional[Callable[..., Tuple[str, dict, dict]]] = None
    refusal: str = ""
    latents: Optional[object] = None
    encode_frame_step: int = 1


def indices(sd: Mapping[str, torch.Tensor], pattern: str) -> list:
    """The sorted distinct integers captured by group 1 of ``pattern`` over the keys of ``sd``."""
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in sd for m in [rx.match(k)] if m})


def refuse(name: str, match: Callable[[Mapping[str, torch.Tensor]], bool], reason: str) -> LayoutRow:
    """A row that recognises a layout PatchRay does not shard, with the reason shown on the node."""
    return LayoutRow(name, None, match, None, reason)
