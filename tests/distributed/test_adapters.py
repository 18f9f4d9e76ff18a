"""Layer adapters on their own: halo convolutions and exact GroupNorm on uneven bands, real gloo ranks.

One 3-rank spawn runs every case (torch only, no diffusers import) and returns numpy arrays; the halo
bookkeeping and the plan machinery are also tested without ranks. fp32 throughout; tolerance 1e-5 absolute:
a band result differs from the full-tensor one only in summation order (values are O(1)).
"""

import functools

import pytest
import torch
import torch.nn as nn

from patchray.distributed.comm import log_comm
from patchray.distributed.context import ParallelContext
from patchray.distributed.parallel.conv import HaloConv, halo_plan
from patchray.distributed.parallel.groupnorm import ShardedGroupNorm, exact_group_norm, merge_group_stats, group_stats, group_sums
from patchray.distributed.parallel.plan import ClaimedOnly, RowLocal, RowState, apply_plan, undo_all
from patchray.distributed.spawn import run_ranks

TOL = 1e-5
LATENT_BOUNDS = (0, 3, 5, 7)  # uneven bands: 3, 2 and 2 latent rows

CONV_CASES = {
    # name: (conv factory, dims, scale of the input relative to the latent)
    "k3_zeros": (lambda: nn.Conv2d(3, 4, 3, padding=1), 2, 4),
    "k3_reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), 2, 2),
    "k3_replicate": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="replicate"), 2, 2),
    "k5_zeros": (lambda: nn.Conv2d(3, 4, 5, padding=2), 2, 2),
    "k5_bands_thinner_than_kernel": (lambda: nn.Conv2d(3, 4, 5, padding=2), 2, 1),  # concatenating path
    "k3_no_padding_rows_only": (lambda: nn.Conv2d(3, 4, (3, 1), padding=(1, 0)), 2, 1),
    "k3_stride2": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), 2, 2),
    "k1": (lambda: nn.Conv2d(3, 4, 1), 2, 1),
    "conv3d_k3": (lambda: nn.Conv3d(3, 4, 3, padding=1), 3, 2),
    "conv3d_time_only_padding": (lambda: nn.Conv3d(3, 4, (3, 3, 3), padding=(2, 1, 1)), 3, 1),
}


def _full_input(dims, scale, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = LATENT_BOUNDS[-1] * scale
    shape = (batch, 3) + ((3,) if dims == 3 else ()) + (rows, 5)
    return torch.randn(shape, generator=g)


def _band(t, bounds, rank, rows_dim):
    return t.narrow(rows_dim, bounds[rank], bounds[rank + 1] - bounds[rank])


def _adapter_task(ctx):
    torch.manual_seed(0)
    state = RowState(ctx)
    state.latent_bounds = LATENT_BOUNDS
    out = {}
    for name, (factory, dims, scale) in CONV_CASES.items():
        conv = factory()
        x = _full_input(dims, scale)
        rows_dim = x.dim() - 2
        bounds = tuple(b * scale for b in LATENT_BOUNDS)
        applied = apply_plan([("", conv)], {type(conv).__name__: HaloConv()}, state)
        with log_comm() as log, torch.no_grad():
            got = conv(_band(x, bounds, ctx.rank, rows_dim))
        undo_all(applied)
        with torch.no_grad():
            full = conv(x)
        out_bounds = tuple(b * full.shape[rows_dim] // LATENT_BOUNDS[-1] for b in LATENT_BOUNDS)
        want = _band(full, out_bounds, ctx.rank, rows_dim)
        out[name] = (got.shape == want.shape and (got - want).abs().max().item(), log.calls)
    for name, (shape, groups, affine) in {
        "gn_4d": ((2, 8, 7 * 2, 5), 4, True),
        "gn_5d": ((2, 6, 3, 7, 5), 3, False),
        "gn_shifted": ((1, 4, 7 * 4, 3), 2, True),
    }.items():
        norm = nn.GroupNorm(groups, shape[1], affine=affine)
        if affine:
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)
        g = torch.Generator().manual_seed(1)
        # a large common offset makes E[x^2] - E[x]^2 cancel; Chan's merge must not
        x = torch.randn(shape, generator=g) * 0.1 + (100.0 if name == "gn_shifted" else 0.0)
        rows_dim = x.dim() - 2
        scale = shape[rows_dim] // LATENT_BOUNDS[-1]
        bounds = tuple(b * scale for b in LATENT_BOUNDS)
        applied = apply_plan([("", norm)], {"GroupNorm": ShardedGroupNorm()}, state)
        with log_comm() as log, torch.no_grad():
            got = norm(_band(x, bounds, ctx.rank, rows_dim))
        undo_all(applied)
        with torch.no_grad():
            want = _band(norm(x), bounds, ctx.rank, rows_dim)
        out[name] = ((got - want).abs().max().item(), log.calls)
    return out


@functools.lru_cache(maxsize=None)
def _spawned():
    return run_ranks(_adapter_task, 3)


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_halo_conv_matches_full_conv_on_uneven_bands(case):
    for rank, result in enumerate(_spawned()):
        diff, calls = result[case]
        assert diff is not False, f"{case}: rank {rank} band has the wrong shape"
        assert diff <= TOL, f"{case}: rank {rank} max abs diff {diff:.3g}"
        if case in ("k1",):
            assert calls == {}, "a 1x1 conv needs no halo"
        else:
            assert calls == {"batch_isend_irecv": 1}, f"{case}: one batched exchange per conv, got {calls}"


@pytest.mark.parametrize("case", ["gn_4d", "gn_5d", "gn_shifted"])
def test_group_norm_is_exact_in_one_collective(case):
    for rank, result in enumerate(_spawned()):
        diff, calls = result[case]
        # gn_shifted: values ~100 +- 0.1 in fp32 carry ~1e-5 absolute rounding before normalisation divides by
        # the 0.1 std, so nn.GroupNorm itself is only good to ~1e-4 there
        tol = 1e-3 if case == "gn_shifted" else TOL
        assert diff <= tol, f"{case}: rank {rank} max abs diff {diff:.3g}"
        assert calls == {"all_reduce": 1}, calls


def test_group_sums_cuda_branch_matches_the_cpu_branch(monkeypatch):
    """group_sums' CUDA arithmetic (per-channel moments of ``batch_norm_stats`` summed per group), run on CPU.

    ``torch.batch_norm_stats`` exists on CUDA only: it is stood in for by its definition (fp32 per-channel mean and
    ``1 / sqrt(biased var + eps)``) and the input by a tensor whose ``device.type`` reads ``"cuda"``. The sums must
    agree with the CPU branch's (the native GroupNorm kernel's per-group moments) to fp32 rounding, and a constant
    channel (``1 / sqrt(0) = inf``) must give variance 0, not NaN.
    """
    import types

    def batch_norm_stats(inp, eps):
        var, mean = torch.var_mean(inp.float(), dim=(0, 2), correction=0)
        return mean, torch.rsqrt(var + eps)

    class Cuda(torch.Tensor):
        @property
        def device(self):
            return types.SimpleNamespace(type="cuda")

    x = torch.randn(2, 12, 5, 7, generator=torch.Generator().manual_seed(5)) * 2 + 3
    x[:, 4] = 1.5  # one constant channel inside a group
    x[:, 8:12] = -2.0  # one constant group
    cpu = group_sums(x, 3)
    monkeypatch.setattr(torch, "batch_norm_stats", batch_norm_stats, raising=False)
    cuda = group_sums(x.as_subclass(Cuda), 3).as_subclass(torch.Tensor)
    assert cuda.shape == (2, 3, 3) and cuda.dtype == torch.float64
    assert torch.isfinite(cuda).all()
    assert torch.allclose(cuda, cpu, rtol=1e-6, atol=1e-6)
    xd = x.double().reshape(2, 3, -1)  # fp64 truth of (count, sum x, sum x^2)
    truth = torch.stack([torch.full_like(xd[..., 0], xd.shape[-1]), xd.sum(-1), (xd * xd).sum(-1)], -1)
    assert torch.allclose(cuda, truth, rtol=1e-6, atol=1e-5)


def test_chan_merge_equals_whole_tensor_statistics():
    x = torch.randn(2, 6, 11, 4, dtype=torch.float64)
    parts = [x[:, :, :4], x[:, :, 4:5], x[:, :, 5:]]
    stats = torch.stack([group_stats(p, 3).double() for p in parts])
    mean, var = merge_group_stats(stats)
    whole = x.reshape(2, 3, -1)
    assert torch.allclose(mean, whole.mean(-1).to(mean.dtype), atol=1e-6)
    assert torch.allclose(var, whole.var(-1, correction=0).to(var.dtype), atol=1e-6)


def test_exact_group_norm_on_one_rank_equals_nn_group_norm():
    norm = nn.GroupNorm(2, 4)
    x = torch.randn(3, 4, 5, 6)
    assert torch.allclose(exact_group_norm(x, norm, ParallelContext.single()), norm(x), atol=TOL)


def test_halo_plan_aligns_strided_bands_and_reads_edges_from_padding():
    # stride 2 from latent scale 2 to 1: output band [a, b) reads input rows [2a - 1, 2b)
    plan = halo_plan((0, 6, 10, 14), (0, 3, 5, 7), 3, 2, 1)
    assert plan.halos == ((0, 0), (1, 0), (1, 0))
    assert plan.pads == ((1, 0), (0, 0), (0, 0))
    # Downsample2D-style (no top padding, one bottom row): each band needs one row from the next rank
    plan = halo_plan((0, 6, 10, 14), (0, 3, 5, 7), 3, 2, 0)
    assert plan.halos == ((0, 1), (0, 1), (0, 0))
    assert plan.pads == ((0, 0), (0, 0), (0, 1))


def test_halo_plan_refuses_a_band_thinner_than_the_halo():
    with pytest.raises(ValueError, match="thinner than the halo"):
        halo_plan((0, 4, 5, 9), (0, 4, 5, 9), 5, 1, 2)


def test_row_state_derives_boundaries_from_the_layer_scale():
    ctx = ParallelContext.single()
    state = RowState(ctx)
    with pytest.raises(RuntimeError, match="band table"):
        state.bounds_at(4)
    state.latent_bounds = (0, 5)
    assert state.bounds_at(40) == (0, 40)
    assert state.bounds_for_height(20) == (0, 20)


def test_plan_refuses_uncovered_layers_before_patching_anything():
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.GELU())
    state = RowState(ParallelContext.single())
    with pytest.raises(NotImplementedError, match=r"1 \(GELU\)"):
        apply_plan([("", model)], {"Sequential": RowLocal(), "Conv2d": HaloConv()}, state)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_claimed_only_layers_are_refused_on_their_own():
    state = RowState(ParallelContext.single())
    model = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)))
    with pytest.raises(NotImplementedError, match="only inside WanResample"):
        apply_plan([("", model)], {"Sequential": RowLocal(), "ZeroPad2d": ClaimedOnly(parent="WanResample")}, state)


def test_row_local_refuses_configured_attributes():
    class Noisy(nn.Module):
        per_channel_scale1 = nn.Parameter(torch.ones(1))

    state = RowState(ParallelContext.single())
    with pytest.raises(NotImplementedError, match="per_channel_scale1"):
        apply_plan([("", Noisy())], {"Noisy": RowLocal(refuse=("per_channel_scale1",))}, state)


def test_halo_conv_refuses_dilation_along_rows():
    state = RowState(ParallelContext.single())
    with pytest.raises(NotImplementedError, match="dilation"):
        apply_plan([("", nn.Conv2d(3, 3, 3, dilation=2))], {"Conv2d": HaloConv()}, state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_group_norm_low_precision_is_as_good_as_nn_group_norm(dtype):
    norm = nn.GroupNorm(16, 64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(2, 64, 8, 8, generator=torch.Generator().manual_seed(3)) * 3 + 5
    exact = norm(x)  # fp32 truth
    low = nn.GroupNorm(16, 64).to(dtype)
    low.load_state_dict(norm.state_dict())
    with torch.no_grad():
        native_error = (low(x.to(dtype)).float() - exact).abs().max()
        ours = exact_group_norm(x.to(dtype), low, ParallelContext.single())
    assert ours.dtype == dtype
    # statistics and normalisation run in fp32 chunks: no worse than the native kernel (which also uses fp32
    # internally) beyond one rounding of the output
    assert (ours.float() - exact).abs().max() <= native_error + 2 ** -7 * exact.abs().max()
