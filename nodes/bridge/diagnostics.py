"""The one call of each cluster and diagnostics node: the cluster handle, tile plans, the topology probe, benchmarks.

Each function takes the node's widget values, calls the library, and returns what the node outputs in ComfyUI's
shapes (IMAGE tensors from the library's PNG charts, JSON text, a one-line summary). Rank and Ray errors leave as
clean messages (:mod:`.errors`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Callable, NamedTuple, Optional

import torch

from .errors import rank_errors_for_user
from . import plan_words
from .images import node_chart, png_to_image
from .preview import draw_plan

__all__ = ["cluster_config", "describe_cluster", "plan_preview", "probe", "benchmark", "Report"]


class Report(NamedTuple):
    """A diagnostics node's outputs: an IMAGE, the text summary and the full data (JSON-able)."""

    image: torch.Tensor
    text: str
    data: object


def cluster_config(num_ranks: int, device: str, address: str = "", gpu_ids: str = ""):
    """Validate the Cluster node's widget values and build the ``ClusterConfig`` the wire carries."""
    from ...distributed.cluster import ClusterConfig

    kwargs = dict(num_ranks=int(num_ranks), device=device, address=address.strip() or None)
    try:
        gpus = tuple(int(g) for g in gpu_ids.replace(" ", "").split(",") if g) if gpu_ids and gpu_ids.strip() else ()
    except ValueError:
        raise ValueError(f"gpu_ids must be comma-separated GPU indices such as '0,1' (got {gpu_ids!r})") from None
    if gpus:
        kwargs["gpu_ids"] = gpus  # ClusterConfig checks one GPU per rank, distinct, embedded, not cpu
    config = ClusterConfig(**kwargs)
    # what this machine cannot hold is refused here, in the node's terms, before any rank starts
    from ...distributed.cluster import ClusterSetupError, check_rank_count

    try:
        check_rank_count(config.num_ranks, config.device, embedded=config.address is None, gpu_ids=config.gpu_ids)
    except ClusterSetupError as exc:
        raise ValueError(str(exc)) from None
    return config


def _summary(info: dict) -> str:
    return f"{info['num_ranks']} {info['device_kind']} rank(s), {info['backend']}: " + ", ".join(map(str, info["devices"]))


def describe_cluster(config):
    """The Cluster node's outputs for ``config`` without starting a rank: ``(info as JSON text, one-line summary)``.

    The ranks start when a node first uses the handle (:func:`~patchray.distributed.cluster.get_cluster`), after that
    node has checked its inputs, so a request that cannot run is refused without the start-up (15-25 s on CPU ranks,
    more on GPUs). A cluster of ``config`` already running (an earlier prompt) is described as it runs; otherwise the
    configuration, with the device kind :func:`cluster_config` checked this machine for (``device`` ``auto`` on an
    existing Ray cluster: decided by its resources when the ranks start).
    """
    from ...distributed.cluster import check_rank_count, running_cluster

    cluster = running_cluster(config)
    if cluster is not None:
        info = dict(cluster.describe(), started=True)
        return json.dumps(info, indent=1, default=str), _summary(info)
    kind = check_rank_count(config.num_ranks, config.device, embedded=config.address is None, gpu_ids=config.gpu_ids)
    backend = {"cuda": "nccl", "cpu": "gloo"}.get(kind, "nccl on GPUs, gloo on CPUs")
    info = {
        "num_ranks": config.num_ranks, "backend": backend, "device_kind": kind or "decided by the Ray cluster",
        "address": config.address or "embedded (127.0.0.1)", "gpu_ids": list(config.gpu_ids), "started": False,
        "note": "not running when this node ran; the ranks start when a PatchRay node first uses this cluster, after that "
                "node has checked its inputs",
    }
    # said without a time: ComfyUI caches this node, so its text stays on screen after the ranks have started
    summary = (f"{config.num_ranks} {kind or ''} rank(s)".replace("  ", " ") + f", {backend}: they start when a PatchRay "
               "node first uses them (after that node's own checks) and stay up for later prompts")
    return json.dumps(info, indent=1, default=str), summary


def _describe(p: dict) -> str:
    """One plan as lines of text, sizes width x height (ComfyUI's widget order); the planner stores height first."""
    o = p["objectives"]
    (wh, ww), (oh, ow), (gr, gc) = p["window"], p["overlap"], p["grid"]
    runs = ", ".join(f"rank {r}: {b - a}" for r, (a, b) in enumerate(p["runs"]))
    return (
        f"{p['name']}: {o['tile_count']} tiles ({gc} x {gr}), window {ww}x{wh} px, overlap {ow}x{oh} px\n"
        f"    decoded area x{o['coverage']:.2f}, imbalance {o['imbalance']:.1%}; tiles per rank: {runs}"
    )


def plan_preview(family: str, width: int, height: int, frames: int, ranks: int, choice: str, image=None):
    """The planner's plans for a shape: ``(chosen plan dict, preview IMAGE, the plans as text)``."""
    from ...distributed.vae.planner import plan_tiles
    from .validate import tile_planner_request

    tile_planner_request(family, width, height, frames, ranks)  # what cannot be useful is refused before planning
    try:
        report = plan_tiles(family, int(height), int(width), frames=int(frames), world_size=int(ranks))
    except ValueError as exc:
        worded = plan_words.for_tile_planner(str(exc), family, int(width), int(height), int(ranks))
        if worded is None:
            raise
        raise ValueError(worded) from None
    chosen = getattr(report, choice) or report.coarse  # balanced is None when the frontier has two windows
    plan = chosen.to_dict()
    lines = [_describe(p.to_dict()) for p in report.plans]
    if getattr(report, choice) is None:
        lines.append(f"(no distinct {choice} plan for this shape: using coarse)")
    return plan, draw_plan(plan, image), "\n".join(lines)


def probe(measure: bool, cluster_config=None, cancel_check: Optional[Callable[[], None]] = None) -> Report:
    """The topology probe (and the rank cluster's check when a cluster is given) as a heatmap, text and a dict."""
    from ...distributed.topology import probe_topology, render_heatmap, report_with_advice, summary_text

    report = probe_topology(measure=bool(measure))
    if cluster_config is not None:
        from ...distributed.cluster import check_cluster

        with rank_errors_for_user():
            report.cluster = check_cluster(cluster_config, cancel_check=cancel_check)  # the report's slot for the rank cluster check
    data = report_with_advice(report)
    fd, path = tempfile.mkstemp(prefix="patchray_topology_", suffix=".png")
    os.close(fd)
    try:
        render_heatmap(report, path)
        image = png_to_image(path)
    finally:
        os.unlink(path)
    return Report(image, summary_text(report), data)


#: the Benchmark node's auto size on CPU ranks: the reduced-width model at a small size, a suite of seconds
CPU_AUTO = dict(width=192, height=192, size="tiny")


def bench_request(family: str, shape: str, size: str, device_kind: str) -> tuple:
    """The Benchmark node's ``shape`` (WIDTHxHEIGHT[xFRAMES], or ``auto``) and ``size`` (or ``auto``) for a cluster of
    ``device_kind``: ``(height, width, frames, size)`` as the benchmark takes them.

    auto fits the device: CPU ranks get :data:`CPU_AUTO` (video families with the fewest frames their temporal
    compression takes beyond one); GPU ranks get the family's first benchmark size and the full model.
    """
    from ...distributed.bench.catalog import canonical_shapes
    from ...distributed.vae.families import FAMILIES

    spec = FAMILIES[family]
    on_cpu = device_kind != "cuda"
    if size == "auto":
        size = CPU_AUTO["size"] if on_cpu else "full"
    text = shape.strip().lower().replace(" ", "")
    if text in ("", "auto"):
        if on_cpu:
            frames = spec.temporal_ratio + 1 if spec.is_video and spec.temporal_ratio > 1 else 1
            return CPU_AUTO["height"], CPU_AUTO["width"], frames, size
        first = canonical_shapes(family)[0]
        return first.height, first.width, first.frames, size
    parts = text.split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape must be WIDTHxHEIGHT or WIDTHxHEIGHTxFRAMES in pixels, e.g. 1024x1024 or 832x480x81, or auto (got {shape!r})")
    width, height = int(parts[0]), int(parts[1])
    frames = int(parts[2]) if len(parts) == 3 else (spec.temporal_ratio + 1 if spec.is_video and spec.temporal_ratio > 1 else 1)
    _check_bench_shape(family, spec, shape, width, height, frames)
    return height, width, frames, size


def _check_bench_shape(family: str, spec, shape: str, width: int, height: int, frames: int) -> None:
    """The shape widget's value against the family, in the widget's order (WIDTHxHEIGHT[xFRAMES]); the benchmark's own
    check words it height first for its command line."""
    ratio, t = int(spec.spatial_ratio), int(spec.temporal_ratio)
    if width % ratio or height % ratio:
        w, h = (max(ratio, round(v / ratio) * ratio) for v in (width, height))
        tail = f"x{frames}" if spec.is_video else ""
        raise ValueError(f"shape {shape!r}: family {family} needs width and height in multiples of {ratio} px: use {w}x{h}{tail}")
    if not spec.is_video and frames != 1:
        raise ValueError(f"shape {shape!r}: family {family} decodes single images: use {width}x{height}")
    if spec.is_video and t > 1 and (frames - 1) % t:
        lower = (frames - 1) // t * t + 1
        raise ValueError(f"shape {shape!r}: family {family} decodes {t}k + 1 frames: use {width}x{height}x{lower} or "
                         f"{width}x{height}x{lower + t}")


#: full-resolution tensors a decode holds at its peak, for the Benchmark's memory check: the KL decoder's measured fp32
#: peak is about 7 tensors of its output size times its first-level channels (0.93 GiB for 512x512 px at 128 channels,
#: one process, ComfyUI's AutoencoderKL); 8 leaves a margin
_LIVE_FULL_RES_TENSORS = 8


def _first_level_channels(family: str, size: str) -> int:
    from ...distributed.vae.families import FAMILIES

    spec = FAMILIES[family]
    config = spec.tiny_config if size == "tiny" else spec.full_config
    config = config() if callable(config) else (config or {})
    for key in ("decoder_block_out_channels", "block_out_channels"):
        if config.get(key):
            return int(config[key][0])
    for key in ("decoder_base_dim", "base_dim"):
        if config.get(key):
            return int(config[key])
    return 8 if size == "tiny" else 128  # diffusers' default widths: 128 channels at full resolution


def check_bench_memory(family: str, height: int, width: int, frames: int, size: str, cpu_ranks_here: bool,
                       available: Optional[int]) -> None:
    """Refuse a benchmark on this machine's CPU ranks whose reference decode (the whole image in one process) does
    not fit in the memory free now: past it Ray stops the ranks at 95% and the kernel kills processes."""
    if not cpu_ranks_here or not available:
        return
    need = frames * height * width * 4 * _first_level_channels(family, size) * _LIVE_FULL_RES_TENSORS
    if need > available:
        label = f"{width}x{height}" + (f"x{frames}" if frames > 1 else "")
        raise ValueError(
            f"benchmark refused: shape {label} with size {size} needs about {need / 2**30:.1f} GiB on the CPU ranks (each "
            f"case decodes the whole image once in one process, as the reference), and this machine has "
            f"{available / 2**30:.1f} GiB free: set size to tiny, a smaller shape, or shape auto"
        )


def benchmark(
    cluster_config, family: str, shape: str, size: str, half: str, iters: int, folder: str,
    cancel_check: Optional[Callable[[], None]] = None, progress: Optional[Callable[[int, int], None]] = None,
) -> Report:
    """Run the VAE benchmark on the cluster; the report JSON and chart go to ``folder``.

    Returns the chart, the table (prefixed FAILED when a case failed) and ``{"report": the JSON file's content,
    "records": its records as a list, "file": its name}``.
    """
    from ...distributed.bench.report import format_table
    from ...distributed.bench.vae_bench import SetupError, run_bench
    from ...distributed.cluster import get_cluster

    from ...distributed.cluster import check_rank_count
    from ...distributed.cluster.limits import this_machine

    os.makedirs(folder, exist_ok=True)
    if cancel_check is not None:
        cancel_check()
    c = cluster_config
    # the widgets are checked against the device kind the cluster's settings give, before any rank starts; only device
    # auto on an existing Ray cluster needs its ranks placed to know it
    kind = check_rank_count(c.num_ranks, c.device, embedded=c.address is None, gpu_ids=c.gpu_ids)
    cluster = None
    if not kind:
        with rank_errors_for_user():
            cluster = get_cluster(c, cancel_check=cancel_check)
        kind = cluster.device_kind
    height, width, frames, size = bench_request(family, shape, size, kind)
    check_bench_memory(family, height, width, frames, size, kind == "cpu" and not c.address, this_machine().available_bytes)
    if cluster is None:
        with rank_errors_for_user():
            cluster = get_cluster(c, cancel_check=cancel_check)  # the ranks start here on first use
    label = f"{width}x{height}" + (f"x{frames}" if frames > 1 else "")
    out = os.path.join(folder, f"bench_{family}_{label}_{size}_{cluster_config.num_ranks}r_{time.strftime('%Y%m%d-%H%M%S')}.json")
    argv = ["--family", family, "--shape", f"{height}x{width}x{frames}", "--size", size, "--half", half, "--warmup", "1",
            "--iters", str(int(iters)), "--out", out]
    try:
        with rank_errors_for_user():
            result = run_bench(argv, cluster=cluster, cancel_check=cancel_check, progress=progress)
    except SetupError as exc:
        raise ValueError(f"benchmark refused: {exc}") from None
    with open(result.json_path) as fh:
        data = json.load(fh)
    if result.chart_path is None or not os.path.exists(result.chart_path):
        raise RuntimeError(f"the benchmark wrote {result.json_path} but no chart")
    summary = format_table(result.records)
    if result.exit_code != 0:
        summary = "FAILED (see the report's error fields)\n" + summary
    records = data if isinstance(data, list) else [data]  # the JSON file's form: NaN/inf already made null
    chart = os.path.splitext(result.json_path)[0] + ".node.png"  # drawn for the node; the report's chart stays for reading alone
    node_chart(result.records, chart)
    return Report(png_to_image(chart), summary, {"report": data, "records": records, "file": os.path.basename(result.json_path)})
