"""Measure all_reduce bus bandwidth in a fresh process group: ``python nccl_worker.py --devices 0,1 --out r.json``.

Design decision: this file is run as a *script in a new process* by :func:`..measure.measure_allreduce`, never
imported into a running PatchRay process. NCCL reads ``NCCL_P2P_DISABLE`` and friends once, when it first
initialises in a process, so the only reliable way to compare "P2P allowed" with "P2P disabled" is two fresh
processes with two environments. It talks to ``torch.distributed`` through ``comm.py`` like every other module,
but loads it *by path* (:func:`_comm`: ``comm.py``, the comm modules and ``context.py`` it imports, under a private package name,
without the package's ``__init__``), so it runs the same whether PatchRay was pip-installed or loaded by ComfyUI from a folder
with any name. Ranks meet through a ``FileStore`` in a temporary folder: no ports, so no free-port race.

Bus bandwidth follows nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * 2 (n - 1) / n`` for all_reduce,
which makes figures comparable across GPU counts and with the link's own bandwidth.
"""

import argparse
import datetime
import json
import os
import sys
import time


def _comm():
    """``distributed/comm.py`` loaded from the folder above this file under a private package name."""
    import importlib
    import types

    name = "_patchray_nccl_worker_distributed"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        sys.modules[name] = pkg
    return importlib.import_module(name + ".comm")


def _rank(rank: int, args, store_path: str) -> None:
    import torch

    comm = _comm()
    world = len(args.devices)
    if args.backend == "nccl":
        device = torch.device("cuda", args.devices[rank])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    comm.init_process_group(args.backend, store=comm.file_store(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    ctx = comm.context_for_group(None, device)
    x = torch.ones(max(1, args.bytes // 4), dtype=torch.float32, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        comm.all_reduce(x, ctx)
    sync()
    comm.barrier(ctx)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        comm.all_reduce(x, ctx)
    sync()
    dt = (time.perf_counter() - t0) / args.iters
    # every rank's dt differs slightly; report the slowest, which is what a collective costs
    t = torch.tensor([dt], dtype=torch.float64, device=device)
    comm.all_reduce(t, ctx, op="max")
    dt = float(t.item())
    if rank == 0:
        nbytes = x.numel() * 4
        algbw = nbytes / dt / 1e9
        result = {
            "backend": args.backend,
            "devices": args.devices,
            "world_size": world,
            "bytes": nbytes,
            "seconds_per_op": dt,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * 2 * (world - 1) / world,
            # what the ranks saw, so the caller can check its environment took effect
            "env": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE")},
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    comm.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", required=True, help="comma-separated CUDA indices (one rank each)")
    ap.add_argument("--bytes", type=int, default=64 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.devices = [int(d) for d in args.devices.split(",") if d.strip()]
    if len(args.devices) < 2:
        print("need at least two devices", file=sys.stderr)
        return 2
    import multiprocessing
    import tempfile

    # stdlib spawn, not torch.multiprocessing: this launcher never imports torch (only the ranks do), which
    # saves one slow torch import per measurement
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="patchray-nccl-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args, os.path.join(tmp, "store"))) for r in range(len(args.devices))]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout * 2
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if failed:
            print(f"ranks {failed} failed or timed out", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
