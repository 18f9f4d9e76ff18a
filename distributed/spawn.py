"""Run a function on N local CPU/GPU ranks with ``torch.multiprocessing`` (no Ray).

The Ray cluster (``cluster.py``) is what users run. This launcher is the lighter harness the
adapter tests and ``torchrun``-free benchmarks use: real processes, a real gloo or NCCL process
group, a fresh free port per launch (retried on a clash), and each rank's return value (or its
exception, re-raised with the rank named) handed back to the caller.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .context import ParallelContext

__all__ = ["run_ranks", "RankError", "free_port"]


class RankError(RuntimeError):
    """A rank raised; the message names the rank and carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, device_kind, fn, args, kwargs, queue, timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
        ctx = ParallelContext.from_group(None, device)
        result = fn(ctx, *args, **kwargs)
        # Tensors in a multiprocessing queue travel as shared-memory handles that die with this process;
        # serialise the result so the parent can read it after the rank has exited.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException as exc:  # report every failure, then exit non-zero
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 300.0,
    **kwargs,
) -> List[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` spawned ranks; return the results by rank.

    ``fn`` must be importable (module level). Raises :class:`RankError` naming the first failing rank.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, device, fn, args, kwargs, queue, timeout_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    errors: dict = {}
    try:
        import queue as _q

        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout_s + 30)
            except _q.Empty:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise RankError(f"ranks {missing} did not finish within {timeout_s + 30:.0f} s") from None
            (results if ok else errors)[rank] = payload
            if errors:
                # one failed rank can leave its peers blocked in a collective: stop waiting for them
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        rank = min(errors)
        raise RankError(f"rank {rank} failed: {errors[rank]}")
    # our own rank processes' results (arbitrary Python values), never a file from elsewhere
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
