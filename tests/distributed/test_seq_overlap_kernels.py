"""The attention-with-log-sum-exp kernels behind the overlapped and ring modes (``parallel/seq_overlap.py``), on CPU.

The reference is written here, independently of the module: ``softmax(q k^T * scale) v`` by ``torch.softmax`` and the
log-sum-exp by ``torch.logsumexp`` over the same scores, in fp64. fp32 results must agree to 1e-5 relative (one
reduction order against another over at most a few hundred keys, unit round-off 6e-8); a kernel that returned the
wrong keys' or a mis-scaled result would be off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from patchray.distributed.parallel import seq_overlap as so


def _reference(q, k, v, scale):
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s, dim=-1), v.double()), torch.logsumexp(s, dim=-1)


def _inputs(b=2, h=3, lq=37, lk=53, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) for n in (lq, lk, lk))


def _rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_fused_cpu_kernel_returns_the_attention_and_its_log_sum_exp(scale):
    q, k, v = _inputs()
    out, lse = so.attention_lse(q, k, v, scale)
    ref_out, ref_lse = _reference(q, k, v, scale if scale is not None else 16 ** -0.5)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, 3, 37)
    assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-5


def test_the_unfused_fallback_works_in_query_chunks_under_its_memory_bound(monkeypatch):
    """A video model's whole score matrix would not fit a card: the fallback bounds the block it materialises and
    still returns the same attention (here 37 queries in chunks of 2)."""
    q, k, v = _inputs()
    per_query = 2 * 3 * 53 * 4 * 2
    monkeypatch.setattr(so, "_MATH_BLOCK_BYTES", 2 * per_query)
    seen = []
    real = torch.logsumexp

    def counting(x, *a, **kw):
        seen.append(x.shape[2])
        return real(x, *a, **kw)

    monkeypatch.setattr(so.torch, "logsumexp", counting)
    out, lse = so._math_lse(q, k, v, 0.25)
    monkeypatch.setattr(so.torch, "logsumexp", real)
    assert max(seen) == 2 and sum(seen) == 37  # every query once, never more than 2 at a time
    ref_out, ref_lse = _reference(q, k, v, 0.25)
    assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-5


def test_a_kernel_the_card_lacks_is_tried_once_and_out_of_memory_is_raised(monkeypatch):
    """Flash attention raises on cards before Ampere: the next kernel serves the call, and later calls with the same
    device, dtype and head size start past the failing one. An out-of-memory error is not swallowed into a larger
    fallback."""
    q, k, v = _inputs(d=24)  # a head size no other test uses: a fresh entry in the kernel cache
    calls = {"missing": 0, "cpu": 0}

    def missing(*a):
        calls["missing"] += 1
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    def cpu(*a):
        calls["cpu"] += 1
        return so._cpu(*a)

    monkeypatch.setattr(so, "_candidates", lambda q, d: [missing, cpu])
    monkeypatch.setattr(so, "_FIRST", {})
    for _ in range(3):
        out, lse = so.attention_lse(q, k, v)
    assert calls == {"missing": 1, "cpu": 3}
    ref_out, ref_lse = _reference(q, k, v, 24 ** -0.5)
    assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-5

    def oom(*a):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 GiB")

    monkeypatch.setattr(so, "_candidates", lambda q, d: [oom, cpu])
    monkeypatch.setattr(so, "_FIRST", {})
    with pytest.raises(torch.OutOfMemoryError):
        so.attention_lse(q, k, v)


def test_merging_parts_equals_attention_over_all_keys_and_the_compiled_merge_takes_new_sizes():
    """Attention over disjoint key sets, merged by their log-sum-exp, equals attention over their union; the merge
    compiled as on CUDA (static for the first shape, the changed dimensions symbolic from a second size on) serves
    a dozen sequence lengths without failing (a static graph per shape hits the recompile limit after eight and,
    with fullgraph, raises)."""
    q, k, v = _inputs(lk=60)
    parts = [so.attention_lse(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 17), (17, 40), (40, 60))]
    merged = so.merge_parts([o for o, _ in parts], [l for _, l in parts])
    ref_out, _ = _reference(q, k, v, 16 ** -0.5)
    assert _rel(merged, ref_out) < 1e-5
    fused = so.compile_merge()  # what merge_parts compiles on CUDA, here with Inductor's CPU kernels
    for lq in range(5, 17):
        outs = [torch.randn(1, 2, lq, 4) for _ in range(2)]
        lses = [torch.randn(1, 2, lq) for _ in range(2)]
        assert torch.allclose(fused(outs, lses), so._merge(outs, lses), rtol=1e-6, atol=1e-6)
