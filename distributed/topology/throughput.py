"""Each rank's compute throughput, measured by a short fixed workload: the figures speed-weighted bands use.

Design decisions:

* **A fixed workload, timed on every rank at once.** Mixed rigs (a 4090 beside a 3090, CPU ranks with different
  thread counts) run the same decode or sampling step at different speeds. :func:`measure_rank_speed` times one
  fixed piece of work on this rank (a 3x3 convolution, the bulk of a VAE decoder or a UNet, then a matrix
  product, the bulk of a DiT's blocks), after a barrier so that every rank measures while its peers run too, as
  they do in a real decode (ranks that share cores or a PCIe root then see the share they will really get).
  The figure is work per second (GFLOP/s of the workload), the best of a few timed runs after a warm-up (load
  from other processes only slows a run down, so the best run is the closest to the rank's own capability).
* **Agreed once, collectively.** :func:`agree_rank_speeds` gathers every rank's figure with one
  ``all_gather_object``, so every rank holds the same tuple and derives the same band table from it
  (``distributed/bands.py`` quantises the weights to integers first). Nothing is exchanged at the layers.
* **Measured once per cluster, like the probe.** :func:`cached_rank_speeds` keeps the agreed figures per cluster
  key in this process (the lead: ComfyUI's process); a rebuilt cluster of another configuration measures again.
  :func:`speed_weights` rounds the figures to 1% of the fastest so repeated measurements give the same table.
* **No timing code in the adapters**: this is the probe's module (``topology/``), run before the work, never
  inside it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable, Optional, Sequence, Tuple

__all__ = [
    "BALANCE_MODES",
    "measure_rank_speed",
    "agree_rank_speeds",
    "rank_speeds_task",
    "speed_weights",
    "cached_rank_speeds",
    "clear_speed_cache",
    "check_balance",
    "cluster_band_weights",
]

log = logging.getLogger(__name__)

#: ``equal``: every rank the same band (the first ones one row taller); ``speed``: bands proportional to each
#: rank's measured throughput
BALANCE_MODES = ("equal", "speed")

# the workload: channels and side of the convolution, side of the square matrix product, per device kind. Sized
# for ~30-100 ms per call on one CPU core (the channel counts of a VAE's last blocks) and a few ms on a GPU.
_WORKLOAD = {"cpu": (64, 64, 256), "cuda": (256, 128, 4096)}
_REPEATS = 3
_MIN_S = 0.25


def check_balance(balance: str) -> str:
    """``balance`` if it is one of :data:`BALANCE_MODES`, else ``ValueError`` naming the choices."""
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance must be one of {', '.join(BALANCE_MODES)} (got {balance!r})")
    return balance


def _sync(device) -> Callable[[], None]:
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def measure_rank_speed(device, repeats: int = _REPEATS, min_s: float = _MIN_S) -> float:
    """This rank's throughput on the fixed workload, in GFLOP/s: the best of ``repeats`` timed runs.

    Each run repeats the workload until at least ``min_s`` seconds have passed, so thread start-up and timer
    resolution do not count; the best run (not the median) is the rank's capability, because load from other
    processes only ever slows a run down (a shared machine would otherwise make the figures noise).

    Args:
        device: the rank's ``torch.device``.
        repeats: timed runs after one warm-up.
        min_s: the least duration of one run.
    """
    import torch
    import torch.nn.functional as F

    channels, side, n = _WORKLOAD["cuda" if device.type == "cuda" else "cpu"]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, channels, side, side, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(channels, channels, 3, 3, generator=g).to(device=device, dtype=dtype) * 0.05
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype) * 0.05
    flops = 2 * channels * channels * 9 * side * side + 2 * n ** 3
    sync = _sync(device)

    def work():
        return F.conv2d(x, w, padding=1), a @ b

    best = 0.0
    with torch.no_grad():
        work()
        sync()
        for _ in range(max(1, repeats)):
            count, t0 = 0, time.perf_counter()
            while True:
                work()
                count += 1
                sync()
                elapsed = time.perf_counter() - t0
                if elapsed >= min_s:
                    break
            best = max(best, count * flops / elapsed / 1e9)
    return best


def agree_rank_speeds(ctx, speed: float) -> Tuple[float, ...]:
    """Every rank's figure, in group-rank order, the same tuple on every rank (one ``all_gather_object``)."""
    from ..comm import all_gather_object

    return tuple(float(s) for s in all_gather_object(float(speed), ctx))


def rank_speeds_task(ctx, repeats: int = _REPEATS) -> Tuple[float, ...]:
    """Rank function (``RankCluster.run`` or ``spawn.run_ranks``): measure after a barrier, then agree.

    Returns the agreed figures (GFLOP/s per rank) on every rank.
    """
    from ..comm import barrier

    barrier(ctx)
    return agree_rank_speeds(ctx, measure_rank_speed(ctx.device, repeats))


rank_speeds_task.patchray_task = "measuring each rank's speed"


def speed_weights(speeds: Sequence[float]) -> Tuple[float, ...]:
    """Band weights from measured figures: each rank's speed relative to the fastest, rounded to 1%.

    Rounding makes two measurements of the same rig (a few percent apart) give the same band table; a rank is
    never weighted below 1% (its band stays non-empty where the rows allow, see ``bands.weighted_split``).

    Example:
        >>> speed_weights([80.0, 41.0])
        (1.0, 0.51)
    """
    speeds = [float(s) for s in speeds]
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"measured speeds must be positive (got {speeds}); measure again")
    top = max(speeds)
    return tuple(max(0.01, round(s / top, 2)) for s in speeds)


_CACHE: dict = {}
_LOCK = threading.Lock()


def cached_rank_speeds(key: Hashable, measure: Callable[[], Sequence[float]], *, refresh: bool = False) -> Tuple[float, ...]:
    """The agreed figures for a cluster, measured once per ``key`` and process (``measure()`` returns them).

    Example::

        >>> speeds = cached_rank_speeds(("speed", cluster.config), lambda: cluster.run(rank_speeds_task)[0])
        >>> weights = speed_weights(speeds)
    """
    with _LOCK:
        if not refresh and key in _CACHE:
            return _CACHE[key]
    speeds = tuple(float(s) for s in measure())
    log.info("rank throughput (GFLOP/s of the probe workload, by rank): %s", ", ".join(f"{s:.1f}" for s in speeds))
    with _LOCK:
        _CACHE[key] = speeds
    return speeds


def clear_speed_cache() -> None:
    """Forget every cached measurement (after the hardware changed)."""
    with _LOCK:
        _CACHE.clear()


def cluster_band_weights(cluster, balance: str, *, refresh: bool = False) -> Optional[Tuple[float, ...]]:
    """The band weights for ``balance`` on ``cluster``: ``None`` for ``equal`` (or one rank), else the cached
    measured speeds of its ranks as weights (measured on the ranks once per cluster configuration)."""
    check_balance(balance)
    if balance == "equal" or cluster.config.num_ranks == 1:
        return None
    key = ("rank-speed", repr(cluster.config))
    speeds = cached_rank_speeds(key, lambda: cluster.run(rank_speeds_task)[0], refresh=refresh)
    return speed_weights(speeds)

