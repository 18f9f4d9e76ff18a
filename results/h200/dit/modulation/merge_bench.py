"""The log-sum-exp merge of N attention parts on CUDA: eager, compiled with every dimension symbolic (dynamic=True),
and compiled as the sampler now does (dynamic=None: static for the first shapes, automatic dynamic after a second
size). FLUX.1 at 1024x1024: 24 heads x 128, 2,304 (N = 2) or 1,152 (N = 4) query tokens per rank, bf16 outputs in
the layout PyTorch's fused attention returns them ([B, H, L, D] viewed over [B, L, H, D] memory), fp32 log-sum-exps.
Each figure: CUDA-event time per merge, median of 50 after 10 warm-ups. As run on the H200 these figures time the
Python call of a kernel of a few tens of microseconds (0.15-0.55 ms per call: launch-bound), so they do not rank the
kernels; the profiles of the FLUX.1 runs (call 2 and call 3) do. Kept as the record of what ran.

    python3 results/h200/dit/modulation/merge_bench.py OUT.json
"""

import json
import statistics
import sys

import torch

from patchray.distributed.parallel import seq_overlap as so


def parts(n, lq, h=24, d=128, b=1):
    outs = [torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(n)]
    lses = [torch.randn(b, h, lq, device="cuda", dtype=torch.float32) for _ in range(n)]
    return outs, lses


def timed(fn, outs, lses, reps=50):
    for _ in range(10):
        fn(outs, lses)
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(outs, lses)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return round(statistics.median(ms), 4)


def main(out):
    rows = []
    for n, lq in ((2, 2304), (4, 1152)):
        outs, lses = parts(n, lq)
        ref = so._merge(outs, lses).float()
        row = {"parts": n, "query_tokens": lq, "eager_ms": timed(so._merge, outs, lses)}
        for name, dyn in (("dynamic_true", True), ("dynamic_none_first_shape", None)):
            torch._dynamo.reset()
            f = so.compile_merge(dynamic=dyn)
            row[name + "_ms"] = timed(f, outs, lses)
            row[name + "_max_abs_vs_eager"] = float((f(outs, lses).float() - ref).abs().max())
        # the automatic-dynamic graph a second size leaves behind, timed on the first size again
        other = parts(n, lq + 64)
        f(*other)
        row["dynamic_none_after_a_second_size_ms"] = timed(f, outs, lses)
        rows.append(row)
        print(row, flush=True)
    with open(out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
