"""Patch-parallel sampling on real gloo ranks: one spawn per world size (2, 3, 4) runs every check.

What is checked (each rank returns a dict of named results; the test asserts them in the parent):

* full_sync equals the single-rank run of the same seed (tiny SDXL-block UNet, fp32, Euler + CFG), N = 2, 3, 4,
  uneven bands at N = 3, split_batch on (N = 4) and off.
* the CFG bug: with split_batch and OTIL, the other half's band is the partner's fresh band with ``cfg_repair`` on,
  and the stale value of the last synchronous step with it off.
* the periodic refresh: the refresh step's output equals the unpatched model's output for the same input (halos,
  K/V and GroupNorm really refreshed), a no_sync step's does not, and the K/V memory changes only on the refresh.
* displaced mode: an asynchronous step on the same input as the synchronous step before it reproduces the
  unpatched model (the one-step-stale context is then exact), one on a new input does not; every rank holds the
  same streamed memory after the asynchronous all-gathers; K/V bytes flow on asynchronous steps.
* a ComfyUI-shaped model (Conv2d/GroupNorm subclasses, a CrossAttention with ``forward(x, context=None,
  value=None, mask=None, transformer_options={})``) is covered by the same adapters, without importing ComfyUI.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from patchray.distributed.spawn import run_ranks

H = W = 32  # latent: bands of 16/16, 12/12/8 (uneven), 8 x 4 at align 4
STEPS = 3


def _ref_latent():
    from patchray.distributed.sampling import sdxl

    unet = sdxl.build_unet(True)
    cond = sdxl.synthetic_cond(unet, 1)
    lat = torch.randn(1, 4, H, W, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return sdxl.sample_euler_cfg(sdxl.unet_denoiser(unet), lat, cond, STEPS)


# ------------------------------------------------------------------------------------- a ComfyUI-shaped model


class _CastConv(nn.Conv2d):
    """Like comfy.ops' Conv2d: a subclass whose forward goes through _conv_forward with its own weights."""

    def forward(self, x):
        return self._conv_forward(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class _GN32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class _CrossAttention(nn.Module):
    """ComfyUI's CrossAttention interface: to_q/to_k/to_v/to_out, forward(x, context=None, value=None, ...)."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))

    def forward(self, x, context=None, value=None, mask=None, transformer_options={}):
        q = self.to_q(x)
        context = x if context is None else context
        k = self.to_k(context)
        v = self.to_v(value if value is not None else context)
        b = q.shape[0]
        q, k, v = (t.view(b, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, self.heads * q.shape[-1])
        return self.to_out(o)


class _ComfyLikeUNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.input_blocks = nn.ModuleList([_CastConv(4, c, 3, padding=1)])
        self.norm = _GN32(4, c)
        self.down = _CastConv(c, c, 3, stride=2, padding=1)
        self.attn1 = _CrossAttention(c)
        self.attn2 = _CrossAttention(c)
        self.out = _CastConv(c, 4, 3, padding=1)

    def forward(self, x, t, context=None):
        h = self.input_blocks[0](x)
        h = F.silu(self.norm(h))
        h = self.down(h)
        b, c, hh, ww = h.shape
        tok = h.flatten(2).transpose(1, 2)
        tok = tok + self.attn1(tok, context=None, transformer_options={})
        tok = tok + self.attn2(tok, context=context)
        h = tok.transpose(1, 2).reshape(b, c, hh, ww)
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        return self.out(h)


# ------------------------------------------------------------------------------------- rank functions


def _sample(ctx, name, **over):
    from patchray.distributed.sampling import sdxl
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.denoiser import PatchParallelDenoiser

    unet = sdxl.build_unet(True)
    cond = sdxl.synthetic_cond(unet, 1)
    lat = torch.randn(1, 4, H, W, generator=torch.Generator().manual_seed(5))
    den = PatchParallelDenoiser(sdxl.unet_denoiser(unet), ctx, preset(name, **over), unet=unet)
    with torch.no_grad():
        x = den.finalize(sdxl.sample_euler_cfg(den, lat, cond, STEPS))
    traffic = den.traffic.snapshot()
    den.remove()
    return x, traffic


def _cfg_check(ctx, repair):
    """Split-batch OTIL: is the other half's band on this rank the partner's fresh band at an async step?"""
    from patchray.distributed.comm import all_gather_padded
    from patchray.distributed.sampling import sdxl
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.denoiser import PatchParallelDenoiser

    unet = sdxl.build_unet(True)
    cond = sdxl.synthetic_cond(unet, 1)
    over = {"cfg_repair": True, "cfg_repair_half": True} if repair == "half" else {"cfg_repair": repair}
    den = PatchParallelDenoiser(sdxl.unet_denoiser(unet), ctx, preset("otil_unsynced", warmup_steps=1, **over), unet=unet)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(2, 4, H, W, generator=g) for _ in range(2)]
    t = torch.tensor([500.0, 500.0])
    with torch.no_grad():
        out0 = den(xs[0], t, **cond)  # synchronous warm-up step
        out1 = den(xs[1], t, **cond)  # OTIL step
    half, m = den.split.half, den.patch_ctx.world_size
    s, e = den.bounds[den.patch_ctx.rank], den.bounds[den.patch_ctx.rank + 1]
    other = 1 - half
    mine = out1[half : half + 1, :, s:e].contiguous()
    # the partner's fresh band of its own half, fetched by the test over the same pair
    both = all_gather_padded(mine, den.split.pair, dim=0, sizes=[1, 1])
    partner_fresh = both[other : other + 1]
    got = out1[other : other + 1, :, s:e]
    # the partner's whole completed half (for cfg_repair_half: the other half must be exactly that)
    whole = all_gather_padded(out1[half : half + 1].contiguous(), den.split.pair, dim=0, sizes=[1, 1])[other : other + 1]
    result = {
        "other_equals_partner_whole": torch.equal(out1[other : other + 1], whole),
        "equals_partner_fresh": torch.equal(got, partner_fresh),
        "equals_stale": torch.equal(got, out0[other : other + 1, :, s:e]),
        "fresh_changed": not torch.equal(partner_fresh, out0[other : other + 1, :, s:e]),
        "cfg_bytes": den.traffic.bytes["cfg"],
    }
    den.remove()
    return result


def _refresh_check(ctx):
    """otil preset, warm-up 1, refresh every 2: steps 0 (sync), 1 (stale), 2 (refresh), 3 (stale)."""
    from patchray.distributed.sampling import sdxl
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.denoiser import PatchParallelDenoiser

    unet = sdxl.build_unet(True)
    plain = sdxl.build_unet(True)
    cond = sdxl.synthetic_cond(unet, 1)
    cfg = preset("otil", warmup_steps=1, refresh_every=2, split_batch=False)
    den = PatchParallelDenoiser(sdxl.unet_denoiser(unet), ctx, cfg, unet=unet)
    g = torch.Generator().manual_seed(11)
    t = torch.tensor([400.0, 400.0])
    rel, snaps = [], []
    cm = den.handle.state
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(2, 4, H, W, generator=g)
            out = den(x, t, **cond)
            ref = plain(x, t, return_dict=False, **cond)[0]
            s, e = den.bounds[ctx.rank], den.bounds[ctx.rank + 1]
            # the own band: refreshed or not, it is the rank's fresh computation; compare it to the reference
            rel.append(((out[:, :, s:e] - ref[:, :, s:e]).norm() / ref[:, :, s:e].norm()).item())
            sid = cm.cm._index[next(k for k in cm.cm._index if k.endswith("attn1.k"))]
            peer = (ctx.rank + 1) % ctx.world_size
            snaps.append(cm.cm.view(sid, peer).clone())
    res = {
        "rel": rel,
        "kv_same_after_stale_step": torch.equal(snaps[0], snaps[1]),
        "kv_changed_on_refresh": not torch.equal(snaps[1], snaps[2]),
        "kv_same_after_second_stale": torch.equal(snaps[2], snaps[3]),
        "sync_flags": [cfg.is_sync_step(i) for i in range(4)],
    }
    den.remove()
    # streams (cond and uncond evaluated in separate calls): each keeps its own step count and stale memories.
    # Interleaved A0 B0 A1 B1 with a constant input per stream: the asynchronous A1/B1 reuse their own stream's
    # context, which equals the fresh one, so they reproduce the unpatched model; shared memories would not.
    den = PatchParallelDenoiser(sdxl.unet_denoiser(unet), ctx, preset("otil", warmup_steps=1, split_batch=False), unet=unet)
    xa, xb = torch.randn(2, 4, H, W, generator=g), torch.randn(2, 4, H, W, generator=g)
    with torch.no_grad():
        den(xa, t, patch_stream="a", **cond)
        den(xb, t, patch_stream="b", **cond)
        outs = {k: den(x, t, patch_stream=k, **cond) for k, x in (("a", xa), ("b", xb))}
        refs = {k: plain(x, t, return_dict=False, **cond)[0] for k, x in (("a", xa), ("b", xb))}
        res["stream_steps"] = {k: den._streams[k].step for k in ("a", "b")}
        # patch_step=0 starts a new run of stream "a" on a new input: synchronous, hence exact (a continued run's
        # asynchronous step on this input with xa's context would be far off)
        outs["a_restart"] = den(xb, t, patch_stream="a", patch_step=0, **cond)
        refs["a_restart"] = refs["b"]
    res["stream_rel"] = {k: ((outs[k] - refs[k]).norm() / refs[k].norm()).item() for k in outs}
    den.remove()
    return res


def _displaced_check(ctx):
    from patchray.distributed.sampling import sdxl
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.denoiser import PatchParallelDenoiser

    unet = sdxl.build_unet(True)
    cond = sdxl.synthetic_cond(unet, 1)
    den = PatchParallelDenoiser(sdxl.unet_denoiser(unet), ctx, preset("displaced", warmup_steps=1, split_batch=False), unet=unet)
    g = torch.Generator().manual_seed(13)
    t = torch.tensor([300.0, 300.0])
    x0, x1 = torch.randn(2, 4, H, W, generator=g), torch.randn(2, 4, H, W, generator=g)
    plain = sdxl.build_unet(True)
    with torch.no_grad():
        den(x0, t, **cond)  # synchronous warm-up
        kv0 = den.traffic.bytes["kv"]
        # the same input again, asynchronous: the one-step-stale context is exactly this input's context, so the
        # output must equal the unpatched model's (a wrong slot, rank or row in the stale memory would show here)
        out_same = den(x0, t, **cond)
        ref0 = plain(x0, t, return_dict=False, **cond)[0]
        # a new input with the previous step's context: off by far more than rounding
        out_new = den(x1, t, **cond)
        ref1 = plain(x1, t, return_dict=False, **cond)[0]
        cm = den.handle.state.cm
        cm.wait()
    kv_async = den.traffic.bytes["kv"] - kv0
    rows = torch.cat([cm.view(i, r).flatten() for i, s in enumerate(cm._slots) if s.streamed for r in range(ctx.world_size)])
    res = {
        "streamed_memory": rows.numpy(),
        "kv_async_bytes": kv_async,
        "rel_async_new_input": ((out_new - ref1).norm() / ref1.norm()).item(),
        "rel_async_same_input": ((out_same - ref0).norm() / ref0.norm()).item(),
    }
    den.remove()
    # the GroupNorm variants on the same-input asynchronous step: stale statistics are then exact too, separate
    # (local) statistics are not
    for gn in ("stale", "separate"):
        den = PatchParallelDenoiser(
            sdxl.unet_denoiser(unet), ctx, preset("displaced", warmup_steps=1, split_batch=False, groupnorm=gn), unet=unet
        )
        with torch.no_grad():
            den(x0, t, **cond)
            out = den(x0, t, **cond)
        res[f"rel_gn_{gn}"] = ((out - ref0).norm() / ref0.norm()).item()
        den.remove()
    return res


def _comfy_like_check(ctx):
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.denoiser import PatchParallelDenoiser

    torch.manual_seed(3)
    net = _ComfyLikeUNet()
    ref_net = _ComfyLikeUNet()
    ref_net.load_state_dict(net.state_dict())
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    ctxt = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(6))
    den = PatchParallelDenoiser(net, ctx, preset("full_sync", split_batch=False))
    n_adapters = len(den.handle.adapters)
    with torch.no_grad():
        out = den(x, None, context=ctxt)
        ref = ref_net(x, None, context=ctxt)
    den.remove()
    restored = type(net.input_blocks[0]).forward is net.input_blocks[0].forward.__func__ and net.input_blocks[0].padding == (1, 1)
    return {"max_err": (out - ref).abs().max().item(), "n_adapters": n_adapters, "restored": restored}


def _all_checks(ctx):
    res = {}
    x, traffic = _sample(ctx, "full_sync")
    res["full_sync"] = (x.numpy(), traffic)
    if ctx.world_size in (2, 3):
        x, traffic = _sample(ctx, "full_sync", split_batch=False) if ctx.world_size == 2 else (x, traffic)
        res["full_sync_nosplit"] = (x.numpy(), traffic)
        res["displaced"] = _displaced_check(ctx)
        res["refresh"] = _refresh_check(ctx)
    if ctx.world_size in (2, 4):
        res["cfg_on"] = _cfg_check(ctx, True)
        res["cfg_off"] = _cfg_check(ctx, False)
        res["cfg_half"] = _cfg_check(ctx, "half")
    if ctx.world_size == 2:
        res["comfy"] = _comfy_like_check(ctx)
    return res


@pytest.fixture(scope="module")
def reference():
    return _ref_latent()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_patch_parallel_sampling(n, reference):
    results = run_ranks(_all_checks, n, timeout_s=240)
    ref = reference
    for key in ("full_sync", "full_sync_nosplit"):
        if key not in results[0]:
            continue
        for r, res in enumerate(results):
            x = torch.from_numpy(res[key][0])
            # fp32 patch parallelism reorders sums (GroupNorm merge, conv over a halo-padded band, attention over
            # concatenated K/V); 3 Euler steps at sigma up to 14.6 amplify 1e-7 roundings to ~1e-6 relative.
            rel = ((x - ref).norm() / ref.norm()).item()
            assert rel < 2e-5, f"{key} N={n} rank {r}: relative L2 {rel:.2e} vs the single-rank run"
            assert np.array_equal(res[key][0], results[0][key][0]), f"{key}: rank {r} finalized a different latent"
        traffic = results[0][key][1]
        if n == 2 and key == "full_sync":  # split_batch on 2 ranks: CFG parallel only, no patch parallelism
            assert traffic["bytes"]["kv"] == 0 and traffic["bytes"]["cfg"] > 0
            continue
        assert traffic["bytes"]["kv"] > 0 and traffic["bytes"]["halo"] > 0 and traffic["bytes"]["groupnorm"] > 0
    if "refresh" in results[0]:
        for r, res in enumerate(results):
            rf = res["refresh"]
            assert rf["sync_flags"] == [True, False, True, False]
            # synchronous steps reproduce the unpatched model up to fp32 reordering (1e-5 relative)
            assert rf["rel"][0] < 1e-5 and rf["rel"][2] < 1e-5, rf["rel"]
            # the stale steps really use stale halos/K/V: they differ from the reference by far more
            assert rf["rel"][1] > 1e-3 and rf["rel"][3] > 1e-3, rf["rel"]
            assert rf["kv_same_after_stale_step"] and rf["kv_changed_on_refresh"] and rf["kv_same_after_second_stale"]
            # per-stream memories: fp32 reordering only (1e-5)
            assert rf["stream_steps"] == {"a": 2, "b": 2} and max(rf["stream_rel"].values()) < 1e-5, rf
        for res in results:
            d = res["displaced"]
            # after an asynchronous all-gather every rank holds the same (one-step-stale) values of every rank
            assert np.array_equal(d["streamed_memory"], results[0]["displaced"]["streamed_memory"])
            assert d["kv_async_bytes"] > 0, d
            # fp32 reordering only (1e-5); the step on a new input with stale context is far off (> 1e-3)
            assert d["rel_async_same_input"] < 1e-5 < 1e-3 < d["rel_async_new_input"], d
            assert d["rel_gn_stale"] < 1e-5 < 1e-4 < d["rel_gn_separate"], d
    if "cfg_on" in results[0]:
        for r, res in enumerate(results):
            on, off = res["cfg_on"], res["cfg_off"]
            assert on["fresh_changed"] and off["fresh_changed"], "inputs must change between steps for the check to bite"
            assert on["equals_partner_fresh"] and not on["equals_stale"], f"rank {r}: repair on must give the fresh band"
            assert off["equals_stale"] and not off["equals_partner_fresh"], f"rank {r}: repair off must reproduce the bug"
            assert on["cfg_bytes"] > off["cfg_bytes"]
            half = res["cfg_half"]
            assert half["equals_partner_fresh"] and half["other_equals_partner_whole"], f"rank {r}: {half}"
            assert half["cfg_bytes"] >= on["cfg_bytes"]
            if n == 4:  # two bands per half: the band-only repair leaves the other half's remote band stale
                assert not on["other_equals_partner_whole"] and half["cfg_bytes"] > on["cfg_bytes"]
    if "comfy" in results[0]:
        for res in results:
            c = res["comfy"]
            # conv x3 + GroupNorm + 2 attention modules are adapted; fp32 reordering only (1e-5 absolute)
            assert c["n_adapters"] == 6 and c["max_err"] < 1e-5 and c["restored"], c
