"""OTIL exchange properties on real gloo ranks, uneven bands, N = 2, 3, 4.

* the local band comes out bit-exact fresh;
* every remote block is either the block received this step (bit-exact the peer's fresh block) or the stale
  value of the previous step, never a blend;
* exactly k blocks arrive from each peer, all distinct;
* every block of every band is received within ceil(K / k) steps of a synchronisation;
* finalize() returns the exact full tensor on every rank;
* a step makes no host synchronisation (no Tensor.item/tolist/__bool__ call);
* compressed sending (4-bit residuals): non-received blocks stale, and error feedback drives the remote error down
  when a band stops changing.
"""

from __future__ import annotations

import math

import pytest
import torch

from patchray.distributed.spawn import run_ranks

ROWS = (16, 12, 20, 8)  # uneven bands (blocks of 8: partial blocks in the 12- and 20-row bands)
WIDTH = 20  # partial blocks along the width too
B, C, BS = 2, 4, 8
STEPS = 7


def _fresh(rows, t):
    """Every rank's fresh band at step t, from a shared seed (so each rank knows its peers' values)."""
    out = []
    for r, h in enumerate(rows):
        g = torch.Generator().manual_seed(1000 * r + 1)
        base = torch.randn(B, C, h, WIDTH, generator=g)
        g2 = torch.Generator().manual_seed(1000 * r + 7 + t)
        # uneven change per position so the dissimilarity ranking is non-trivial
        out.append(base + 0.3 * t * torch.randn(B, C, h, WIDTH, generator=g2) * torch.rand(1, 1, h, WIDTH, generator=g2))
    return out


from patchray.distributed.bench.sample_bench import HostSyncCounter as _SyncCounter  # noqa: E402


def _otil_rank(ctx, bits):
    from patchray.distributed.sampling.otil import OtilExchange

    rows = ROWS[: ctx.world_size]
    me = ctx.rank
    bounds = [sum(rows[:r]) for r in range(len(rows) + 1)]
    nbs = [math.ceil(h / BS) * math.ceil(WIDTH / BS) for h in rows]
    ks = [max(1, math.ceil(0.25 * nb)) for nb in nbs]
    ex = OtilExchange(ctx, rows, B, C, WIDTH, torch.float32, torch.device("cpu"), BS, ks, compress_bits=bits)
    res = {"local_exact": True, "never_blend": True, "received_exact": True, "k_exact": True, "syncs": 0, "coverage_steps": {}}
    full0 = torch.cat(_fresh(rows, 0), dim=2)
    ex.sync(full0)
    prev = full0
    seen = {r: torch.zeros(nbs[r], dtype=torch.bool) for r in range(ctx.world_size)}
    for t in range(1, STEPS + 1):
        fresh = _fresh(rows, t)
        with _SyncCounter() as sc:
            out = ex.step(fresh[me])
        res["syncs"] += sc.count
        res["local_exact"] &= torch.equal(out[:, :, bounds[me] : bounds[me + 1]], fresh[me])
        for r in range(ctx.world_size):
            if r == me:
                continue
            got = ex.to_blocks(out[:, :, bounds[r] : bounds[r + 1]])
            old = ex.to_blocks(prev[:, :, bounds[r] : bounds[r + 1]])
            new = ex.to_blocks(fresh[r])
            idx = ex.last_received[r]
            res["k_exact"] &= idx.numel() == ks[r] and idx.unique().numel() == ks[r]
            received = torch.zeros(nbs[r], dtype=torch.bool)
            received[idx] = True
            is_old = (got == old).all(dim=1)
            is_new = (got == new).all(dim=1)
            # non-received blocks: exactly stale; received blocks: exactly fresh (uncompressed) or changed (compressed)
            res["never_blend"] &= bool(is_old[~received].all())
            if bits == 0:
                res["received_exact"] &= bool(is_new[received].all())
                res["never_blend"] &= bool((is_old | is_new).all())
            seen[r] |= received
            if bool(seen[r].all()) and r not in res["coverage_steps"]:
                res["coverage_steps"][r] = t
        prev = out
    res["ks"], res["nbs"] = ks, nbs
    # finalize: every rank's own band of some tensor -> the exact full tensor everywhere
    lat = [torch.randn(1, 4, h, WIDTH, generator=torch.Generator().manual_seed(50 + r)) for r, h in enumerate(rows)]
    res["finalize_exact"] = torch.equal(ex.finalize(lat[me]), torch.cat(lat, dim=2))
    if bits:
        # error feedback: hold every band fixed; after 3 full rounds the remote error must have shrunk a lot
        fixed = _fresh(rows, STEPS + 5)
        errs = []
        for t in range(3 * max(math.ceil(nb / k) for nb, k in zip(nbs, ks))):
            out = ex.step(fixed[me])
            errs.append(max((out[:, :, bounds[r] : bounds[r + 1]] - fixed[r]).abs().max().item() for r in range(ctx.world_size) if r != me))
        res["ef_errs"] = errs
    return res


def _otil_both(ctx):
    return {bits: _otil_rank(ctx, bits) for bits in (0, 4)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_otil_self_test_properties(n):
    both = run_ranks(_otil_both, n, timeout_s=120)
    for bits in (0, 4):
        for rank, res in enumerate(r[bits] for r in both):
            tag = f"N={n} bits={bits} rank {rank}"
            assert res["local_exact"], f"{tag}: the local band must come out bit-exact fresh"
            assert res["never_blend"], f"{tag}: a remote block was neither received nor stale"
            assert res["k_exact"], f"{tag}: a peer did not deliver exactly k distinct blocks"
            assert res["finalize_exact"], f"{tag}: finalize() must return the exact tensor"
            assert res["syncs"] == 0, f"{tag}: {res['syncs']} host synchronisations in OTIL steps"
            if bits == 0:
                assert res["received_exact"], f"{tag}: received blocks must equal the peer's fresh blocks"
            for r in range(n):
                if r == rank:
                    continue
                bound = math.ceil(res["nbs"][r] / res["ks"][r])
                assert res["coverage_steps"].get(r, 10**9) <= bound, f"{tag}: peer {r} covered after {res['coverage_steps'].get(r)} > ceil(K/k)={bound}"
            if bits:
                errs = res["ef_errs"]
                # 4-bit absmax residuals: each resend cuts the residual by ~1/(2*7); three rounds leave < 1% of the
                # first round's error (a no-feedback scheme would stay at the first round's quantisation error)
                assert errs[-1] < 0.01 * errs[0], f"{tag}: error feedback did not converge: {errs}"
