"""The compressed exchange's codec as two fused Triton kernels (GPU ranks with Triton).

The same packing as :mod:`..parallel.quantize` and :func:`.comm_manager.encode_residual` (per group of
``GROUP`` elements: ``code_bytes`` of little-end-first codes, then the group's float32 scale), and the same
quantisers (4/8-bit absmax mid-tread codes, 2-bit Lloyd-Max levels and 1-bit sign codes on the mean absolute
value), in one pass each:

* :func:`encode` reads the fresh value and the reference once and writes the packed codes and scales: 4.5 bytes per
  bf16 element, where the op-by-op codec makes a dozen passes over float32 temporaries;
* :func:`apply` reads a row and a payload once and writes the row: the update every receiver runs on its copy of the
  sender's row, and the sender on its own reference, so their copies stay equal bit for bit.

Its arithmetic is not bit-identical to the op-by-op codec (the scale's sum order, rounding ties, fused multiply-add),
so a group runs one codec on every rank (:meth:`.comm_manager.CommManager.build_layout` agrees on it). Triton's
interpreter (``TRITON_INTERPRET=1``) runs these kernels on CPU tensors, which is how CI checks them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..parallel.quantize import _LM2_LEVELS, _LM2_THRESHOLD, code_bytes

__all__ = ["encode", "apply", "GROUPS_PER_PROGRAM"]

#: groups of elements one program handles (8 x 256 elements)
GROUPS_PER_PROGRAM = 8


@triton.jit
def _encode_kernel(fresh_ptr, ref_ptr, codes_ptr, scale_ptr, n_groups, threshold,
                   GROUP: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, NCODE: tl.constexpr,
                   ROW: tl.constexpr, GPP: tl.constexpr):
    pid = tl.program_id(0)
    g = pid * GPP + tl.arange(0, GPP)
    gmask = g < n_groups
    e = tl.arange(0, GROUP)
    offs = g[:, None] * GROUP + e[None, :]
    m = gmask[:, None]
    r = tl.load(fresh_ptr + offs, mask=m, other=0.0).to(tl.float32) - tl.load(ref_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if BITS <= 2:
        scale = tl.sum(tl.abs(r), axis=1) / GROUP
        q = (r >= 0).to(tl.int32)
        if BITS == 2:
            q = q | ((tl.abs(r) > threshold * scale[:, None]).to(tl.int32) << 1)
    else:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        scale = tl.maximum(tl.max(tl.abs(r), axis=1), 1e-12) / QMAX
        x = r / scale[:, None]
        x = tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))  # round half away from zero
        q = tl.minimum(tl.maximum(x, -QMAX), QMAX).to(tl.int32) + QMAX
    if PER > 1:
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(tl.reshape(q, (GPP, NCODE, PER)) << shifts[None, None, :], axis=2)
    else:
        packed = q
    tl.store(codes_ptr + g[:, None] * ROW + tl.arange(0, NCODE)[None, :], packed.to(tl.uint8), mask=m)
    tl.store(scale_ptr + g * (ROW // 4) + NCODE // 4, scale, mask=gmask)


@triton.jit
def _apply_kernel(row_ptr, codes_ptr, scale_ptr, n_groups, level0, level1,
                  GROUP: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, NCODE: tl.constexpr,
                  ROW: tl.constexpr, GPP: tl.constexpr):
    pid = tl.program_id(0)
    g = pid * GPP + tl.arange(0, GPP)
    gmask = g < n_groups
    e = tl.arange(0, GROUP)
    m = gmask[:, None]
    b = tl.load(codes_ptr + g[:, None] * ROW + (e // PER)[None, :], mask=m, other=0).to(tl.int32)
    q = (b >> ((e % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    scale = tl.load(scale_ptr + g * (ROW // 4) + NCODE // 4, mask=gmask, other=0.0)[:, None]
    if BITS == 1:
        deq = (q * 2 - 1).to(tl.float32) * scale
    elif BITS == 2:
        sign = ((q & 1) * 2 - 1).to(tl.float32)
        deq = sign * tl.where((q >> 1) != 0, level1, level0) * scale
    else:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        deq = (q - QMAX).to(tl.float32) * scale
    offs = g[:, None] * GROUP + e[None, :]
    row = tl.load(row_ptr + offs, mask=m, other=0.0)
    tl.store(row_ptr + offs, (row.to(tl.float32) + deq).to(row.dtype), mask=m)


def _meta(numel: int, bits: int, group: int):
    if numel % group:
        raise ValueError(f"the codec takes whole groups of {group} elements (got {numel})")
    ncode = code_bytes(group, bits)
    return numel // group, ncode, ncode + 4


def encode(fresh: torch.Tensor, ref: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The packed bytes of ``fresh - ref`` (both flat and contiguous, whole groups): per group its codes, then its
    float32 scale. ``ref`` is not changed (the caller applies the payload to it with :func:`apply`)."""
    n_groups, ncode, row = _meta(fresh.numel(), bits, group)
    payload = torch.empty(n_groups * row, dtype=torch.uint8, device=fresh.device)
    if n_groups:
        grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
        _encode_kernel[grid](fresh, ref, payload, payload.view(torch.float32), n_groups, float(_LM2_THRESHOLD),
                             GROUP=group, BITS=bits, PER=8 // bits, NCODE=ncode, ROW=row, GPP=GROUPS_PER_PROGRAM)
    return payload


def apply(row: torch.Tensor, payload: torch.Tensor, bits: int, group: int) -> None:
    """Add the residual ``payload`` packs (from :func:`encode`) to ``row`` (flat, contiguous) in place."""
    n_groups, ncode, width = _meta(row.numel(), bits, group)
    if payload.numel() != n_groups * width:
        raise ValueError(f"payload of {payload.numel()} bytes for {n_groups} groups of {width}")
    if n_groups:
        grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
        _apply_kernel[grid](row, payload, payload.view(torch.float32), n_groups, float(_LM2_LEVELS[0]),
                            float(_LM2_LEVELS[1]), GROUP=group, BITS=bits, PER=8 // bits, NCODE=ncode, ROW=width,
                            GPP=GROUPS_PER_PROGRAM)
