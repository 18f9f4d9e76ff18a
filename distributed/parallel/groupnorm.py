"""Exact GroupNorm over a row-sharded tensor, in one collective per call.

Design decision: each rank reduces its band to per-(sample, group) ``(count, mean, M2)`` (in fp64: a handful
of numbers), one ``all_gather`` exchanges those ``3 x B x G`` numbers, and every rank merges them with Chan et
al.'s parallel update (``M2 = sum M2_r + sum n_r (mean_r - mean)^2``), which is exact up to rounding and does
not cancel catastrophically the way ``E[x^2] - E[x]^2`` does. The variance is the biased one ``nn.GroupNorm``
uses. Normalisation is one fused ``x * a + b`` with per-(sample, channel) coefficients. Low-precision inputs are
upcast to fp32 a few groups at a time (for the statistics and for the normalisation), so the result is as exact
as ``nn.GroupNorm``'s fp32-internal kernels without a whole-activation fp32 copy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..comm import all_gather_padded
from ..context import ParallelContext
from .plan import Applied, RowState, Style, set_forward

__all__ = ["group_stats", "merge_group_stats", "exact_group_norm", "ExactGroupNorm"]


#: low-precision inputs are upcast to fp32 in this many group chunks: the transient fp32 chunk is 1/8 of the
#: bf16 activation. In a resnet block the second norm runs while the block input, the conv output and the norm
#: output are alive (3 activations, the block's peak), so the chunk adds at most ~4% there
_LOW_PRECISION_CHUNKS = 16


def _group_chunks(num_groups: int, dtype: torch.dtype):
    if dtype in (torch.float32, torch.float64):
        return [(0, num_groups)]
    step = max(1, num_groups // _LOW_PRECISION_CHUNKS)
    return [(g, min(g + step, num_groups)) for g in range(0, num_groups, step)]


def group_stats(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """This rank's ``[3, B, G]`` fp64 stack of (count, mean, M2) over everything but the batch and the group.

    fp64 for the few numbers that travel: counts of video bands exceed fp32's 2**24 exact integers.
    """
    b = x.shape[0]
    xg = x.reshape(b, num_groups, -1)
    means, variances = [], []
    for start, stop in _group_chunks(num_groups, x.dtype):
        var, mean = torch.var_mean(xg[:, start:stop].float(), dim=-1, correction=0)
        means.append(mean)
        variances.append(var)
    mean, var = torch.cat(means, dim=1).double(), torch.cat(variances, dim=1).double()
    count = xg.shape[-1]
    return torch.stack([torch.full_like(mean, float(count)), mean, var * count])


def merge_group_stats(stats: torch.Tensor):
    """Chan's merge of ``[N, 3, B, G]`` per-rank stats; returns (mean, biased variance), each ``[B, G]``."""
    n, mean, m2 = stats[:, 0], stats[:, 1], stats[:, 2]
    total = n.sum(0)
    merged_mean = (n * mean).sum(0) / total
    merged_m2 = m2.sum(0) + (n * (mean - merged_mean) ** 2).sum(0)
    return merged_mean, merged_m2 / total


def exact_group_norm(x: torch.Tensor, norm: nn.GroupNorm, ctx: ParallelContext) -> torch.Tensor:
    """``norm(x_full)`` restricted to this rank's part ``x``: statistics over every rank's part.

    Works for any layout whose dim 0 is the batch and dim 1 the channels (``[B, C, *]``). Statistics and the
    normalisation run in fp32 (like ``nn.GroupNorm``'s kernels) whatever the input dtype.
    """
    b, c = x.shape[0], x.shape[1]
    g = norm.num_groups
    stats = group_stats(x, g)
    if ctx.world_size > 1:
        stats = all_gather_padded(stats.unsqueeze(0).contiguous(), ctx, 0, [1] * ctx.world_size)
    else:
        stats = stats.unsqueeze(0)
    mean, var = merge_group_stats(stats)
    mean, rstd = mean.float(), torch.rsqrt(var + norm.eps).float()
    # per (sample, channel): y = x * scale + shift, with the affine parameters folded in
    per_group = c // g
    scale = rstd.repeat_interleave(per_group, dim=1)
    shift = -mean.repeat_interleave(per_group, dim=1) * scale
    if norm.affine:
        shift = shift * norm.weight.float() + norm.bias.float()
        scale = scale * norm.weight.float()
    chunks = _group_chunks(g, x.dtype)
    if len(chunks) == 1:
        view = (b, c) + (1,) * (x.dim() - 2)
        return torch.addcmul(shift.view(view), x, scale.view(view)).to(x.dtype)
    x3 = x.reshape(b, c, -1)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    for start, stop in chunks:
        lo, hi = start * per_group, stop * per_group
        chunk = x3[:, lo:hi].float()  # one transient fp32 chunk, normalised in place
        out[:, lo:hi] = chunk.mul_(scale[:, lo:hi, None]).add_(shift[:, lo:hi, None])
    return out.view(x.shape)


@dataclasses.dataclass(frozen=True)
class ExactGroupNorm(Style):
    """``nn.GroupNorm`` with statistics over the whole (row-sharded) tensor."""

    def _apply(self, module, path, state: RowState):
        if module.num_channels % module.num_groups:
            raise NotImplementedError(f"{path}: num_channels={module.num_channels} not divisible by num_groups")

        def forward(x):
            return exact_group_norm(x, module, state.ctx)

        return Applied(set_forward(module, forward))
