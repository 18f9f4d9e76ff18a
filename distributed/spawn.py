"""Run a function on N local CPU/GPU ranks with ``torch.multiprocessing`` (no Ray).

The Ray cluster (``cluster.py``) is what users run. This launcher is the lighter harness the adapter tests
and ``torchrun``-free benchmarks use: real processes, a real gloo or NCCL process group, and each rank's
return value (or its exception, re-raised with the rank named) handed back to the caller.

Design decision: the ranks meet through a ``torch.distributed.FileStore`` in a fresh temporary folder,
as the cluster's one-machine rendezvous does, and the folder is removed when the ranks are done. A
"pick a free TCP port, close it, hand it to the ranks" scheme has a window in which another process can
take the port, and it opens a listening socket on the machine; a file in a private folder has neither.
The process group is joined and left through ``comm`` (the one module that calls ``torch.distributed``).
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import queue as _queue
import shutil
import tempfile
import traceback
from typing import Any, Callable, List, Sequence, Union

import torch

log = logging.getLogger(__name__)
import torch.multiprocessing as mp

from . import comm

__all__ = ["run_ranks", "RankError", "choose_backend"]


class RankError(RuntimeError):
    """A rank raised; the message names the rank and carries its traceback."""


def _worker(rank, world_size, store_path, backend, device_kind, fn, args, kwargs, queue, timeout_s, threads=1,
            gpu_per_rank=False):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    try:
        index = rank if gpu_per_rank else 0
        if device_kind == "cuda":
            torch.cuda.set_device(index)  # NCCL's communicators and every default-device call use the rank's own GPU
        comm.init_process_group(
            backend,
            store=comm.file_store(store_path, world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        device = torch.device("cuda", index) if device_kind == "cuda" else torch.device("cpu")
        ctx = comm.context_for_group(None, device)
        result = fn(ctx, *args, **kwargs)
        # Tensors in a multiprocessing queue travel as shared-memory handles that die with this process;
        # serialise the result so the parent can read it after the rank has exited.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException as exc:  # report every failure, then exit non-zero
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        comm.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 300.0,
    threads: Union[int, Sequence[int]] = 1,
    gpu_per_rank: bool = False,
    **kwargs,
) -> List[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` spawned ranks; return the results by rank.

    Args:
        fn: a module-level (importable) function taking the rank's :class:`ParallelContext` first.
        world_size: number of rank processes.
        backend: ``"gloo"`` (CPU, or several ranks sharing one GPU) or ``"nccl"``.
        device: ``"cpu"`` or ``"cuda"`` (every rank uses ``cuda:0`` of what it sees, unless ``gpu_per_rank``).
        timeout_s: bound on forming the group and on each collective.
        threads: compute threads per rank: one count for every rank, or one per rank (e.g. ``(2, 1)``: ranks of
            unequal speed on one machine).
        gpu_per_rank: with ``device="cuda"``, rank ``r`` uses ``cuda:r`` (one GPU per rank; the process group's
            backend is then usually ``"nccl"``). Refused when fewer GPUs are visible than ranks.

    Raises:
        RankError: naming the first failing rank, with its traceback.

    Example:
        >>> run_ranks(my_module.rank_of, 2)  # doctest: +SKIP
        [0, 1]
    """
    per_rank = [threads] * world_size if isinstance(threads, int) else list(threads)
    if len(per_rank) != world_size or any(not isinstance(t, int) or t < 1 for t in per_rank):
        raise ValueError(f"threads must be a count >= 1 or one count per rank (got {threads!r} for {world_size} ranks)")
    if gpu_per_rank:
        if device != "cuda":
            raise ValueError(f"gpu_per_rank needs device='cuda' (got {device!r})")
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < world_size:
            raise ValueError(f"one GPU per rank needs {world_size} GPUs; this machine shows {visible}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="patchray-spawn-")
    store_path = os.path.join(rendezvous, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, store_path, backend, device, fn, args, kwargs, queue, timeout_s, per_rank[r], gpu_per_rank),
            daemon=True,
        )
        for r in range(world_size)
    ]
    results: dict = {}
    errors: dict = {}
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout_s + 30)
            except _queue.Empty:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise RankError(f"ranks {missing} did not finish within {timeout_s + 30:.0f} s") from None
            (results if ok else errors)[rank] = payload
            if errors:
                # one failed rank can leave its peers blocked in a collective: stop waiting for them
                break
    finally:
        for p in procs:
            if p.pid is None:
                continue  # never started
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(rendezvous, ignore_errors=True)
    if errors:
        rank = min(errors)
        raise RankError(f"rank {rank} failed: {errors[rank]}")
    # our own rank processes' results (arbitrary Python values), never a file from elsewhere
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]


def choose_backend(requested: str, device: str, ranks: int, gpus: Union[int, None] = None) -> str:
    """The process-group backend for ``ranks`` local ranks on ``device``: ``auto`` is NCCL when every rank has a GPU of
    its own and gloo otherwise (NCCL refuses two ranks on one GPU with "Duplicate GPU detected"; under gloo ranks share
    a GPU, which measures per-rank work, not a multi-GPU speed-up: said in the log). An explicit ``nccl`` that cannot
    run is refused here, in the options' terms, before any process starts.

    Args:
        requested: ``auto``, ``gloo`` or ``nccl`` (the benchmarks' ``--backend``).
        device: ``cuda`` or ``cpu``.
        ranks: local ranks.
        gpus: visible GPUs (default: ``torch.cuda.device_count()``).
    """
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"--backend must be auto, gloo or nccl (got {requested!r})")
    if device != "cuda":
        if requested == "nccl":
            raise ValueError("--backend nccl runs CUDA ranks only: use --device cuda, or --backend gloo for CPU ranks")
        return "gloo"
    gpus = torch.cuda.device_count() if gpus is None else int(gpus)
    if ranks <= gpus:
        return "nccl" if requested == "auto" else requested
    if requested == "nccl":
        raise ValueError(
            f"--backend nccl needs a GPU per rank: {ranks} ranks, {gpus} GPU(s) visible; use --ranks {max(1, gpus)}, or "
            "--backend gloo (ranks share a GPU: per-rank work, not a multi-GPU speed-up)")
    if requested == "auto":
        log.warning("%d ranks share %d GPU(s): backend gloo (NCCL refuses two ranks on one GPU); their times measure "
                    "per-rank work, not a multi-GPU speed-up", ranks, gpus)
    return "gloo"
