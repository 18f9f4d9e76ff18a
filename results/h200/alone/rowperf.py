"""Row-decode compute measured alone, before and after, on one device: one spawn of 4 ranks, N = 1, 2 and 4.

What it does (every figure is one rank's compute with the device to itself, by turn-taking:
``patchray.distributed.bench.measure.measure_alone``; the N-device figures are models built from it):

* four gloo rank processes share the device; groups {0} (the plain decode: the reference), {0, 1} and
  {0, 1, 2, 3}; ranks outside a group wait at a barrier while it runs;
* each code tree given (``--trees new`` = the package ``patchray``, ``old`` = a second copy of the package
  importable as ``patchray_old``: the code before the change) decodes the same latent with the same weights;
* per case: the plain decode's time (CUDA events, median), then per N and tree the turn-taking compute
  (sum over stages of the slowest rank: ``linkmodel.summarise_alone``; ``--alone-clock prefilled``, the default:
  GPU time behind a prefilled launch queue, the CPU's issue time beside it and the longer of the two per
  invocation; ``idle``: each stage timed from an idle GPU), the busiest rank, the ratio to the plain decode
  (``ratio``; ``ratio_gpu`` for the GPU time alone), collective counts;
* ``--profile CASE:N:TREE`` profiles rank 1's turn-taking decode (torch.profiler, CPU + CUDA activities) and
  writes the kernel table plus a summary grouped by adapter (``rp:`` ranges set around the adapters' functions
  while profiling) and by kernel kind; ``compute_kernel_ms`` is the sum of its kernels without the clock's spin
  and without gloo's staging of CUDA tensors through host memory (its host<->device copies and ranges: ranks on
  separate GPUs exchanging with NCCL do not run them), and the case's plain decode is profiled once too
  (``plain.kernel_ms``), so ``compute_kernel_ms / plain.kernel_ms`` compares kernels with kernels;
* ``--check`` compares row decode against the plain decode in fp32 on the device (kl, small) for the new tree.

Run from the repository root with both packages on the path, e.g. (the device command in README.md):
    python3 results/h200/alone/rowperf.py --out $OUT --cases kl:2048x2048 wan:720x1280x81 --profile kl:2048x2048:4:new
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import re
import statistics
import sys
import time


def _pkg(tree):
    return importlib.import_module("patchray" if tree == "new" else "patchray_old")


def _parse_case(text):
    fam, shape = text.split(":")[:2]
    dims = [int(v) for v in shape.split("x")]
    h, w, f = dims[0], dims[1], dims[2] if len(dims) > 2 else 1
    return fam, h, w, f


# ------------------------------------------------------------------------------------------- profiling


_RANGES = {  # module path -> function names wrapped in an rp: range while profiling (the adapters' entry points)
    "distributed.parallel.conv": ["conv_rows", "_edge_rows"],
    "distributed.parallel.resnet": ["resnet_rows", "exact_group_norm_coefficients", "_norm_silu"],
    "distributed.parallel.groupnorm": ["exact_group_norm", "exact_group_norm_coefficients", "normalize_with",
                                       "group_stats", "group_sums"],
    "distributed.parallel.attention": ["_gather_kv", "chunked_attention", "frame_causal_attention"],
    "distributed.comm": ["exchange_halo", "gather_to", "all_gather_padded"],
    "distributed.vae.row": ["parallelize_vae"],
    "distributed.parallel.plan": ["undo_all"],
}


@contextlib.contextmanager
def _ranges(tree):
    import torch

    pkg = _pkg(tree).__name__
    saved = []
    for mod_name, names in _RANGES.items():
        try:
            mod = importlib.import_module(f"{pkg}.{mod_name}")
        except ImportError:
            continue
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None or not callable(fn):
                continue

            def wrap(f, label):
                @functools.wraps(f)
                def inner(*a, **k):
                    with torch.profiler.record_function(label):
                        return f(*a, **k)
                return inner

            saved.append((mod, name, fn))
            setattr(mod, name, wrap(fn, f"rp:{mod_name.split('.')[-1]}.{name}"))
    try:
        yield
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


_KINDS = [  # first match wins: attention before conv (the memory-efficient kernel is a CUTLASS one)
    ("attention", r"fmha|flash|attention|softmax|pytorch_flash|efficient"),
    ("conv", r"conv|xmma|implicit|cudnn|nchwToNhwc|nhwcToNchw|sm90_|cutlass|gemm|wgrad|dgrad|fprop"),
    ("groupnorm/batchnorm", r"batch_norm|group_norm|welford|Welford|RowwiseMoments|ComputeFusedParams|GroupNorm"),
    ("reduce", r"reduce_kernel|Reduce"),
    ("copy/cat/pad", r"copy|Memcpy|memcpy|CatArray|cat_|pad|constant_pad|Memset|fill"),
    ("upsample", r"upsample|interpolate|nearest"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]


def _kind(name):
    for kind, pat in _KINDS:
        if re.search(pat, name):
            return kind
    return "other"


#: device events that are not the rank's compute: the clock's busy-wait, and gloo's staging of CUDA tensors through
#: host memory (its copies and its own ranges), which ranks on separate GPUs exchanging with NCCL do not run
_NOT_COMPUTE = re.compile(r"spin_kernel|_sleep|Memcpy HtoD|Memcpy DtoH|^gloo:")


def _summarise_profile(prof):
    kernels, ranges, kinds = {}, {}, {}
    n_kernels = 0
    gpu_total = 0.0
    compute_total = 0.0
    cpu_ops = 0
    for e in prof.events():
        dev = str(getattr(e, "device_type", ""))
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if dev.endswith("CUDA") and e.name.startswith("rp:"):
            continue  # the GPU-side span of a range set here, not a kernel
        if dev.endswith("CUDA"):
            n_kernels += 1
            gpu_total += t
            if not _NOT_COMPUTE.search(e.name):
                compute_total += t
            kernels.setdefault(e.name, [0, 0.0])
            kernels[e.name][0] += 1
            kernels[e.name][1] += t
            k = _kind(e.name)
            kinds.setdefault(k, [0, 0.0])
            kinds[k][0] += 1
            kinds[k][1] += t
        elif e.name.startswith("rp:"):
            tot = getattr(e, "device_time_total", None)
            if tot is None:
                tot = getattr(e, "cuda_time_total", 0.0)
            ranges.setdefault(e.name, [0, 0.0, 0.0])
            ranges[e.name][0] += 1
            ranges[e.name][1] += tot
            ranges[e.name][2] += e.cpu_time_total
        elif e.name.startswith("aten::"):
            cpu_ops += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
    return {
        "gpu_kernel_ms": round(gpu_total / 1e3, 3),
        "compute_kernel_ms": round(compute_total / 1e3, 3),
        "kernels": n_kernels,
        "aten_ops": cpu_ops,
        "by_kind": {k: {"kernels": v[0], "ms": round(v[1] / 1e3, 3)} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
        "by_range": {k: {"calls": v[0], "gpu_ms_inclusive": round(v[1] / 1e3, 3), "cpu_ms_inclusive": round(v[2] / 1e3, 3)}
                     for k, v in sorted(ranges.items())},
        "top_kernels": [{"name": k[:160], "calls": v[0], "ms": round(v[1] / 1e3, 3)} for k, v in top],
    }


# ------------------------------------------------------------------------------------------- one rank


def _selfcheck(dev, q_len=16384, kv_len=65536):
    """Which GroupNorm and attention paths run on this device, their error against fp64, and SDPA timings."""
    import torch
    import torch.nn.functional as F

    gn = importlib.import_module("patchray.distributed.parallel.groupnorm")
    att = importlib.import_module("patchray.distributed.parallel.attention")
    ctxmod = importlib.import_module("patchray.distributed.context")
    res = {}
    g = torch.Generator(device="cpu").manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(2, 128, 96, 160, generator=g) * 3 + 1).to(dev, dtype)
        norm = torch.nn.GroupNorm(32, 128, eps=1e-6).to(dev, dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(128, generator=g) + 0.5)
            norm.bias.copy_(torch.randn(128, generator=g))
            ref = F.group_norm(x.double(), 32, norm.weight.double(), norm.bias.double(), norm.eps)
            stock = norm(x)
            ours = gn.exact_group_norm(x, norm, ctxmod.ParallelContext.single(dev))
        res[str(dtype)] = {"stock_max_abs_err": float((stock.double() - ref).abs().max()),
                           "ours_max_abs_err": float((ours.double() - ref).abs().max()),
                           "ours_vs_stock_max_abs": float((ours.double() - stock.double()).abs().max())}
    res["cuda_mixed_batch_norm"] = gn._CUDA_MIXED_BATCH_NORM["ok"]
    q = torch.randn(1, 1, q_len, 512, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, kv_len, 512, device=dev, dtype=torch.bfloat16)
    res["sdpa_fused_kl_mid_N4"] = att._fused_attention(q, kv, kv)
    timer = importlib.import_module("patchray.distributed.bench.measure")._Timer(dev)
    with torch.no_grad():
        for label, fn in (("one_call", lambda: F.scaled_dot_product_attention(q, kv, kv)),
                          ("four_chunks", lambda: torch.cat([F.scaled_dot_product_attention(c, kv, kv)
                                                             for c in q.split(q_len // 4, dim=-2)], dim=-2))):
            fn()
            res[f"sdpa_ms_{label}"] = round(statistics.median(timer.time_ms(fn)[0] for _ in range(3)), 3)
    del q, kv
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res



def _rank(ctx, args):
    import torch

    new = _pkg("new")
    comm = importlib.import_module("patchray.distributed.comm")
    measure = importlib.import_module("patchray.distributed.bench.measure")
    linkmodel = importlib.import_module("patchray.distributed.bench.linkmodel")
    families = importlib.import_module("patchray.distributed.vae.families")
    dev = ctx.device
    torch.cuda.set_device(dev) if dev.type == "cuda" else torch.set_num_threads(1)
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    sync = measure.sync_fn(dev)
    groups = {n: comm.new_group(list(range(n))) for n in args.ranks if 1 < n < ctx.world_size}
    sub = {n: (comm.context_for_group(groups[n], dev) if n in groups and ctx.rank < n else None) for n in groups}
    sub[ctx.world_size] = ctx
    rows = {t: importlib.import_module(f"{_pkg(t).__name__}.distributed.vae.row").row_decode for t in args.trees}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    out = {"cases": [], "checks": []}

    def log(msg):
        if ctx.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if ctx.rank == 0 and dev.type == "cuda":
        out["selfcheck"] = _selfcheck(dev)
        log(f"selfcheck {json.dumps(out['selfcheck'])}")
    comm.barrier(ctx)
    if args.check:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        for fam, h, w, f in map(_parse_case, args.check):
            vae = families.build_vae(fam, size=args.size, seed=0, dtype=torch.float32, device=dev)
            z = torch.randn(families.latent_shape(fam, h, w, f, size=args.size), generator=torch.Generator().manual_seed(1)).to(dev)
            ref = vae.decode(z, return_dict=False)[0] if ctx.rank == 0 else None
            for n in sorted(sub):
                c = sub[n]
                res = None
                if c is not None:
                    with torch.no_grad():
                        res = rows["new"](vae, z, c)
                comm.barrier(ctx)
                if ctx.rank == 0:
                    diff = (res.float() - ref.float()).abs().max().item()
                    out["checks"].append({"case": f"{fam}:{h}x{w}x{f}", "dtype": "fp32", "ranks": n, "tree": "new",
                                          "max_abs_diff": diff, "ok": diff <= 1e-4})
                    log(f"check {fam} {h}x{w}x{f} N={n}: max abs diff {diff:.3g}")
            del vae, z, ref
            torch.cuda.empty_cache() if dev.type == "cuda" else None
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = True

    profiles = {}
    for spec in args.profile:
        parts = spec.split(":")
        profiles.setdefault(":".join(parts[:2]), []).append((int(parts[2]), parts[3]))

    for case in args.cases:
        fam, h, w, f = _parse_case(case)
        label = f"{fam}:{h}x{w}x{f}"
        vae = families.build_vae(fam, size=args.size, seed=0, dtype=dtype, device=dev)
        z = torch.randn(families.latent_shape(fam, h, w, f, size=args.size), generator=torch.Generator().manual_seed(1))
        z = z.to(device=dev, dtype=dtype)
        rec = {"case": label, "family": fam, "shape": [h, w, f], "dtype": args.dtype, "plain": None, "row": []}
        with torch.no_grad():
            # the reference: the plain decode on rank 0 alone (CUDA events), what the ratios divide by
            if ctx.rank == 0:
                for _ in range(args.warmup):
                    families.plain_decode(vae, z)
                times = []
                for _ in range(args.iters_plain):
                    sync()
                    t, _ = measure._Timer(dev).time_ms(lambda: families.plain_decode(vae, z))
                    times.append(t)
                rec["plain"] = {"ms": round(statistics.median(times), 3), "iterations": [round(t, 3) for t in times]}
                log(f"{label} plain {rec['plain']['ms']} ms")
                if label in profiles and dev.type == "cuda":
                    # the kernel-time reference of the profiled ranks' kernel time: one plain decode's kernels
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        families.plain_decode(vae, z)
                        sync()
                    summ = _summarise_profile(prof)
                    rec["plain"]["kernel_ms"] = summ["compute_kernel_ms"]
                    rec["plain"]["kernels"] = summ["kernels"]
                    # by kind too, to set a rank's kinds against the whole decode's (copies, conversions, convs)
                    rec["plain"]["by_kind"] = summ["by_kind"]
                    rec["plain"]["top_kernels"] = summ["top_kernels"][:25]
                    log(f"{label} plain kernels {summ['compute_kernel_ms']} ms ({summ['kernels']} kernels); by kind "
                        f"{json.dumps({k: v['ms'] for k, v in summ['by_kind'].items()})}")
            comm.barrier(ctx)
            for n in args.ranks:
                if n == 1:
                    continue
                for tree, clock in [(t, k) for t in args.trees for k in args.alone_clock]:
                    c = sub.get(n)
                    entry = None
                    if c is not None:
                        fn = functools.partial(rows[tree], vae, z, c)
                        # warm-up (allocator, cuDNN plans of the band shapes): the trees share band shapes, so
                        # the first tree's warm-up serves both
                        first = tree == args.trees[0] and clock == args.alone_clock[0]
                        for _ in range(args.warmup if first else min(args.warmup, 0)):
                            fn()
                        iters = args.iters if tree == "new" else args.iters_old
                        runs = measure.measure_alone(c, fn, iters, clock)
                        everyone = comm.all_gather_object(runs, c)
                        if c.rank == 0:
                            summary = linkmodel.summarise_alone(everyone, n)
                            summary.pop("note", None)
                            entry = {"ranks": n, "tree": tree, **summary}
                            entry["per_rank_stage_ms"] = [[round(x, 3) for x in r[0]["compute_ms"]] for r in everyone]
                            if all("launch_ms" in r[0] for r in everyone):
                                entry["per_rank_stage_launch_ms"] = [[round(x, 3) for x in r[0]["launch_ms"]] for r in everyone]
                            if all("host_syncs" in r[0] for r in everyone):
                                entry["per_rank_stage_host_syncs"] = [r[0]["host_syncs"] for r in everyone]
                            if rec["plain"]:
                                entry["ratio"] = round(summary["compute_ms"] / rec["plain"]["ms"], 4)
                                if summary.get("gpu_ms") is not None:  # the GPU time alone (no launch bound)
                                    entry["ratio_gpu"] = round(summary["gpu_ms"] / rec["plain"]["ms"], 4)
                                entry["ratio_busiest"] = round(max(summary["compute_ms_by_rank"]) / rec["plain"]["ms"], 4)
                            log(f"{label} N={n} {tree} ({summary.get('clock')}): compute {summary['compute_ms']:.1f} ms "
                                f"(gpu {summary.get('gpu_ms')}, issue {summary.get('launch_ms')}, host-sync stages "
                                f"{summary.get('host_sync_stages')}, queued {summary.get('queued_stages')}), "
                                f"ratio {entry.get('ratio')} (gpu {entry.get('ratio_gpu')}), "
                                f"by rank {[round(v, 1) for v in summary['compute_ms_by_rank']]}, "
                                f"collectives {summary['collectives']}")
                        for pn, ptree in profiles.get(label, []):
                            if (pn, ptree) != (n, tree) or clock != args.alone_clock[0]:
                                continue
                            prank = min(1, n - 1)
                            from torch.profiler import ProfilerActivity, profile

                            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                            prof_ctx = profile(activities=acts, record_shapes=True) if c.rank == prank else contextlib.nullcontext()
                            with _ranges(tree) if c.rank == prank else contextlib.nullcontext():
                                with prof_ctx as prof:
                                    runs = measure.measure_alone(c, fn, 1, clock)
                            if c.rank == prank:
                                summ = _summarise_profile(prof)
                                # the prefilled clock runs one untimed pilot invocation before the timed one: the
                                # profile holds both decodes' kernels
                                summ["invocations"] = 2 if measure.resolve_clock(dev, clock) == "gpu-prefilled" else 1
                                summ["compute_kernel_ms_per_decode"] = round(summ["compute_kernel_ms"] / summ["invocations"], 3)
                                summ["stage_compute_ms"] = round(sum(runs[0]["compute_ms"]), 3)
                                summ["stages"] = len(runs[0]["compute_ms"])
                                tag = f"{fam}-{h}x{w}x{f}-N{n}-{tree}-rank{prank}"
                                with open(os.path.join(args.out, f"profile-{tag}.txt"), "w") as fh:
                                    fh.write(json.dumps(summ, indent=1) + "\n\n")
                                    fh.write(prof.key_averages(group_by_input_shape=True).table(
                                        sort_by="self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total",
                                        row_limit=60, max_name_column_width=60, max_shapes_column_width=70))
                                sys.stdout.flush()
                                print(f"profile {tag}: stage compute {summ['stage_compute_ms']} ms, kernels "
                                      f"{summ['kernels']} ({summ['gpu_kernel_ms']} ms busy, {summ['compute_kernel_ms']} ms "
                                      f"without the clock's spin and gloo's staging), aten ops {summ['aten_ops']}; "
                                      f"by kind {json.dumps({k: v['ms'] for k, v in summ['by_kind'].items()})}", flush=True)
                                entry_p = {"tag": tag, **{k: v for k, v in summ.items() if k != "top_kernels"}}
                                out.setdefault("profiles", []).append(entry_p)
                            comm.barrier(c)
                    comm.barrier(ctx)
                    if entry is not None:
                        rec["row"].append(entry)
                        with open(os.path.join(args.out, "rowperf.json"), "w") as fh:
                            json.dump({**out, "cases": out["cases"] + [rec]}, fh, indent=1)
        if ctx.rank == 0:
            out["cases"].append(rec)
            with open(os.path.join(args.out, "rowperf.json"), "w") as fh:
                json.dump(out, fh, indent=1)
        del vae, z
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        comm.barrier(ctx)
    # profiles were made on rank 1: hand them to rank 0's record
    prof_all = comm.all_gather_object(out.get("profiles", []), ctx)
    if ctx.rank == 0:
        out["profiles"] = [p for ps in prof_all for p in ps]
        with open(os.path.join(args.out, "rowperf.json"), "w") as fh:
            json.dump(out, fh, indent=1)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="+", default=["kl:2048x2048"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--trees", nargs="+", default=["new"])
    p.add_argument("--profile", nargs="*", default=[], help="CASE:N:TREE, e.g. kl:2048x2048x1:4:new")
    p.add_argument("--check", nargs="*", default=[], help="fp32 exactness cases for the new tree, e.g. kl:256x256")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--size", default="full", help="full (the released architectures) or tiny (a CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--iters-old", type=int, default=1)
    p.add_argument("--iters-plain", type=int, default=3)
    p.add_argument("--alone-clock", nargs="+", choices=["prefilled", "idle"], default=["prefilled"],
                   help="CUDA turn-taking clock(s) (bench.measure), each measured in turn: prefilled (GPU time + CPU "
                        "issue time) and/or idle (each stage from an idle GPU: the earlier clock)")
    args = p.parse_args(argv)
    args.profile = [":".join([s.split(":")[0], "x".join((s.split(":")[1].split("x") + ["1"])[:3])] + s.split(":")[2:])
                    for s in args.profile]
    os.makedirs(args.out, exist_ok=True)
    spawn = importlib.import_module("patchray.distributed.spawn")
    world = max(args.ranks)
    t0 = time.time()
    spawn.run_ranks(_rank, world, args, backend="gloo", device=args.device, timeout_s=560)
    print(f"done in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
