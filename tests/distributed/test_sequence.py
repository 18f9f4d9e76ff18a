"""Sequence parallelism's core (``parallel/sequence.py``) on real gloo ranks, against unsharded attention.

* the token shard table: a rank's tokens are a band of rows in every frame (not contiguous in a video), uneven
  bands, every token owned once;
* shard / gather round trip in exact order, RoPE (cos/sin and complex frequencies) sliced by the same index;
* gathered, overlapped (the gather in flight behind the local keys, parts merged by log-sum-exp), ring (the same K/V
  point to point, one peer per stage) and Ulysses attention == one-rank attention for joint text+image sequences (text before or after), every layout, key masks
  over local or full keys (overlapped runs those gathered); key order does not change unmasked softmax attention;
* each mode's bytes, counted by comm's accounting, equal the modelled cost (``attention_cost``);
* displaced K/V: the remote K/V are the previous step's, the own ones fresh; its bytes go through the
  asynchronous accounting.

Tolerance: 1e-5 relative L2 in fp32. The sharded computation does the same arithmetic per query as the unsharded
one except the order of the keys in the softmax sums (rank-major instead of global order) and, in Ulysses, the
same per-head sums; fp32 summation reordering over at most a few hundred terms changes results by ~1e-7
relative, two orders below the bound, while any wrong key, position or head shows up at O(1).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from patchray.distributed.parallel.sequence import TokenShards, attention_cost, shard_positions, shard_tokens
from patchray.distributed.spawn import run_ranks

TOL = 1e-5


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_a_rank_owns_a_band_of_rows_in_every_frame():
    s = TokenShards.split(frames=3, rows=5, cols=2, world_size=2)
    assert s.row_sizes == (3, 2) and s.counts == (18, 12)
    # rank 1 owns rows 3..4 of each frame: positions 6..9 in frame 0, 16..19 in frame 1, 26..29 in frame 2
    assert s.index(1).tolist() == [6, 7, 8, 9, 16, 17, 18, 19, 26, 27, 28, 29]
    order = s.order()
    assert sorted(order.tolist()) == list(range(30))  # every token owned exactly once
    s3 = TokenShards.split(frames=1, rows=7, cols=3, world_size=3, row_sizes=(1, 4, 2))  # uneven, speed-weighted
    assert s3.counts == (3, 12, 6) and s3.index(0).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="use at most 2 ranks"):
        TokenShards.split(frames=1, rows=2, cols=4, world_size=3)
    with pytest.raises(ValueError, match="sum to rows"):
        TokenShards.split(frames=1, rows=5, cols=4, world_size=2, row_sizes=(2, 2))


def test_positions_are_sliced_by_the_same_index_in_any_layout():
    s = TokenShards.split(frames=3, rows=5, cols=2, world_size=3)
    grid = torch.arange(30).view(3, 5, 2)
    text = 4
    # FLUX layout: [text + image, D] cos/sin with text first; Wan layout [1, L, 1, D]; complex frequencies [L, D/2]
    cos = torch.cat([torch.full((text,), -1), grid.reshape(-1)]).float().unsqueeze(-1).repeat(1, 6)
    wan = grid.reshape(1, -1, 1, 1).float().repeat(1, 1, 1, 6)
    cplx = torch.polar(torch.ones(30, 3), grid.reshape(-1, 1).float().repeat(1, 3))
    for r in range(3):
        lo, hi = s.row_bounds[r], s.row_bounds[r + 1]
        want = grid[:, lo:hi].reshape(-1).float()  # the rank's positions, frame-major
        c, _ = shard_positions((cos, cos), s, r, dim=0, before=text)
        assert torch.equal(c[:text, 0], torch.full((text,), -1.0)) and torch.equal(c[text:, 0], want)
        assert torch.equal(shard_positions(wan, s, r, dim=1)[0, :, 0, 0], want)
        assert torch.equal(shard_positions(cplx, s, r, dim=0), cplx.view(3, 5, 2, 3)[:, lo:hi].reshape(-1, 3))
        assert torch.equal(shard_tokens(grid.reshape(1, -1), s, r, dim=1)[0].float(), want)


def test_the_table_shards_the_text_as_a_contiguous_segment_of_the_joint_sequence():
    from patchray.distributed.parallel.sequence import text_split

    # the first T % N ranks one token more; a rank holds none when T < N
    assert text_split(512, 3) == (171, 171, 170) and text_split(7, 3) == (3, 2, 2) and text_split(2, 3) == (1, 1, 0)
    s = TokenShards.split(frames=1, rows=5, cols=2, world_size=3, text=7)  # bands 2/2/1 rows, text 3/2/2
    assert s.text_sizes == (3, 2, 2) and s.counts == (4, 4, 2) and s.seq_counts == (7, 6, 4)
    # text first (FLUX.1): positions 0..6 are text, 7..16 the image; rank 1 = text 3, 4 then image rows 2..3
    assert s.part_index("joint", 1).tolist() == [3, 4, 11, 12, 13, 14]
    assert s.part_index("text", 2).tolist() == [5, 6]
    assert sorted(s.part_order("joint").tolist()) == list(range(17))  # every token owned once
    # text last (HunyuanVideo): rank 0 = image rows 0..1, then text 0..2 at positions 10..12
    a = TokenShards.split(frames=1, rows=5, cols=2, world_size=3, text=7, text_side="after")
    assert a.part_index("joint", 0).tolist() == [0, 1, 2, 3, 10, 11, 12]
    # a joint RoPE table and a text stream are cut by the same index; an empty slice is an empty tensor
    joint = torch.arange(17).float().view(17, 1)
    assert shard_positions((joint, joint), s, 1, dim=0, part="joint")[0][:, 0].tolist() == [3, 4, 11, 12, 13, 14]
    e = TokenShards.split(frames=1, rows=5, cols=2, world_size=3, text=2)
    assert shard_tokens(torch.zeros(1, 2, 4), e, 2, dim=1, part="text").shape == (1, 0, 4)
    with pytest.raises(ValueError, match="text sequence of 7"):
        shard_tokens(torch.zeros(1, 6, 4), s, 0, dim=1, part="text")
    # tables with and without sharded text differ (a new table empties the stale memory)
    assert s != TokenShards.split(frames=1, rows=5, cols=2, world_size=3)


def test_unmasked_attention_does_not_depend_on_key_order():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g) for _ in range(3))
    perm = torch.randperm(40, generator=g)
    a = F.scaled_dot_product_attention(q, k, v)
    b = F.scaled_dot_product_attention(q, k[:, :, perm], v[:, :, perm])
    assert rel(b, a) < TOL  # summation order only
    # ... but permuting the keys alone (not the values) does change it: the check can fail
    assert rel(F.scaled_dot_product_attention(q, k[:, :, perm], v), a) > 0.05


# ------------------------------------------------------------------------------------------------ ranks


def _sdpa(q, k, v, mask, heads):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _blc_attn(q, k, v, mask, heads):
    # ComfyUI's optimized_attention convention: [B, L, heads * D] in and out
    split = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)
    return F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask).transpose(1, 2).flatten(-2)


def _blhd_attn(q, k, v, mask, heads):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)


def _core_task(ctx):
    from patchray.distributed.comm import log_comm
    from patchray.distributed.parallel.exchange import DISPLACED
    from patchray.distributed.parallel.sequence import SequenceAttention, SequenceState, gather_tokens
    from patchray.distributed.sampling.comm_manager import CommManager, Traffic

    n, me = ctx.world_size, ctx.rank
    res = {"errors": {}, "modes": {}, "bytes": {}, "cost": {}}
    state = SequenceState(ctx, Traffic())
    frames, rows, cols, heads, d, text, b = 3, 7, 3, 6, 8, 5, 2  # odd frame count, 7 rows: uneven at N = 2 and 3
    state.set_grid(frames, rows, cols)
    s = state.shards
    g = torch.Generator().manual_seed(1)  # every rank draws the same full tensors
    L = s.total
    qf, kf, vf = (torch.randn(b, heads, text + L, d, generator=g) for _ in range(3))
    # a HunyuanVideo-style key mask: image keys always attend, the last two text tokens are padding
    keep = torch.ones(b, text + L, dtype=torch.bool)
    keep[:, -2:] = False
    shard = lambda t, before, after: shard_tokens(t, s, me, dim=2, before=before, after=after)

    # the shard/gather round trip is exact, element for element
    x = torch.randn(b, text + L, 4, generator=g)
    res["roundtrip_equal"] = torch.equal(gather_tokens(shard_tokens(x, s, me, dim=1, before=text), s, ctx, dim=1, before=text), x)

    for mode in ("gathered", "ulysses", "overlapped", "ring"):
        attn = SequenceAttention(state, mode)
        for where in ("before", "after"):
            before, after = (text, 0) if where == "before" else (0, text)
            if where == "before":
                q, k, v = qf, kf, vf
            else:  # image first, text last
                q, k, v = (torch.cat([t[:, :, text:], t[:, :, :text]], dim=2) for t in (qf, kf, vf))
            want = F.scaled_dot_product_attention(q, k, v)
            ql, kl, vl = (shard(t, before, after) for t in (q, k, v))
            with log_comm() as log:
                out = attn(ql, kl, vl, _sdpa, layout="BHLD", before=before, after=after, key="a")
            full = gather_tokens(out, s, ctx, dim=2, before=before, after=after)
            res["errors"][(mode, where, "BHLD")] = rel(full, want)
            res["modes"][(mode, where)] = attn.last_mode.value
            res["bytes"][(mode, where)] = dict(log.bytes)
            c = attention_cost(mode, s.counts, heads, d, 4, batch=b, replicated=text)
            res["cost"][(mode, where)] = c.counted
            # the same call in the other layouts
            for layout, fn, conv in (("BLHD", _blhd_attn, lambda t: t.transpose(1, 2)),
                                     ("BLC", _blc_attn, lambda t: t.transpose(1, 2).flatten(-2))):
                o = attn(conv(ql), conv(kl), conv(vl), fn, layout=layout, heads=heads, before=before, after=after, key="a")
                o = o if layout == "BLHD" else o.unflatten(-1, (heads, d))
                res["errors"][(mode, where, layout)] = rel(gather_tokens(o.transpose(1, 2), s, ctx, dim=2, before=before, after=after), want)
        # key masks: over the local keys (as HunyuanVideo builds them) and over the full keys in global order
        q, k, v = (torch.cat([t[:, :, text:], t[:, :, :text]], dim=2) for t in (qf, kf, vf))
        mask_full = keep.view(b, 1, 1, -1)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_full)
        ql, kl, vl = (shard(t, 0, text) for t in (q, k, v))
        mask_local = shard_tokens(mask_full, s, me, dim=3, after=text)
        for kind, m in (("local", mask_local), ("full", mask_full)):
            out = attn(ql, kl, vl, _sdpa, layout="BHLD", after=text, mask=m, key="a")
            res["errors"][(mode, "mask", kind)] = rel(gather_tokens(out, s, ctx, dim=2, after=text), want)
            res["modes"][(mode, "mask")] = attn.last_mode.value
        # a local mask that masks some image keys cannot be completed without the peers' columns: refused
        bad = mask_local.clone()
        bad[..., 0] = False  # every rank masks its first image key
        try:
            attn(ql, kl, vl, _sdpa, layout="BHLD", after=text, mask=bad, key="a")
            res["bad_mask"] = "accepted"
        except NotImplementedError as e:
            res["bad_mask"] = str(e)
        # cross-attention: keys/values of replicated text, nothing exchanged
        tq = shard(qf[:, :, text:], 0, 0)
        with log_comm() as log:
            out = attn(tq, kf[:, :, :text], vf[:, :, :text], _sdpa, layout="BHLD", cross=True)
        res["cross_calls"] = log.total_calls
        res["errors"][(mode, "cross", "BHLD")] = rel(gather_tokens(out, s, ctx, dim=2), F.scaled_dot_product_attention(qf[:, :, text:], kf[:, :, :text], vf[:, :, :text]))
    auto = SequenceAttention(state, "auto")
    auto(shard(qf, text, 0), shard(kf, text, 0), shard(vf, text, 0), _sdpa, before=text, key="a")
    res["auto_mode"] = auto.last_mode.value
    # on a group whose exchanges run on their own stream (NCCL) auto hides the gather it picks behind the attention
    # (overlapped at 2 ranks, ring from 3; same bytes); the rule reads the context's backend, so a gloo group labelled
    # NCCL takes that branch and still computes for real
    import dataclasses

    nstate = SequenceState(dataclasses.replace(ctx, backend="nccl"), Traffic())
    nstate.set_grid(frames, rows, cols)
    auto = SequenceAttention(nstate, "auto")
    out = auto(shard(qf, text, 0), shard(kf, text, 0), shard(vf, text, 0), _sdpa, before=text, key="a")
    res["auto_nccl"] = (auto.last_mode.value, rel(gather_tokens(out, s, ctx, dim=2, before=text),
                                                  F.scaled_dot_product_attention(qf, kf, vf)))
    # ... unless the caller's attention function is one the user chose: auto keeps it (gathered)
    auto(shard(qf, text, 0), shard(kf, text, 0), shard(vf, text, 0), _sdpa, before=text, key="a", custom=True)
    res["auto_nccl_custom"] = auto.last_mode.value

    # displaced K/V over three steps: step 0 synchronous (exact), then remote K/V one step old
    traffic = Traffic()
    dstate = SequenceState(ctx, traffic, memory=lambda c, rows, t: CommManager(c, rows, t))
    dstate.set_grid(frames, rows, cols)
    dattn = SequenceAttention(dstate, "gathered", kv=DISPLACED)
    steps = [tuple(torch.randn(b, heads, L, d, generator=g) for _ in range(3)) for _ in range(3)]
    order = s.order()
    res["displaced"] = []
    for step, (q, k, v) in enumerate(steps):
        dstate.begin_step(step, sync=step == 0)
        before_bytes = dict(traffic.bytes), dict(traffic.async_bytes), dict(traffic.collectives)
        out = dattn(shard(q, 0, 0), shard(k, 0, 0), shard(v, 0, 0), _sdpa, key="blk")
        dstate.end_step()
        # the expected keys: this rank's tokens from this step, every other rank's from the previous step
        prev = steps[max(step - 1, 0)]
        kk, vv = prev[1].clone(), prev[2].clone()
        mine = s.index(me)
        kk[:, :, mine], vv[:, :, mine] = k[:, :, mine], v[:, :, mine]
        want_local = F.scaled_dot_product_attention(q[:, :, mine], kk, vv)
        res["displaced"].append({
            "err": rel(out, want_local),
            "kv_bytes": traffic.bytes["kv"] - before_bytes[0]["kv"],
            "kv_async": traffic.async_bytes["kv"] - before_bytes[1]["kv"],
            "kv_collectives": traffic.collectives["kv"] - before_bytes[2]["kv"],
        })
    dstate.finish()
    res["packed_kv_bytes"] = b * s.counts[me] * 2 * heads * d * 4
    return res


@functools.lru_cache(maxsize=None)
def _core(n):
    return run_ranks(_core_task, n)


@pytest.mark.parametrize("n", [2, 3])
def test_gathered_overlapped_and_ulysses_equal_one_rank_attention(n):
    for rank, res in enumerate(_core(n)):
        assert res["roundtrip_equal"], rank
        bad = {k: e for k, e in res["errors"].items() if not e <= TOL}
        assert not bad, (n, rank, bad)
        assert res["modes"][("gathered", "before")] == "gathered" and res["modes"][("ulysses", "before")] == "ulysses"
        for mode in ("overlapped", "ring"):
            assert res["modes"][(mode, "before")] == res["modes"][(mode, "after")] == mode
            assert res["modes"][(mode, "mask")] == "gathered"  # a masked call runs gathered
        mode, err = res["auto_nccl"]
        assert mode == ("overlapped" if n == 2 else "ring"), mode  # auto hides the exchange behind the attention
        assert res["auto_nccl_custom"] == "gathered"
        assert err <= TOL, err
        assert res["cross_calls"] == 0
        assert "differs between image keys" in res["bad_mask"], res["bad_mask"]


@pytest.mark.parametrize("n", [2, 3])
def test_each_mode_moves_the_modelled_bytes(n):
    for rank, res in enumerate(_core(n)):
        for key, counted in res["cost"].items():
            assert res["bytes"][key] == counted, (n, rank, key, res["bytes"][key], counted)
        # at N = 2 Ulysses moves as many bytes as gathered, in more messages: auto keeps gathered
        if n == 2:
            assert res["auto_mode"] == "gathered"


@pytest.mark.parametrize("n", [2, 3])
def test_displaced_kv_uses_the_previous_steps_remote_kv(n):
    for rank, res in enumerate(_core(n)):
        steps = res["displaced"]
        assert all(s["err"] <= TOL for s in steps), (n, rank, steps)
        kv = res["packed_kv_bytes"] * (n - 1)  # this rank's packed K/V to each of N-1 peers
        # step 0: exact, blocking all-gather; later steps: the same bytes, sent asynchronously behind compute
        assert steps[0]["kv_bytes"] == kv and steps[0]["kv_async"] == 0 and steps[0]["kv_collectives"] == 1, steps[0]
        for s in steps[1:]:
            assert s["kv_bytes"] == kv and s["kv_async"] == kv and s["kv_collectives"] == 1, s


def test_a_local_key_mask_is_verified_once_and_inference_masks_every_call():
    from patchray.distributed.parallel.sequence import _key_mask

    order = torch.arange(12)
    # 9 local keys: 6 image + 3 text (after); 12 image keys in all
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., -1] = False  # a padded text token
    checked = {}
    full = _key_mask(mask, 9, 15, 0, 3, 12, order, "p", checked)
    assert full.shape == (2, 1, 1, 15) and full[..., :12].all() and not full[0, ..., -1] and full[1, ..., -1]
    assert checked  # remembered: the next blocks' calls with this tensor skip the check (no host sync)
    with torch.inference_mode():  # ComfyUI samples under inference_mode: no version counter, checked every call
        inf = mask.clone()
        checked = {}
        assert torch.equal(_key_mask(inf, 9, 15, 0, 3, 12, order, "p", checked), full) and not checked
        inf[..., 2] = False  # masks an image key: refused
        with pytest.raises(NotImplementedError, match="differs between image keys"):
            _key_mask(inf, 9, 15, 0, 3, 12, order, "p", checked)
