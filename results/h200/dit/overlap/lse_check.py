"""Device check of the overlapped mode's attention parts (``parallel/seq_overlap.py``) on CUDA: every kernel path
(cuDNN / flash for bf16, memory-efficient for fp32) against ``F.scaled_dot_product_attention`` over the whole key
set, the keys split into 2 and 4 parts and merged by log-sum-exp; then the parts' kernel time against one SDPA call
(FLUX.1's shape at 2 ranks: 24 heads x 128, 2,304 queries per rank over 4,608 keys)."""

import json
import sys

import torch
import torch.nn.functional as F

from patchray.distributed.parallel.seq_overlap import _merge, attention_lse, merge_parts


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def split_merge(q, k, v, parts, merge=merge_parts):
    outs, lses = zip(*[attention_lse(q, kk, vv) for kk, vv in zip(k.chunk(parts, dim=2), v.chunk(parts, dim=2))])
    return merge(list(outs), list(lses))


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


out = {}
g = torch.Generator(device="cuda").manual_seed(0)
for dtype, lq, lk in ((torch.bfloat16, 2304, 4608), (torch.float32, 333, 1001), (torch.float16, 1152, 4608)):
    q, k, v = (torch.randn(1, 24, n, 128, device="cuda", dtype=dtype, generator=g) for n in (lq, lk, lk))
    want = F.scaled_dot_product_attention(q, k, v)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    row = {"sdpa_vs_fp64": rel(want, exact)}
    for parts in (1, 2, 4):
        row[f"parts{parts}_vs_fp64"] = rel(split_merge(q, k, v, parts), exact)
        row[f"parts{parts}_eager_vs_fp64"] = rel(split_merge(q, k, v, parts, _merge), exact)
    out[str(dtype)] = row
q, k, v = (torch.randn(1, 24, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for n in (2304, 4608, 4608))
out["ms"] = {"sdpa_whole": timed(lambda: F.scaled_dot_product_attention(q, k, v)),
             "lse_whole": timed(lambda: attention_lse(q, k, v)),
             "half_keys": timed(lambda: attention_lse(q, k[:, :, :2304], v[:, :, :2304])),
             "two_parts_merged": timed(lambda: split_merge(q, k, v, 2)),
             "two_parts_merged_eager": timed(lambda: split_merge(q, k, v, 2, _merge)),
             "four_parts_merged": timed(lambda: split_merge(q, k, v, 4)),
             "four_parts_merged_eager": timed(lambda: split_merge(q, k, v, 4, _merge))}
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)
