"""Sequence parallelism of ComfyUI's DiT classes: the lookups over the family table (:mod:`.families`).

The rows with a token layout (:data:`ROWS`) are what ``parallelism=sequence`` covers; a class without one is refused
by name, before anything is shipped, with its row's reason (:data:`KNOWN_UNCOVERED`) or what a row would need
(:func:`refusal`). Per call and per conditioning, a row's refusals are checked here too (:func:`call_refusal`,
:func:`cond_refusal`), and the token grid and the text a call shards are read from the row (:func:`token_grid`,
:func:`text_tokens`). The rank side (:mod:`.dit_rank`) applies the row.

This module imports no ComfyUI: the lookups and the refusals are tested in CI.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from .families import FAMILIES, NONE, PREFIX, SUFFIX, ModelFamily, Site, family_for

__all__ = ["Site", "ModelFamily", "ROWS", "KNOWN_UNCOVERED", "PREFIX", "SUFFIX", "NONE", "find_row", "refusal",
           "token_grid", "call_refusal", "cond_refusal", "text_tokens"]

#: the rows with a token layout: what sequence parallelism covers
ROWS: Tuple[ModelFamily, ...] = tuple(r for r in FAMILIES if r.sequence)

#: classes people load that PatchRay knows and does not shard by token sequence: why (their rows' ``refusal``)
KNOWN_UNCOVERED: Dict[str, str] = {c: r.refusal for r in FAMILIES if not r.sequence for c in r.classes}


def find_row(class_name: str) -> Optional[ModelFamily]:
    """The row serving ComfyUI diffusion-model class ``class_name`` by token sequence, or ``None``."""
    row = family_for(class_name)
    return row if row is not None and row.sequence else None


def refusal(class_name: str, module: str = "", family: str = "") -> str:
    """Why a class without a row cannot be sharded by sequence, in the user's terms, with what would be needed.
    ``family``: ComfyUI's name of the model (``SD3``, ``PixArtSigma``...), said first when it differs from the class."""
    where = f" ({module})" if module else ""
    owner = f"{family}'s diffusion model " if family and family != class_name else "the diffusion model "
    known = KNOWN_UNCOVERED.get(class_name)
    need = known or (
        "a row in PatchRay's family table naming where its image tokens are made, where its positional embedding is, "
        "where the tokens leave the last block, and which of its attentions are self/joint or cross"
    )
    row = family_for(class_name)
    blocks = ", and sharding=blocks splits its weights" if row is not None and row.blocks else ""
    return (
        f"PatchRay: sequence parallelism does not cover {owner}{class_name}{where} "
        f"yet ({need}). parallelism=cfg or batch work with every model{blocks}; the stock KSampler always does."
    )


def token_grid(row: ModelFamily, dm, latent_shape: Sequence[int]) -> Tuple[int, int, int]:
    """(frames, rows, cols) of image tokens for a latent ``[B, C, H, W]`` or ``[B, C, T, H, W]`` (padded to the patch,
    as the models pad before patchifying)."""
    pt, ph, pw = row.patch(dm)
    if len(latent_shape) == 4:
        t, (h, w) = 1, latent_shape[-2:]
    elif len(latent_shape) == 5:
        t, h, w = latent_shape[-3:]
    else:
        raise ValueError(f"latent_image: expected [B, C, H, W] or [B, C, T, H, W], got shape {tuple(latent_shape)}")
    return (math.ceil(t / pt), math.ceil(h / ph), math.ceil(w / pw))


def call_refusal(row: ModelFamily, arguments: Mapping[str, Any]) -> Optional[str]:
    """The reason a model call's arguments cannot be sharded by ``row`` (``None``: they can)."""
    extra = dict(arguments)
    extra.update(arguments.get("kwargs") or {})
    for key, why in row.call_refusals.items():
        if extra.get(key) is not None:
            return f"PatchRay ({row.family}, sequence): {why} is not supported yet; use parallelism=cfg or batch, or sample without PatchRay"
    return None


def text_tokens(row: ModelFamily, arguments: Mapping[str, Any], world_size: int) -> int:
    """The text tokens a model call shards over ``world_size`` sequence ranks (0: the text stays whole on every rank:
    a row without a text site, a call carrying one of the row's ``text_whole`` keywords, or fewer text tokens than
    ranks, where a rank's empty text slice would break the blocks' reshapes). Read from the call's ``context``
    ``[B, T, C]``, the same on every rank."""
    if row.text_tokens is None or world_size < 2:
        return 0
    extra = dict(arguments)
    extra.update(arguments.get("kwargs") or {})
    if any(extra.get(key) is not None for key in row.text_whole):
        return 0
    context = extra.get("context")
    if context is None or getattr(context, "dim", lambda: 0)() != 3:
        return 0
    total = int(context.shape[1])
    return total if total >= world_size else 0


def cond_refusal(row: ModelFamily, name: str, conditioning) -> Optional[str]:
    """The reason CONDITIONING ``name`` cannot be sharded by ``row`` (``None``: it can)."""
    for item in conditioning or []:
        extra = item[1] if isinstance(item, (list, tuple)) and len(item) > 1 and isinstance(item[1], dict) else {}
        for key, why in row.cond_refusals.items():
            if extra.get(key) is not None:
                return f"PatchRay ({row.family}, sequence): {why} in {name} is not supported yet; use parallelism=cfg or batch, or sample without PatchRay"
    return None
