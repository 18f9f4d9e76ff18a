"""One GPU, no ranks: what fewer launches would give a FLUX.1 call at full width: eager vs ``torch.compile`` vs a
CUDA graph, at the whole call's token count and at a sequence rank's row count.

For each token count (the whole 1024x1024 call: 4,096 image + 512 text tokens; "half": 2,048 image + 256 text
tokens, the GEMM rows of a sequence rank at N = 2 with text sharded, whose attention is half a rank's) and each way
of running the same diffusers FluxTransformer2DModel (random bf16 weights, released configuration):

* ``eager``: diffusers' forward as is;
* ``compiled``: ``torch.compile`` of each transformer block (inductor, default mode: fused elementwise kernels,
  no CUDA graphs), the way a compiled block between two collectives would run in a sequence rank;
* ``graph``: the eager forward captured once in a CUDA graph and replayed (no launch cost at all; kernels as eager).

Per call: host wall time (synchronised), GPU time (CUDA events around a call queued behind a GPU spin, so launch
gaps are hidden when the CPU keeps ahead), CPU issue time (host time to return from the forward, before the sync),
and the kernel count (one profiled call).

    python3 results/h200/dit/compile_probe.py --out compile_probe.json
"""

import argparse
import json
import time

import torch

from patchray.distributed.bench.dit_models import PRESETS, build_random, make_inputs
from patchray.distributed.bench.turns import GpuSpin


def _kernels(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)


def _time(fn, iters: int, spin_ms: float) -> dict:
    dev = torch.device("cuda")
    walls, gpus, issues = [], [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        GpuSpin.enqueue(dev, spin_ms)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        issues.append((time.perf_counter() - t0) * 1e3)
        queued = not a.query()
        b.record()
        b.synchronize()
        gpus.append((a.elapsed_time(b), queued))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {"wall_ms": round(med(walls), 2), "gpu_ms": round(med([g for g, _ in gpus]), 2),
            "queued": all(q for _, q in gpus), "issue_ms": round(med(issues), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="compile_probe.json")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    base = PRESETS["flux1_1024"]
    model = build_random(base, "full", dev, torch.bfloat16, seed=0)
    GpuSpin.cycles_per_ms(dev)
    doc = {"model": base.title, "dtype": "bf16", "cases": [], "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(dev)}
    sizes = {"whole (4096 + 512 tokens)": base, "half rows (2048 + 256 tokens)": base._replace(grid_full=(1, 32, 64), text_full=256)}
    for label, preset in sizes.items():
        inp = make_inputs(preset, "full", dev, torch.bfloat16, seed=1)[0]
        call = lambda: model(**inp)
        with torch.no_grad():
            for _ in range(2):
                call()
            rec = {"size": label, "way": "eager", **_time(call, args.iters, 400.0), "kernels": _kernels(call)}
            print(rec, flush=True)
            doc["cases"].append(rec)
            # CUDA graph of the eager forward
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    call()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = call()
                rec = {"size": label, "way": "graph", **_time(g.replay, args.iters, 20.0), "kernels": _kernels(g.replay)}
                del g, out
            except Exception as exc:  # recorded, the probe goes on
                rec = {"size": label, "way": "graph", "error": f"{type(exc).__name__}: {exc}"[:400]}
            print(rec, flush=True)
            doc["cases"].append(rec)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    if not args.skip_compile:
        blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
        t0 = time.perf_counter()
        for b in blocks:
            b.compile()
        for label, preset in sizes.items():
            inp = make_inputs(preset, "full", dev, torch.bfloat16, seed=1)[0]
            call = lambda: model(**inp)
            try:
                with torch.no_grad():
                    t1 = time.perf_counter()
                    for _ in range(2):
                        call()
                    torch.cuda.synchronize()
                    warm = time.perf_counter() - t1
                    rec = {"size": label, "way": "compiled", "compile_and_warmup_s": round(warm, 1),
                           **_time(call, args.iters, 400.0), "kernels": _kernels(call)}
            except Exception as exc:
                rec = {"size": label, "way": "compiled", "error": f"{type(exc).__name__}: {exc}"[:400]}
            print(rec, flush=True)
            doc["cases"].append(rec)
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
        doc["compile_total_s"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
