"""ComfyUI's VAE weights -> the diffusers model PatchRay shards (family, diffusers config, diffusers state dict).

Design decision: PatchRay shards *diffusers* VAE modules (one adapter code path, tested in CI without ComfyUI), so
the decode/encode nodes rebuild ComfyUI's VAE as the diffusers model. This package holds the ComfyUI knowledge of
that step, so ``distributed/`` holds none: the key layout of the state dict ComfyUI keeps
(``vae.first_stage_model.state_dict()``, the original released layout, because ``comfy.sd.VAE`` converts
diffusers files *to* that layout on load), how ComfyUI tells VAE families apart (``comfy.sd.VAE.__init__``) and
ComfyUI's fixed GroupNorm width. It never imports ComfyUI: it reads a plain state dict.

**One table.** :data:`LAYOUTS` is an ordered list of :class:`LayoutRow` (one per VAE layout ComfyUI loads, most
specific first); the first row whose ``match`` accepts the state dict converts it. A VAE class added to a newer
ComfyUI needs a row (a match and a conversion) in the module of its family, not new machinery.

Every conversion is *checked* by the library (:func:`patchray.distributed.vae.convert.check_state_dict`): the
converted keys and shapes must equal those of the diffusers model built from the inferred config. A state dict that
does not match raises ``UnsupportedVaeError`` naming the first differences, instead of producing a model with
silently missing weights. A layout no row matches raises ``UnsupportedVaeError`` with the reason; the decode node
then falls back to ComfyUI's own decode and says so.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ....distributed.vae.convert import UnsupportedVaeError, check_state_dict
from .table import ConvertedVae, LayoutRow
from . import cosmos, hunyuan, kl, ltx, mochi, other, wan

__all__ = ["ConvertedVae", "LayoutRow", "LAYOUTS", "UnsupportedVaeError", "detect_family", "convert_comfy_vae", "latent_layout"]

#: the ordered table: most specific layouts first (a row may also *refuse* a layout with the reason)
LAYOUTS = [*wan.ROWS, *mochi.ROWS, *cosmos.ROWS, *hunyuan.ROWS, *ltx.ROWS, *kl.ROWS, *other.ROWS]


def _row_for(sd: Mapping[str, torch.Tensor]) -> LayoutRow:
    if not sd:
        raise UnsupportedVaeError("the VAE has no weights (pixel-space or empty VAE): nothing to shard")
    for row in LAYOUTS:
        if row.match(sd):
            return row
    raise UnsupportedVaeError(
        "unrecognised VAE layout (PatchRay covers: " + ", ".join(r.name for r in LAYOUTS if r.family) + "); first keys: "
        + ", ".join(sorted(sd)[:4])
    )


def detect_family(sd: Mapping[str, torch.Tensor]) -> str:
    """Name the PatchRay family of a ComfyUI VAE state dict, or raise :class:`UnsupportedVaeError` with the reason."""
    row = _row_for(sd)
    if row.family is None:
        raise UnsupportedVaeError(row.refusal)
    return row.family


def convert_comfy_vae(sd: Mapping[str, torch.Tensor], norm_num_groups: int = kl.COMFY_KL_GROUPS) -> ConvertedVae:
    """Convert a ComfyUI VAE state dict to the diffusers model PatchRay shards.

    Args:
        sd: ``vae.first_stage_model.state_dict()`` of a ``comfy.sd.VAE`` (released key layout).
        norm_num_groups: GroupNorm groups of KL VAEs (weights do not record it; ComfyUI always uses 32).

    Returns:
        :class:`ConvertedVae` ``(family, diffusers_class, config, state_dict)``; the tensors are the input's.

    Raises:
        UnsupportedVaeError: no row covers the layout, or the converted weights do not fit the model.

    Example:
        >>> conv = convert_comfy_vae(vae.first_stage_model.state_dict())  # doctest: +SKIP
        >>> model = diffusers.AutoencoderKL(**conv.config); model.load_state_dict(conv.state_dict)  # doctest: +SKIP
    """
    row = _row_for(sd)
    if row.family is None:
        raise UnsupportedVaeError(row.refusal)
    class_name, config, new = row.convert(sd, norm_num_groups=norm_num_groups)
    check_state_dict(class_name, config, new)
    return ConvertedVae(row.family, class_name, config, new)


def latent_layout(family: str):
    """The ``latents`` of the row converting to ``family``: how ComfyUI's LATENT / IMAGE differ from the diffusers
    model's (``None``: they do not)."""
    for row in LAYOUTS:
        if row.family == family and row.latents is not None:
            return row.latents
    return None


def encode_frame_step(family: str) -> int:
    """The frame step of the row converting to ``family`` (:class:`LayoutRow`): ComfyUI encodes only 1 + k x step frames."""
    return max((row.encode_frame_step for row in LAYOUTS if row.family == family), default=1)
