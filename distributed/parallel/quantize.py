"""Low-bit residual codes: the one quantiser of PatchRay's compressed exchanges (OTIL's blocks, displaced K/V and halos).

A compressed exchange sends ``fresh - base`` (``base``: what the receivers already hold) as low-bit codes with one
scale per row, and both sides then store ``base + dequantize(codes)``: the sender measures its next residual
against exactly what the receivers hold, so quantisation error never accumulates (error feedback, CompactFusion's
rule). For that to hold bit for bit, sender and receivers must run the *same* :func:`dequantize` on the same codes;
keeping one implementation here is what guarantees it.

Design decisions:

* **Rows with one float32 absmax scale each** (a row is a block of the flattened tensor: OTIL's latent sub-block,
  or ``group`` consecutive elements of a K/V or halo slot). A scale per row keeps a small residual next to a large
  one from being rounded to zero.
* **Symmetric mid-tread codes for 4 and 8 bits** (``q in [-qmax, qmax]``, ``qmax = 2^(b-1) - 1``, absmax scale:
  zero is exact, so an unchanged element stays unchanged). At 1 and 2 bits an absmax grid rounds most of a
  bell-shaped residual to zero (measured: 2-bit mid-tread codes gave a displaced DiT 1.8x the error of 1-bit sign
  codes), so the scale is the row's mean absolute value instead: **sign codes for 1 bit** (the least-squares scale
  for sign codes, as in binarised networks and CompactFusion's binary mode) and **the Lloyd-Max levels of a
  Gaussian for 2 bits** (a sign bit and a magnitude bit: +-0.57 or +-1.89 mean-abs, split at 1.23 mean-abs).
* **Packed little-end first**: ``8 / bits`` codes per byte, the first code in the low bits; the wire size is
  :func:`code_bytes` per row plus 4 bytes of scale.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["BITS", "quantize", "dequantize", "code_bytes", "row_bytes"]

#: the code widths :func:`quantize` accepts
BITS = (1, 2, 4, 8)


# 2-bit: the Lloyd-Max quantiser of a Gaussian (levels +-0.4528 and +-1.510 sigma, threshold 0.9816 sigma) in units
# of the row's mean absolute value (sigma * sqrt(2/pi) for a Gaussian)
_LM2_LEVELS = (0.4528 / 0.7979, 1.510 / 0.7979)
_LM2_THRESHOLD = 0.9816 / 0.7979


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of packed codes for a row of ``numel`` elements."""
    return math.ceil(numel * bits / 8)


def row_bytes(numel: int, bits: int) -> int:
    """Bytes on the wire for one row: its packed codes and its float32 scale."""
    return code_bytes(numel, bits) + 4


def _check(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS} (got {bits})")


def quantize(residual: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``residual[k, n]`` per row to ``bits``.

    Returns:
        ``(codes, scale)``: ``codes`` uint8 ``[k, code_bytes(n, bits)]``, ``scale`` float32 ``[k]``.
    """
    _check(bits)
    residual = residual.float()
    k, n = residual.shape
    if bits == 1:
        scale = residual.abs().mean(dim=1)
        q = (residual >= 0).to(torch.uint8)
    elif bits == 2:
        scale = residual.abs().mean(dim=1)
        big = residual.abs() > _LM2_THRESHOLD * scale.unsqueeze(1)
        q = ((residual >= 0).to(torch.uint8) | (big.to(torch.uint8) << 1))
    else:
        qmax = (1 << (bits - 1)) - 1
        scale = residual.abs().amax(dim=1).clamp_min(1e-12) / qmax
        q = (torch.round(residual / scale.unsqueeze(1)).clamp(-qmax, qmax).to(torch.int16) + qmax).to(torch.uint8)
    per = 8 // bits
    if per == 1:
        return q.contiguous(), scale.contiguous()
    pad = (-n) % per
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.view(k, -1, per)
    shifts = torch.arange(per, device=q.device, dtype=torch.uint8) * bits
    packed = (q << shifts).sum(dim=2, dtype=torch.int32).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The float32 residual ``[k, numel]`` that ``codes`` and ``scale`` (from :func:`quantize`) stand for."""
    _check(bits)
    k = codes.shape[0]
    per = 8 // bits
    if per > 1:
        shifts = torch.arange(per, device=codes.device, dtype=torch.uint8) * bits
        q = ((codes.unsqueeze(2) >> shifts) & ((1 << bits) - 1)).reshape(k, -1)[:, :numel]
    else:
        q = codes[:, :numel]
    if bits == 1:
        return (q.to(torch.float32) * 2.0 - 1.0) * scale.unsqueeze(1)
    if bits == 2:
        sign = (q & 1).to(torch.float32) * 2.0 - 1.0
        level = torch.where((q >> 1).bool(), _LM2_LEVELS[1], _LM2_LEVELS[0])
        return sign * level * scale.unsqueeze(1)
    qmax = (1 << (bits - 1)) - 1
    return (q.to(torch.float32) - qmax) * scale.unsqueeze(1)
