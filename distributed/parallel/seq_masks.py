"""Attention masks of sequence-parallel attention: a caller's key mask re-expressed for the keys one rank sees.

:class:`~.seq_attention.SequenceAttention` uses the gathered keys in rank-major order; a mask given over the full key
sequence is permuted the same way, a mask over the rank's local keys (a model that builds it from its local length)
is expanded, and with sharded text a padding mask is replaced by the whole text's validity over every rank's keys
(``SequenceState.key_valid``). See ``sequence.py`` for the design.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__: list = []


def _mask_id(mask: torch.Tensor) -> Optional[tuple]:
    if mask.is_inference():  # no version counter (ComfyUI samples under inference_mode): checked on every call
        return None
    return (mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), mask._version)


def _valid_mask(valid: torch.Tensor, mask: torch.Tensor, path: str) -> torch.Tensor:
    """The key mask of a padded text over the whole joint sequence (global order, ``[B, 1, 1, L]``) in the dtype of
    the model's own ``mask`` (bool, or additive float), which it replaces: a rank's mask covers its own text slice
    only. Image keys are always valid, so no query's keys are all masked."""
    if mask.dim() != 4 or mask.shape[0] not in (1, valid.shape[0]) or mask.shape[-2] != 1:
        raise NotImplementedError(f"{path}: a text padding mask of shape {tuple(mask.shape)} with sharded text (a key "
                                  f"mask [batch, 1, 1, keys] is supported)")
    m = valid.to(mask.device)[:, None, None, :]
    if mask.dtype == torch.bool:
        return m
    return torch.zeros(m.shape, dtype=mask.dtype, device=mask.device).masked_fill(~m, torch.finfo(mask.dtype).min)


def _key_mask(mask: Optional[torch.Tensor], lk_local: int, lk_full: int, before: int, after: int, n_total: int,
              order: torch.Tensor, path: str, checked: Optional[dict] = None) -> Optional[torch.Tensor]:
    """The caller's mask over keys, re-expressed for the keys ``[before, image tokens rank-major, after]``.

    A mask over the full key sequence (global order) has its image columns permuted like the keys. A mask over this
    rank's local keys (a model that builds it from the local sequence length, as HunyuanVideo does) must treat
    every image key alike (padding masks only ever mask replicated text tokens): its first image column stands for
    all of them. With sharded text the "image tokens" here are the rank's whole joint sequence (``n_total`` and
    ``order`` of the joint part): a local mask must then treat every local key alike; a text padding mask is laid
    over the whole joint sequence beforehand (:func:`_valid_mask`, from ``SequenceState.key_valid``).
    """
    if mask is None:
        return None
    cols = mask.shape[-1]
    if cols == lk_full and lk_full != lk_local:
        idx = torch.cat([torch.arange(before, device=mask.device), before + order.to(mask.device),
                         torch.arange(before + n_total, lk_full, device=mask.device)])
        return mask.index_select(-1, idx)
    if cols == lk_local:
        n_local = lk_local - before - after
        img = mask.narrow(-1, before, n_local)
        mask_id = _mask_id(mask)
        if n_local and checked is not None and (mask_id is None or checked.get("mask") != mask_id):
            uniform = bool((img == img.narrow(-1, 0, 1)).all())
            if uniform and mask_id is not None:
                checked["mask"] = mask_id  # models pass one mask tensor to every block: check it once
        else:
            uniform = True
        if not uniform:
            # backstop: no supported family masks image keys; the check depends on the mask every rank builds alike
            raise NotImplementedError(f"{path}: an attention mask that differs between image keys is not supported")
        rep = img.narrow(-1, 0, 1).expand(*img.shape[:-1], n_total) if n_local else img.new_zeros((*img.shape[:-1], n_total))
        return torch.cat([mask.narrow(-1, 0, before), rep, mask.narrow(-1, before + n_local, after)], dim=-1)
    if cols == 1:
        return mask
    raise NotImplementedError(f"{path}: attention mask with {cols} key columns for {lk_local} local keys ({lk_full} in all)")
