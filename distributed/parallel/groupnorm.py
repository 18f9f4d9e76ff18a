"""GroupNorm over a sharded tensor: one adapter, :class:`ShardedGroupNorm`, whose statistics mode is a strategy.

Modes (strategies): :class:`ExactStats` (row mode: whole-tensor statistics in one collective), the stepwise
sampling modes :class:`SyncStats`, :class:`StaleStats`, :class:`CorrectedStats` and :class:`SeparateStats`
(below), and ``ImageWideStats`` for tiles (``imagewide.py``: statistics over every tile's core, collected in
passes). The sampling and tile modes merge per-part (count, mean, M2) with Chan et al.'s parallel update and use
:func:`group_chunks` to bound fp32 temporaries of low-precision activations.

Exact mode (:func:`exact_group_norm_coefficients`): each rank reduces its band in one fused fp32 pass to
per-(sample, group) moments and turns them into fp64 power sums ``(count, sum x, sum x^2)`` (:func:`group_sums`:
a handful of numbers), and one in-place ``all_reduce`` adds them over the ranks. The merged variance
``E[x^2] - mean^2`` is formed in fp64 from sums that keep every digit of the fp32 moments, so it stays as exact as
Chan's update of per-rank ``(count, mean, M2)`` (still used by the sampling modes and :func:`merge_group_stats`)
for any activation whose mean is not ~10^4 standard deviations from zero, with a dozen small operations instead
of forty (each is a kernel launch on a GPU). The variance is the biased one ``nn.GroupNorm`` uses.
Normalisation is one fused ``x * a + b`` with per-(sample, channel) fp32 coefficients (batch norm's elementwise
kernel for low-precision inputs), as exact as ``nn.GroupNorm``'s fp32-internal kernels without an fp32 copy of
the activation.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..comm import all_gather_padded, all_reduce
from ..context import ParallelContext
from .exchange import StepState
from .plan import Applied, Style, replace_forward

__all__ = [
    "group_chunks",
    "group_stats",
    "merge_group_stats",
    "group_sums",
    "exact_group_norm",
    "exact_group_norm_coefficients",
    "normalize_with",
    "ShardedGroupNorm",
    "GroupNormStats",
    "ExactStats",
    "SyncStats",
    "StaleStats",
    "CorrectedStats",
    "SeparateStats",
]


#: low-precision inputs are upcast to fp32 in this many group chunks: the transient fp32 chunk is 1/8 of the
#: bf16 activation. In a resnet block the second norm runs while the block input, the conv output and the norm
#: output are alive (3 activations, the block's peak), so the chunk adds at most ~4% there
_LOW_PRECISION_CHUNKS = 16


def group_chunks(num_groups: int, pieces: int):
    """``[(start, stop), ...]`` group ranges of about ``num_groups / pieces`` groups (at least one each).

    Where fp32 temporaries are made of a low-precision (or non-contiguous) activation, a few groups at a time
    keep the transient copy a fraction of the activation.
    """
    step = max(1, num_groups // pieces)
    return [(g, min(g + step, num_groups)) for g in range(0, num_groups, step)]


def _group_chunks(num_groups: int, dtype: torch.dtype):
    full_precision = dtype in (torch.float32, torch.float64)
    return group_chunks(num_groups, 1 if full_precision else _LOW_PRECISION_CHUNKS)


def group_stats(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """This rank's ``[3, B, G]`` fp64 stack of (count, mean, M2) over everything but the batch and the group.

    fp64 for the few numbers that travel: counts of video bands exceed fp32's 2**24 exact integers.

    One fused pass over the activation, accumulated in fp32 whatever its dtype, with no fp32 copy of it:

    * CPU: the native GroupNorm kernel (``native_group_norm`` with ``eps = 0`` returns the biased mean and
      ``1 / sqrt(var)`` per (sample, group); fp32 affine parameters make it return fp32 moments for a
      low-precision input). Measured 9x faster than ``torch.var_mean`` on a CPU core (3.1 vs 27.2 ms on a
      [1, 128, 128, 256] fp32 band), variance within 2e-7 relative of an fp64 reference. Its normalised output is
      discarded; it is transient, as large as the output the caller makes next.
    * CUDA: the native GroupNorm kernel refuses fp32 affine parameters with a low-precision input ("expected
      scalar type BFloat16 but found Float", seen on an H200) and would return bf16 moments without them, so
      the per-channel Welford moments of SyncBatchNorm's kernel (``torch.batch_norm_stats``: fp32 mean and
      ``1 / sqrt(var)`` per channel, no output written) are merged into groups here with Chan's formula. It
      reads the activation once with ``B * C`` blocks (the GroupNorm kernel uses ``B * G``), where the earlier
      path upcast sixteen group chunks to fp32 (a copy and a reduction each: 32 launches and three times the
      bytes).
    """
    b = x.shape[0]
    c = x.shape[1]
    fused = x.numel() and c % num_groups == 0 and x.is_contiguous()
    if fused and x.device.type == "cuda":
        per_channel = x.numel() // (b * c)
        mean_c, invstd_c = torch.batch_norm_stats(x.view(1, b * c, per_channel), 0.0)
        cpg = c // num_groups
        mean_c = mean_c.double().view(b, num_groups, cpg)
        var_c = invstd_c.double().view(b, num_groups, cpg).pow(-2)  # invstd = inf (a constant channel): var 0
        mean = mean_c.mean(-1)
        m2 = (var_c.sum(-1) + (mean_c - mean.unsqueeze(-1)).pow(2).sum(-1)) * per_channel
        return torch.stack([torch.full_like(mean, float(per_channel * cpg)), mean, m2])
    if fused and x.device.type == "cpu":
        count = x.numel() // (b * num_groups)
        weight = bias = None
        if x.dtype not in (torch.float32, torch.float64):
            # fp32 affine parameters make the kernel return fp32 moments for a low-precision input
            weight = torch.ones(c, dtype=torch.float32, device=x.device)
            bias = torch.zeros(c, dtype=torch.float32, device=x.device)
        _, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, b, c, x.numel() // (b * c), num_groups, 0.0)
        mean = mean.double().reshape(b, num_groups)
        var = rstd.double().reshape(b, num_groups).pow(-2)  # rstd = inf (a constant group) gives var = 0
        return torch.stack([torch.full_like(mean, float(count)), mean, var * count])
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
    scale, shift = exact_group_norm_coefficients(x, norm, ctx)
    return normalize_with(x, scale, shift, norm.num_groups)


def group_sums(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """This rank's ``[B, G, 3]`` fp64 power sums ``(count, sum x, sum x^2)`` per (sample, group).

    Sums add across ranks, so the whole tensor's statistics are ONE in-place ``all_reduce`` of this tensor (the
    exact row mode), with no per-rank stacking, padding or merge. They come from the fused fp32 moments of
    :func:`group_stats` (per channel on CUDA, per group on CPU) turned into sums in fp64: ``sum x^2 =
    n (var + mean^2)`` keeps every digit of the fp32 moments, and the merged variance ``E[x^2] - mean^2`` in fp64
    loses only ``1e-16 * mean^2 / var`` relative, far below the fp32 moments' own rounding for any activation
    whose mean is not 10^4 standard deviations from zero. A dozen small operations per call instead of the
    forty of the gather-and-merge form: on a GPU each is a launch, and band-sized GroupNorms are launch-bound.
    """
    b, c = x.shape[0], x.shape[1]
    if not (x.numel() and c % num_groups == 0 and x.is_contiguous()) or x.device.type not in ("cuda", "cpu"):
        stats = group_stats(x, num_groups)  # [3, B, G]: count, mean, M2
        count, mean = stats[0], stats[1]
        return torch.stack([count, mean * count, stats[2] + mean * mean * count], dim=-1)
    per_channel = x.numel() // (b * c)
    if x.device.type == "cuda":
        # per-channel Welford moments (SyncBatchNorm's kernel: B * C blocks, fp32, no output), summed per group
        cpg = c // num_groups
        mean_c, invstd_c = torch.batch_norm_stats(x.view(1, b * c, per_channel), 0.0)
        mean = mean_c.view(b, num_groups, cpg).double()
        ex2 = invstd_c.view(b, num_groups, cpg).double().pow_(-2).addcmul_(mean, mean)  # inf rstd: var 0
        return torch.stack([torch.ones_like(mean), mean, ex2], dim=-1).sum(2).mul_(per_channel)
    weight, bias = _unit_affine(c, x)
    _, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, b, c, per_channel, num_groups, 0.0)
    mean = mean.view(b, num_groups).double()
    ex2 = rstd.view(b, num_groups).double().pow_(-2).addcmul_(mean, mean)  # rstd = inf (a constant group): var 0
    return torch.stack([torch.ones_like(mean), mean, ex2], dim=-1).mul_(per_channel * (c // num_groups))


_UNIT = {}


def _unit_affine(c: int, x: torch.Tensor):
    """fp32 ones and zeros of length ``c`` on ``x``'s device (cached), or ``(None, None)`` for fp32/fp64 ``x``."""
    if x.dtype in (torch.float32, torch.float64):
        return None, None
    key = (c, x.device)
    unit = _UNIT.get(key)
    if unit is None:
        if len(_UNIT) > 64:
            _UNIT.clear()
        unit = _UNIT[key] = (torch.ones(c, dtype=torch.float32, device=x.device),
                             torch.zeros(c, dtype=torch.float32, device=x.device))
    return unit


def exact_group_norm_coefficients(x: torch.Tensor, norm: nn.GroupNorm, ctx: ParallelContext):
    """The per-(sample, channel) fp32 ``(scale, shift)`` of ``norm`` over every rank's part (one all-reduce).

    ``norm(x_full) = x * scale + shift`` with the affine parameters folded in; a caller that also holds rows of a
    neighbour's part (a halo) normalises them with the same coefficients (:func:`normalize_with`).
    """
    b, c = x.shape[0], x.shape[1]
    g = norm.num_groups
    sums = group_sums(x, g)
    if ctx.world_size > 1:
        all_reduce(sums, ctx)
    moments = sums[..., 1:] / sums[..., :1]  # [B, G, 2]: mean, E[x^2]
    mean, ex2 = moments[..., :1], moments[..., 1:]
    rstd = torch.addcmul(ex2, mean, mean, value=-1).clamp_min_(0).add_(norm.eps).rsqrt_()
    # per (sample, channel): y = x * scale + shift, with the affine parameters folded in; formed in fp64 on the
    # [B, G, C/G] grid and rounded once to fp32
    if norm.affine:
        scale = rstd * norm.weight.view(1, g, c // g)
        shift = torch.addcmul(norm.bias.view(1, g, c // g).double(), mean, scale, value=-1)
    else:
        scale = rstd.expand(b, g, c // g)
        shift = -mean * scale
    coefficients = torch.stack([scale, shift]).float().view(2, b, c)
    return coefficients[0], coefficients[1]


#: whether CUDA's batch-norm kernel took a low-precision input with fp32 coefficients (set by the first call; a
#: build that refused would fall back to the chunked path for the rest of the process, on every rank alike)
_CUDA_MIXED_BATCH_NORM = {"ok": True}


def normalize_with(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``x * scale + shift`` per (sample, channel) in fp32, returned in ``x``'s dtype.

    A low-precision input goes through batch norm in inference mode with mean 0, variance 1 and eps 0, which is
    exactly ``x * weight + bias`` computed in fp32 by one fused kernel with no fp32 copy of the activation (the
    earlier path upcast it in sixteen group chunks: 4 kernels and an fp32 chunk each, 64 launches per call on
    CUDA, which made band-sized GroupNorms launch-bound). Identical results to the chunked path on CPU bf16; eps 0
    keeps cuDNN out (it requires eps >= 1e-5), so the native kernel runs, on CUDA too (its elementwise kernel
    takes a bf16/fp16 input with fp32 parameters).
    """
    b, c = x.shape[0], x.shape[1]
    per_group = c // num_groups
    chunks = _group_chunks(num_groups, x.dtype)
    if len(chunks) == 1:
        view = (b, c) + (1,) * (x.dim() - 2)
        out = torch.addcmul(shift.view(view), x, scale.view(view))
        return out if out.dtype == x.dtype else out.to(x.dtype)
    if x.is_contiguous() and (x.device.type == "cpu" or _CUDA_MIXED_BATCH_NORM["ok"]):
        bc = b * c
        ones, zeros = _unit_affine(bc, x)  # running variance 1 and mean 0
        try:
            out = torch.batch_norm(x.view(1, bc, -1), scale.reshape(bc), shift.reshape(bc), zeros, ones, False,
                                   0.0, 0.0, torch.backends.cudnn.enabled)
            return out.view(x.shape)
        except RuntimeError:
            if x.device.type == "cpu":
                raise
            _CUDA_MIXED_BATCH_NORM["ok"] = False  # this build refuses mixed dtypes: the chunked path below
    x3 = x.reshape(b, c, -1)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    for start, stop in chunks:
        lo, hi = start * per_group, stop * per_group
        chunk = x3[:, lo:hi].float()  # one transient fp32 chunk, normalised in place
        out[:, lo:hi] = chunk.mul_(scale[:, lo:hi, None]).add_(shift[:, lo:hi, None])
    return out.view(x.shape)


# ------------------------------------------------------------------------------------------- the adapter


@dataclasses.dataclass(frozen=True)
class GroupNormStats:
    """A statistics mode: ``normalize`` is the adapted module's forward (``prior`` is the forward it replaced,
    ``memo`` a per-module dict the mode may cache in)."""

    def normalize(self, x, module, path, state, prior, memo) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedGroupNorm(Style):
    """``nn.GroupNorm`` (or a subclass) on a band, tile or shard, normalized with the statistics ``stats`` forms.

    Args:
        stats: the statistics mode; default :class:`ExactStats` (row mode).
    """

    stats: GroupNormStats = dataclasses.field(default_factory=lambda: ExactStats())

    def _apply(self, module, path, state):
        if module.num_channels % module.num_groups:
            raise NotImplementedError(f"{path}: num_channels={module.num_channels} not divisible by num_groups")
        stats, memo = self.stats, {}

        def build(prior):
            def forward(x):
                return stats.normalize(x, module, path, state, prior, memo)

            return forward

        return Applied(replace_forward(module, path, build))


@dataclasses.dataclass(frozen=True)
class ExactStats(GroupNormStats):
    """Statistics over the whole (row-sharded) tensor in one all-gather (:func:`exact_group_norm`)."""

    def normalize(self, x, module, path, state, prior, memo):
        if state.ctx.world_size == 1:
            return prior(x)  # one rank holds the whole tensor: the module's own kernel
        return exact_group_norm(x, module, state.ctx)


# ------------------------------------------------------------------------------------ stepwise sampling


def _merge_chan(stats: torch.Tensor, counts: torch.Tensor):
    """Merge per-rank (mean, M2) ``stats[N, B, G, 2]`` with element counts ``counts[N]`` into (mean, biased var)."""
    w = counts.view(-1, 1, 1)
    total = counts.sum()
    mean = (stats[..., 0] * w).sum(0) / total
    m2 = stats[..., 1].sum(0) + (w * (stats[..., 0] - mean.unsqueeze(0)) ** 2).sum(0)
    return mean, m2 / total


@dataclasses.dataclass(frozen=True)
class SyncStats(GroupNormStats):
    """Stepwise sampling, statistics over the whole image at every step: one all-gather of each rank's fp32
    ``(mean, M2)`` per group, merged exactly with Chan's formula (no ``E[x^2] - E[x]^2`` cancellation, biased
    variance like ``nn.GroupNorm``). The subclasses differ on asynchronous steps only; synchronous steps (warm-up,
    refresh) always take this path, and those of the recording modes fill the stale memory.
    """

    #: whether synchronous steps keep every rank's statistics in the stale memory (the modes that read it)
    records = False

    def normalize(self, x, module, path, state: StepState, prior, memo):
        if not state.exchanging:
            return prior(x)
        if not state.sync and self._local_only():
            return prior(x)
        ctx = state.ctx
        b, g = x.shape[0], module.num_groups
        xf = x.float().reshape(b, g, -1)
        n_local = xf.shape[-1]
        mean = xf.mean(-1)
        m2 = (xf - mean.unsqueeze(-1)).pow(2).sum(-1)
        fresh = torch.stack([mean, m2], -1)  # (B, G, 2) fp32
        ckey = (n_local, state.rows, x.device)
        counts = memo.get(ckey)
        if counts is None:  # built once per shape: a host-to-device copy every call would be a sync point
            counts = memo[ckey] = torch.tensor(state.scaled(n_local), dtype=torch.float32, device=x.device)
        if state.sync or not self.records:
            gathered = all_gather_padded(fresh.unsqueeze(0), ctx, dim=0, sizes=[1] * ctx.world_size)
            state.traffic.add("groupnorm", fresh.numel() * 4 * (ctx.world_size - 1), collectives=1)
            if self.records:
                sid = state.cm.register(path, "groupnorm", fresh.shape, fresh, None, streamed=True)
                for r in range(ctx.world_size):
                    state.cm.view(sid, r).copy_(gathered[r])
            gmean, gvar = _merge_chan(gathered, counts)
        else:
            sid = state.cm.register(path, "groupnorm", fresh.shape, fresh, None, streamed=True)  # lookup
            stale = torch.stack([state.cm.view(sid, r) for r in range(ctx.world_size)])
            gmean, gvar = self._from_stale(stale, fresh, mean, m2, n_local, counts, ctx.rank)
            state.cm.enqueue(sid, fresh)
        y = (xf - gmean.unsqueeze(-1)) * torch.rsqrt(gvar.unsqueeze(-1) + module.eps)
        y = y.reshape(x.shape).to(x.dtype)
        if module.affine:
            shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
            y = y * module.weight.to(y.dtype).view(shape) + module.bias.to(y.dtype).view(shape)
        return y

    def _local_only(self) -> bool:
        return False

    def _from_stale(self, stale, fresh, mean, m2, n_local, counts, me):  # pragma: no cover - recording modes only
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class SeparateStats(SyncStats):
    """Asynchronous steps normalize with this rank's own (local) statistics: the module's own forward."""

    def _local_only(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class StaleStats(SyncStats):
    """Asynchronous steps merge the peers' statistics of the previous step with this rank's fresh ones."""

    records = True

    def _from_stale(self, stale, fresh, mean, m2, n_local, counts, me):
        parts = stale.clone()
        parts[me] = fresh
        return _merge_chan(parts, counts)


@dataclasses.dataclass(frozen=True)
class CorrectedStats(SyncStats):
    """DistriFusion's corrected asynchronous GroupNorm: the previous step's global moments ``E[x]``, ``E[x^2]``
    corrected by this rank's (fresh - stale) local moments; where the variance comes out negative, the local fresh
    variance is used. In exact arithmetic it agrees with :class:`StaleStats`; they differ in rounding and that guard.
    """

    records = True

    def _from_stale(self, stale, fresh, mean, m2, n_local, counts, me):
        w = (counts / counts.sum()).view(-1, 1, 1)
        e1 = stale[..., 0]
        e2 = stale[..., 1] / counts.view(-1, 1, 1) + e1**2
        f1, f2 = mean, m2 / n_local + mean**2
        g1 = (w * e1).sum(0) + w[me] * (f1 - e1[me])
        g2 = (w * e2).sum(0) + w[me] * (f2 - e2[me])
        gvar = g2 - g1**2
        return g1, torch.where(gvar < 0, m2 / n_local, gvar)
