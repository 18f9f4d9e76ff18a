"""PatchRay's VAE benchmark: the launchers and the command line.

``torchrun --nproc_per_node=N -m patchray bench ...`` and ``python -m patchray bench --ranks N ...`` (the Ray
cluster) run the same per-rank body, :func:`~.vae_rank.bench_rank`, and write the same schema-8 JSON
(``docs/benchmark.md`` describes the cases, the counting rules and the schema).

The benchmark is split along its seams: :mod:`.options` (command line and checks), :mod:`.cases` (what runs),
:mod:`.measure` (one case on one rank), :mod:`.records` (the JSON record and the exit status), :mod:`.vae_rank`
(the per-rank body) and this module (starting ranks, writing JSON + PNG, the summary).

Design decisions:

* **One body, three launchers.** The launchers (torchrun, the Ray cluster, ``spawn.run_ranks`` for tests) only
  start ranks and take rank 0's list, so the JSON cannot depend on how the ranks were started.
* **Exit status.** 0: everything ran and row-sharded agreement held. 1: an execution or structural failure in
  any mode, or row agreement outside its tolerance. 2: a setup error (bad options, a refused case, the cluster
  could not start). Resource limits (out of memory, PyTorch's 32-bit index limit) are recorded per case and do not
  fail the run: finding them is what the benchmark is for. Tiling differences are reported, never enforced.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .cases import plan_cases
from .catalog import format_shape
from .options import EXIT_FAILED, EXIT_OK, EXIT_SETUP, ROW_TOLERANCE, SCHEMA_VERSION, Options, SetupError, build_parser, resolve_options
from .records import comm_block, exit_status, json_safe
from .vae_rank import bench_rank

__all__ = [
    "SCHEMA_VERSION",
    "ROW_TOLERANCE",
    "BenchResult",
    "SetupError",
    "build_parser",
    "resolve_options",
    "bench_rank",
    "run_bench",
    "bench_main",
    "exit_status",
    "comm_block",
]


@contextlib.contextmanager
def _tail_progress(path: str):
    """Print the lines rank 0 appends to ``path`` while the ranks run (local launchers only)."""
    import threading

    stop = threading.Event()

    def tail():
        pos = 0
        while True:
            done = stop.wait(1.0)
            try:
                with open(path) as fh:
                    fh.seek(pos)
                    text = fh.read()
                    pos = fh.tell()
            except OSError:
                text = ""
            if text:
                print(text, end="", flush=True)
            if done:
                return

    thread = threading.Thread(target=tail, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.remove(path)


class BenchResult(NamedTuple):
    records: List[dict]
    exit_code: int
    json_path: Optional[str]
    chart_path: Optional[str]


def _run_torchrun(payload: dict) -> Tuple[List[dict], int]:
    import datetime

    from .. import comm

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if payload["device"] == "cuda":
        # torchrun starts one process per local GPU and names it in LOCAL_RANK: that is its device (modulo the
        # visible devices, so --backend gloo can put several ranks on one GPU)
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        from ..spawn import choose_backend

        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        backend = choose_backend(payload["backend"], "cuda", local)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not comm.is_initialized():
        # torchrun's environment (MASTER_ADDR, MASTER_PORT) says where to meet
        comm.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=payload["timeout_s"]))
    try:
        ctx = comm.context_for_group(None, device)
        return bench_rank(ctx, payload), ctx.rank
    finally:
        comm.destroy_process_group()


def _run_ray(opts: Options, payload: dict) -> List[dict]:
    from ..cluster import ClusterConfig, ClusterSetupError, get_cluster, shutdown_cluster

    try:
        cluster = get_cluster(ClusterConfig(num_ranks=opts.ranks, device=opts.device, address=opts.address))
    except (ClusterSetupError, ValueError) as exc:
        raise SetupError(f"the Ray cluster could not start: {exc}") from exc
    try:
        results = cluster.run(bench_rank, payload, timeout_s=opts.timeout_s)
    finally:
        shutdown_cluster(stop_ray=opts.address is None)
    return results[0]


def run_bench(argv: Optional[Sequence[str]] = None, *, cluster=None, cancel_check=None, progress=None) -> BenchResult:
    """Parse ``argv``, run the benchmark, write JSON + PNG and print the summary (rank 0 / the driver).

    Args:
        argv: command-line options (see ``python -m patchray bench --help``).
        cluster: an existing :class:`~patchray.distributed.cluster.RankCluster` to run on (ComfyUI's bench
            node); its size overrides ``--ranks``.
        cancel_check: with ``cluster``: polled while the ranks work; raising from it stops every rank
            (ComfyUI's cancel).
        progress: with ``cluster``: ``progress(done, total)`` after each finished case (ComfyUI's progress bar).

    Raises:
        SetupError: bad options or a refused request.
    """
    import dataclasses

    args = build_parser().parse_args(list(argv or []))
    if cluster is not None:
        # the cluster decides ranks and device: resolve the defaults for ITS device, not this process's
        kind = getattr(cluster, "device_kind", None)
        if args.device == "auto" and kind in ("cpu", "cuda"):
            args.device = kind
        opts = resolve_options(args, cuda_available=kind == "cuda" if kind else None)
        opts.ranks = cluster.config.num_ranks
    else:
        opts = resolve_options(args)
    local = not opts.torchrun and (opts.launcher == "spawn" or (cluster is None and opts.address is None))
    if local:
        os.makedirs(os.path.dirname(opts.out), exist_ok=True)
        opts.progress_path = opts.out + ".progress"
        with contextlib.suppress(OSError):
            os.remove(opts.progress_path)
    payload = dataclasses.asdict(opts)
    _announce(opts)
    with _tail_progress(opts.progress_path) if local else contextlib.nullcontext():
        records, writer = _launch(opts, payload, cluster, cancel_check, progress)
    if not writer:  # a torchrun rank other than 0: same records, same exit status, no files
        return BenchResult(records, exit_status(records), None, None)
    return _finish(opts, records)


def _launch(opts: Options, payload: dict, cluster, cancel_check=None, progress=None) -> Tuple[List[dict], bool]:
    """Start the ranks; return the records and whether this process writes the outputs."""
    if opts.torchrun:
        records, rank = _run_torchrun(payload)
        return records, rank == 0
    if cluster is not None:
        return cluster.run(bench_rank, payload, timeout_s=opts.timeout_s, cancel_check=cancel_check, progress=progress)[0], True
    if opts.launcher == "spawn":
        from ..spawn import run_ranks

        from ..spawn import choose_backend

        backend = choose_backend(opts.backend, opts.device, opts.ranks)
        return run_ranks(bench_rank, opts.ranks, payload, backend=backend, device=opts.device, timeout_s=opts.timeout_s)[0], True
    return _run_ray(opts, payload), True


def _announce(opts: Options) -> None:
    if opts.torchrun and int(os.environ.get("RANK", 0)) != 0:
        return
    why = {"cpu": " (no GPU: the CPU default suite; see --help)", "gpu": " (the GPU default suite)"}.get(opts.defaults_used, "")
    print(f"patchray bench: {opts.family} {opts.half} ({opts.size}) {', '.join(format_shape(s) for s in opts.shapes)} "
          f"on {opts.ranks} {opts.device} rank(s), {opts.dtype}{why}", flush=True)
    for shape in opts.shapes:
        try:
            names = [c.name + (" (skipped)" if c.skipped else "") for c in plan_cases(opts, tuple(shape), opts.ranks)]
        except ValueError:
            continue
        print(f"  {format_shape(shape)}: {', '.join(names)}; each: {opts.warmup} warm-up, 1 logged, {opts.iters} timed",
              flush=True)


def _finish(opts: Options, records: List[dict]) -> BenchResult:
    from .report import format_table

    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    data: Any = records[0] if opts.single_object and len(records) == 1 else records
    with open(opts.out, "w") as fh:
        json.dump(json_safe(data), fh, indent=1, allow_nan=False)
    chart_path = None
    if opts.chart:
        try:
            from .charts import write_chart

            chart_path = write_chart(records, os.path.splitext(opts.out)[0] + ".png")
        except Exception as exc:  # the JSON is the result; a chart failure is reported, not fatal
            print(f"chart not written: {type(exc).__name__}: {exc}", file=sys.stderr)
    code = exit_status(records)
    print(format_table(records))
    print(f"\nJSON:  {opts.out}")
    if chart_path:
        print(f"chart: {chart_path}")
    if code != EXIT_OK:
        print("exit status 1: an execution or structural failure, or row agreement outside its tolerance (see above)")
    return BenchResult(records, code, opts.out, chart_path)


def bench_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m patchray bench ...`` and ``torchrun -m patchray bench ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        result = run_bench(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_SETUP
    except SetupError as exc:
        print(f"patchray bench: {exc}", file=sys.stderr)
        return EXIT_SETUP
    except Exception as exc:  # a rank died or the cluster failed mid-run: an execution error
        print(f"patchray bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return result.exit_code
