"""Topology measurements: copy bandwidth and latency per GPU pair, and NCCL all_reduce bus bandwidth.

Design decision: NCCL runs in fresh processes (``nccl_worker.py``), once with P2P allowed and once with
``NCCL_P2P_DISABLE=1``, because NCCL reads its environment once per process; the environment is changed for
the workers only, never in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from .report import NcclBandwidth, NodeTopology

__all__ = ["measure_copy", "measure_allreduce", "measure_pairs", "measure_nccl"]


def measure_copy(src: int, dst: int, nbytes: int = 64 << 20, iters: int = 10) -> tuple:
    """Copy bandwidth (GB/s) and small-copy latency (us) from CUDA device ``src`` to ``dst``.

    The bandwidth is ``iters`` copies of ``nbytes`` after one warm-up; the latency is the mean time of a 4-byte
    copy followed by a synchronisation (what one small exchange costs end to end). PyTorch enables peer access
    by itself where CUDA allows it, so the figure is P2P where P2P works and host-staged otherwise.
    """
    import torch

    a = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=f"cuda:{src}")
    b = torch.empty_like(a, device=f"cuda:{dst}")

    def sync():
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)

    b.copy_(a)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a, non_blocking=True)
    sync()
    gbps = a.numel() * 4 * iters / (time.perf_counter() - t0) / 1e9
    sa, sb = a[:1], b[:1]
    sb.copy_(sa)
    sync()
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        sb.copy_(sa)
        torch.cuda.synchronize(dst)
    lat = (time.perf_counter() - t0) / reps * 1e6
    return gbps, lat


_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nccl_worker.py")


def _worker_env(p2p_disabled: bool) -> dict:
    """This process's environment with ``NCCL_P2P_DISABLE=1`` set or removed (the rest passes through)."""
    env = dict(os.environ)
    env.pop("NCCL_P2P_DISABLE", None)
    if p2p_disabled:
        env["NCCL_P2P_DISABLE"] = "1"
    return env


def measure_allreduce(
    devices: Sequence[int],
    *,
    p2p_disabled: bool,
    nbytes: int = 64 << 20,
    backend: str = "nccl",
    iters: int = 20,
    warmup: int = 5,
    timeout_s: float = 180.0,
) -> dict:
    """All_reduce bus bandwidth over ``devices`` in fresh processes, with NCCL P2P allowed or disabled.

    ``NCCL_P2P_DISABLE=1`` is set (or removed) in the workers' environment only, never in this process.

    Args:
        devices (`list[int]`): CUDA indices, one rank each (ignored beyond their count for ``backend="gloo"``).
        p2p_disabled (`bool`): run with ``NCCL_P2P_DISABLE=1``.
        backend (`str`): ``"nccl"``; ``"gloo"`` runs the same plumbing on CPU (tests).

    Returns:
        `dict`: the worker's result (``busbw_gbps``, ``algbw_gbps``, ``seconds_per_op``, ``env`` as the ranks saw it).

    Raises:
        RuntimeError: when the workers fail or time out (the message carries their stderr tail).
    """
    env = _worker_env(p2p_disabled)
    with tempfile.TemporaryDirectory(prefix="patchray-probe-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, _WORKER, "--devices", ",".join(map(str, devices)), "--bytes", str(nbytes),
               "--backend", backend, "--iters", str(iters), "--warmup", str(warmup),
               "--timeout", str(max(10.0, timeout_s / 2)), "--out", out]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"all_reduce over {list(devices)} did not finish in {timeout_s:.0f} s (P2P {'off' if p2p_disabled else 'on'})")
        if r.returncode != 0 or not os.path.exists(out):
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"all_reduce worker failed (exit {r.returncode}): {' | '.join(tail)}")
        with open(out) as f:
            return json.load(f)


def _selected(node: NodeTopology, devices: Optional[Sequence[int]]) -> list:
    gpus = [g for g in node.gpus if g.cuda_index is not None]
    if devices is not None:
        wanted = set(devices)
        gpus = [g for g in gpus if g.cuda_index in wanted]
    return gpus


def measure_pairs(node: NodeTopology, devices, nbytes: int) -> None:
    """Peer access, copy bandwidth both ways and small-copy latency for every selected pair (into ``node.pairs``)."""
    import torch

    gpus = _selected(node, devices)
    for n, ga in enumerate(gpus):
        for gb in gpus[n + 1 :]:
            p = node.pair(ga.index, gb.index)
            if p is None:
                continue
            p.can_access_peer = bool(torch.cuda.can_device_access_peer(ga.cuda_index, gb.cuda_index)
                                     and torch.cuda.can_device_access_peer(gb.cuda_index, ga.cuda_index))
            try:
                fwd, lat = measure_copy(ga.cuda_index, gb.cuda_index, nbytes)
                rev, _ = measure_copy(gb.cuda_index, ga.cuda_index, nbytes)
            except Exception as exc:  # out of memory on a busy GPU: report, keep going
                node.notes.append(f"copy GPU{p.a}<->GPU{p.b} not measured: {exc}")
                continue
            if p.a != ga.index:  # pairs are stored a < b in nvidia-smi order
                fwd, rev = rev, fwd
            p.copy_gbps, p.copy_gbps_reverse, p.copy_latency_us = fwd, rev, lat
    try:
        torch.cuda.empty_cache()
    except Exception:
        pass


def measure_nccl(node: NodeTopology, devices, nbytes: int) -> None:
    """NCCL all_reduce bus bandwidth over the selected GPUs with P2P allowed and disabled (into ``node.nccl``)."""
    from ..comm import nccl_available

    cuda_ids = [g.cuda_index for g in _selected(node, devices)]
    res = NcclBandwidth(devices=sorted(cuda_ids), nbytes=nbytes)
    node.nccl = res
    if len(cuda_ids) < 2:
        res.error = "fewer than two GPUs selected"
        return
    if not nccl_available():
        res.error = "this PyTorch has no NCCL"
        return
    try:
        on = measure_allreduce(res.devices, p2p_disabled=False, nbytes=nbytes)
        off = measure_allreduce(res.devices, p2p_disabled=True, nbytes=nbytes)
    except RuntimeError as exc:
        res.error = str(exc)
        return
    res.p2p_allowed_gbps = on["busbw_gbps"]
    res.p2p_disabled_gbps = off["busbw_gbps"]
