"""The cluster check behind ``python -m patchray probe``: correctness of the collectives, then bandwidth.

Design decision: the check runs the pack's own collectives (``comm.all_reduce``, ``comm.exchange_halo``) on the
real ranks, so what it reports is what a decode will see, including gloo's host staging of CUDA tensors and,
on a multi-node cluster, the network between the nodes (the report lists the Ray nodes the ranks run on).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from .. import comm
from ..context import ParallelContext
from .config import ClusterConfig
from .registry import get_cluster

__all__ = ["check_cluster"]


def _check_rank(ctx: ParallelContext, nbytes: int) -> dict:
    # all_reduce: sum of (rank + 1) over ranks is n(n+1)/2
    t = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    comm.all_reduce(t, ctx)
    expect = ctx.world_size * (ctx.world_size + 1) / 2
    all_reduce_ok = bool(torch.all(t == expect).item())
    # neighbour exchange: each rank sends its rank id; check what came back
    band = torch.full((2, 3), float(ctx.rank), device=ctx.device)
    halo = comm.exchange_halo(band, ctx, 0, [(1, 1)] * ctx.world_size)
    p2p_ok = (halo.before is None or bool(torch.all(halo.before == ctx.rank - 1).item())) and (
        halo.after is None or bool(torch.all(halo.after == ctx.rank + 1).item())
    )
    # bandwidth between neighbours: each rank sends nbytes to the previous one, timed after one warm-up
    numel = max(1, nbytes // 4)
    buf = torch.ones(numel, device=ctx.device)
    bw = None
    if ctx.world_size > 1:
        rows = [(0, numel)] * ctx.world_size  # everyone needs the whole tensor from the next rank
        big = buf.view(numel, 1)
        comm.exchange_halo(big, ctx, 0, rows)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        comm.barrier(ctx)
        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            comm.exchange_halo(big, ctx, 0, rows)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        dt = (time.perf_counter() - t0) / reps
        bw = (numel * 4) / dt / 1e9
    return {"rank": ctx.rank, "all_reduce_ok": all_reduce_ok, "p2p_ok": p2p_ok, "send_gbps_to_next": bw}


_check_rank.patchray_task = "checking the cluster"


def check_cluster(config: Optional[ClusterConfig] = None, nbytes: int = 8 << 20,
                  cancel_check: Optional[Callable[[], None]] = None) -> dict:
    """Form (or reuse) the cluster, check an all_reduce and a neighbour exchange, sample bandwidth.

    Returns a JSON-ready dict: ranks, devices, backend, seconds_to_ready, all_reduce_ok, p2p_ok and
    ``bandwidth_gbps`` per neighbour pair (GB/s of one-way payload, measured with the pack's own
    halo exchange, so on gloo+CUDA it includes the host staging), ``nodes`` (the Ray node ids the ranks run
    on) and ``node_of_rank``; a pair whose ranks sit on different nodes measures the network between them.
    ``cancel_check`` is polled while a new cluster starts and while the ranks check (see :func:`get_cluster`).
    """
    t0 = time.perf_counter()
    cluster = get_cluster(config, cancel_check=cancel_check)
    ready = time.perf_counter() - t0
    results = cluster.run(_check_rank, nbytes, timeout_s=300, cancel_check=cancel_check)
    info = cluster.describe()
    return {
        "ranks": info["num_ranks"],
        "ready_ranks": len(results),
        "devices": info["devices"],
        "device_names": [r["device_name"] for r in info["ranks"]],
        "backend": info["backend"],
        "address": info["address"],
        "nodes": info["nodes"],
        "node_of_rank": [r["node_id"] for r in info["ranks"]],
        "seconds_to_ready": round(max(ready, 0.0) if ready > 0.05 else info["seconds_to_ready"], 3),
        "all_reduce_ok": all(r["all_reduce_ok"] for r in results),
        "p2p_ok": all(r["p2p_ok"] for r in results),
        "bandwidth_gbps": {
            f"{r['rank'] + 1}->{r['rank']}": (round(r["send_gbps_to_next"], 3) if r["send_gbps_to_next"] else None)
            for r in results[:-1]
        },
        "per_rank": results,
    }
