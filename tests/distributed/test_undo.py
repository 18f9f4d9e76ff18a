"""The one undo path of ``parallel`` (apply a plan, remove it): exactly what was there comes back.

* a forward another extension set on a module keeps running while PatchRay's adapter wraps it, and is the very
  same object after ``remove()``;
* a conv's ``padding`` is never left changed, neither between calls while adapted nor after ``remove()``;
* applying twice is refused (it would wrap the adapter in itself and lose the original on removal);
* the plan machinery's glob matching: a path key singles out one module, class keys match host subclasses
  through their bases only when applied non-strictly.

The UNet checks run on two real gloo ranks (adapters are installed only when there are peers).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from patchray.distributed.context import ParallelContext
from patchray.distributed.bands import band_heights, row_bands, token_shards
from patchray.distributed.parallel.conv import HaloConv
from patchray.distributed.parallel.groupnorm import ShardedGroupNorm
from patchray.distributed.parallel.plan import RowLocal, RowState, apply_plan, is_adapted, replace_forward, style_for, undo_all
from patchray.distributed.spawn import run_ranks


class _Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Sequential(nn.Linear(dim, dim))

    def forward(self, x, context=None):
        q, k, v = self.to_q(x), self.to_k(x if context is None else context), self.to_v(x if context is None else context)
        return self.to_out(F.scaled_dot_product_attention(q, k, v))


class _Net(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv_in = nn.Conv2d(4, c, 3, padding=1)
        self.norm = nn.GroupNorm(2, c)
        self.attn = _Attention(c)
        self.conv_out = nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, x, t=None):
        h = F.silu(self.norm(self.conv_in(x)))
        b, c, hh, ww = h.shape
        tok = h.flatten(2).transpose(1, 2)
        h = (tok + self.attn(tok)).transpose(1, 2).reshape(b, c, hh, ww)
        return self.conv_out(h)


def _undo_task(ctx):
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.denoiser import PatchParallelDenoiser, parallelize_unet

    torch.manual_seed(0)
    net, ref = _Net(), _Net()
    ref.load_state_dict(net.state_dict())
    calls = {"conv_out": 0, "norm": 0, "attn": 0}

    def foreign(name, module):
        # another extension's instance-level forward: counts, then runs the class's forward
        def forward(*args, **kwargs):
            calls[name] += 1
            return type(module).forward(module, *args, **kwargs)

        return forward

    foreigns = {name: foreign(name, getattr(net, name)) for name in calls}
    for name, fn in foreigns.items():
        getattr(net, name).forward = fn
    x = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(1))
    den = PatchParallelDenoiser(net, ctx, preset("full_sync", split_batch=False))
    res = {"padding_while_applied": (net.conv_in.padding, net.conv_out.padding)}
    try:
        parallelize_unet(net, ctx, preset("full_sync", split_batch=False))
        res["second_apply"] = "accepted"
    except RuntimeError as e:
        res["second_apply"] = str(e)
    with torch.no_grad():
        out = den(x, None)
        want = ref(x)
    res["max_err"] = (out - want).abs().max().item()
    res["foreign_calls"] = dict(calls)
    res["padding_between_calls"] = (net.conv_in.padding, net.conv_out.padding)
    den.remove()
    res["foreign_restored"] = {name: getattr(net, name).__dict__.get("forward") is fn for name, fn in foreigns.items()}
    res["conv_in_restored"] = "forward" not in net.conv_in.__dict__ and not is_adapted(net.conv_in)
    res["padding_after"] = (net.conv_in.padding, net.conv_out.padding)
    res["marks_left"] = [n for n, m in net.named_modules() if is_adapted(m)]
    # after removal the model can be parallelized again
    den = PatchParallelDenoiser(net, ctx, preset("full_sync", split_batch=False))
    den.remove()
    return res


@functools.lru_cache(maxsize=None)
def _undo_results():
    return run_ranks(_undo_task, 2)


def test_a_forward_set_by_another_extension_runs_while_adapted_and_survives_removal():
    for rank, res in enumerate(_undo_results()):
        # the conv and attention adapters wrap the forward they replaced: the other extension ran once per UNet
        # call. The GroupNorm adapter recomputes the normalization with whole-image statistics (it has to), so it
        # does not call the forward it replaced; it still puts it back.
        assert res["foreign_calls"] == {"conv_out": 1, "norm": 0, "attn": 1}, (rank, res)
        assert res["max_err"] < 1e-5, (rank, res)  # fp32 reordering only: the wrapped forward is exact
        assert all(res["foreign_restored"].values()), (rank, res["foreign_restored"])
        assert res["conv_in_restored"] and res["marks_left"] == [], (rank, res)


def test_conv_padding_is_never_left_changed():
    for rank, res in enumerate(_undo_results()):
        assert res["padding_while_applied"] == ((1, 1), (1, 1)), (rank, res)
        assert res["padding_between_calls"] == ((1, 1), (1, 1)), (rank, res)
        assert res["padding_after"] == ((1, 1), (1, 1)), (rank, res)


def test_applying_twice_is_refused():
    for res in _undo_results():
        assert "already carries a PatchRay adapter" in res["second_apply"], res["second_apply"]


def test_replace_forward_restores_exactly_and_refuses_twice():
    conv = nn.Conv2d(2, 2, 3, padding=1)
    theirs = conv.forward  # a bound method object set as an instance attribute by another extension
    conv.forward = theirs
    undo = replace_forward(conv, "conv", lambda prior: (lambda x: prior(x) * 2))
    x = torch.randn(1, 2, 4, 4)
    assert torch.equal(conv(x), nn.Conv2d.forward(conv, x) * 2)
    with pytest.raises(RuntimeError, match="already carries a PatchRay adapter"):
        replace_forward(conv, "conv", lambda prior: prior)
    undo()
    assert conv.__dict__["forward"] is theirs and not is_adapted(conv)


def test_a_failed_plan_is_undone_and_leaves_no_marks():
    net = nn.Sequential(nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 3, dilation=2))
    state = RowState(ParallelContext.single())
    with pytest.raises(NotImplementedError, match="dilation"):
        apply_plan([("", net)], {"Sequential": RowLocal(), "GroupNorm": ShardedGroupNorm(), "Conv2d": HaloConv()}, state)
    assert not any(is_adapted(m) or "forward" in m.__dict__ for m in net.modules())


def test_plan_keys_match_paths_first_and_bases_only_when_not_strict():
    class HostConv(nn.Conv2d):
        pass

    path_style, type_style = HaloConv(cut_input=True), HaloConv()
    plan = {"conv_in": path_style, "Conv2d": type_style}
    host = HostConv(1, 1, 3)
    assert style_for(plan, "conv_in", host, bases=True) is path_style
    assert style_for(plan, "down.conv", host, bases=True) is type_style
    assert style_for(plan, "down.conv", host, bases=False) is None  # strict plans name every class they cover
    assert style_for({"*Attention": type_style}, "blocks.0.attn1", _Attention(2)) is type_style


def test_band_table_row_bands_and_token_shards_are_one_split():
    # hand-computed: 7 rows over 3 ranks -> 3, 2, 2; 32 rows in units of 4 -> 12, 12, 8
    assert row_bands(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert band_heights(32, 3, 4) == (12, 12, 8)
    # a token shard of whole rows (align = tokens per row) is the row band, in tokens
    width = 5
    assert token_shards(7 * width, 3, align=width) == tuple((b - a) * width for a, b in row_bands(7, 3))
    with pytest.raises(ValueError, match="fewer ranks"):
        token_shards(4, 5)
    with pytest.raises(ValueError, match="multiple of align"):
        token_shards(7, 2, align=2)
