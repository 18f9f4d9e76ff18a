"""Whether to shard a model's weights over the ranks, and what a sharded step costs on a link.

Design decisions:

* **Fit first, then speed.** ``auto`` sharding shards only when a whole copy of the weights would not leave room for
  the activations on the smallest card (the probe's or the cluster's free-memory figure, the same number on every
  rank). Sharding never makes a step faster: it adds one gather of every block per model evaluation, which the
  forward prefetch hides behind compute only when the link is fast enough.
* **The cost model is the link profiles' model** (:mod:`.links`: bytes over bandwidth, doubled when staged through
  host memory, plus a latency per message). A sharded rank receives ``(N-1)/N`` of the block bytes per model
  evaluation (FSDP2's all-gather); with prefetch the step is ``max(compute, gather)`` plus the sequence exchange,
  without overlap the sum. The alternative a user has on one card is ComfyUI's offload (weights streamed from host
  memory every step): ``max(compute of the whole model, weight bytes over one host -> device copy)``.
* **Say when it is slower.** :func:`choose_sharding` returns ``blocks`` when the model does not fit whole, and names,
  from the modelled figures when the caller has a compute time, whether the sharded step on this link is slower
  than one card with the model offloaded (then the advice says so: sharding is what makes the model fit on each
  card; a user with one large card, or with the time to wait, can use the stock sampler with offload instead).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .links import get_profile, transfer_ms

__all__ = ["ShardChoice", "activation_reserve", "choose_sharding", "sharded_step_ms", "offloaded_step_ms"]

GIB = 1024**3


def activation_reserve(total_bytes: float) -> float:
    """Room the activations of one model evaluation need besides the weights: 20 % of the card or 3 GiB, whichever
    is more (a rule of thumb from the H200 measurements: a rank's transient peak of Wan 2.1 14B at 480x832x81 over
    2 ranks and of FLUX.1 at 1024x1024 stays below 3 GiB above its resident weights)."""
    return max(0.2 * float(total_bytes), 3.0 * GIB)


class ShardChoice(NamedTuple):
    """What ``auto`` picked and why.

    Args:
        sharding: ``"none"`` or ``"blocks"``.
        reason: one sentence with the figures it came from.
        slower_than_offload: the modelled sharded step is slower than one card with the model offloaded (``None``
            when no compute time was given).
    """

    sharding: str
    reason: str
    slower_than_offload: Optional[bool] = None


def sharded_step_ms(compute_ms: float, block_bytes: float, world_size: int, link, *, overlap: bool = True,
                    messages: int = 0) -> float:
    """Modelled time of one model evaluation on one sharded rank: its compute and the gather of ``(N-1)/N`` of the
    block bytes over ``link`` (a profile or its name), overlapped by the prefetch (``max``) or not (sum)."""
    p = get_profile(link)
    received = float(block_bytes) * (world_size - 1) / world_size
    gather = transfer_ms(received, p) + messages * p.latency_us / 1e3
    return max(compute_ms, gather) if overlap else compute_ms + gather


def offloaded_step_ms(compute_ms_one_card: float, weight_bytes: float, host_link="pcie4_x16_p2p") -> float:
    """Modelled time of one model evaluation on ONE card streaming its weights from host memory every evaluation
    (ComfyUI's low-VRAM offload), overlapped with compute at best: ``max(compute, bytes / one host->device copy)``."""
    p = get_profile(host_link)
    return max(float(compute_ms_one_card), float(weight_bytes) / (p.bandwidth_gbps * 1e9) * 1e3)


def choose_sharding(weight_bytes: float, free_bytes_min: float, world_size: int, *, total_bytes_min: Optional[float] = None,
                    link=None, compute_ms_one_card: Optional[float] = None, block_fraction: float = 0.97) -> ShardChoice:
    """``auto`` sharding: ``blocks`` when the whole weights would not leave room for activations on the smallest card.

    Args:
        weight_bytes: the model's weight bytes (as loaded: fp8 counts one byte per element).
        free_bytes_min: the smallest free memory of the ranks' devices (probe or cluster figure; same on every rank).
        world_size: the ranks the blocks would be sharded over.
        total_bytes_min: the smallest card's total memory (sets the activation reserve); default: ``free_bytes_min``.
        link: the ranks' link profile (for the slower-than-offload verdict).
        compute_ms_one_card: one model evaluation of the whole model on one card, if known (same verdict).
        block_fraction: share of the weights in the blocks (the rest stays whole on every rank).
    """
    reserve = activation_reserve(total_bytes_min if total_bytes_min is not None else free_bytes_min)
    need = float(weight_bytes) + reserve
    if world_size < 2:
        return ShardChoice("none", "one rank: nothing to shard over")
    if need <= free_bytes_min:
        return ShardChoice(
            "none",
            f"the weights ({weight_bytes / GIB:.1f} GiB) and the activation reserve ({reserve / GIB:.1f} GiB) fit the "
            f"smallest card's {free_bytes_min / GIB:.1f} GiB free: each rank holds the whole model, no weight traffic",
        )
    per_rank = float(weight_bytes) * (block_fraction / world_size + (1 - block_fraction))
    fits = per_rank + reserve <= free_bytes_min
    reason = (
        f"the weights ({weight_bytes / GIB:.1f} GiB) plus the activation reserve ({reserve / GIB:.1f} GiB) exceed the "
        f"smallest card's {free_bytes_min / GIB:.1f} GiB free; sharded over {world_size} ranks each holds about "
        f"{per_rank / GIB:.1f} GiB" + ("" if fits else " and still does not fit: add ranks or use fp8 weights")
    )
    slower = None
    if link is not None and compute_ms_one_card is not None:
        sharded = sharded_step_ms(compute_ms_one_card / world_size, weight_bytes * block_fraction, world_size, link)
        offloaded = offloaded_step_ms(compute_ms_one_card, weight_bytes)
        slower = sharded > offloaded
        if slower:
            reason += (f"; on {get_profile(link).name} a sharded step ({sharded:.0f} ms modelled) is slower than one card "
                       f"with the model offloaded ({offloaded:.0f} ms): sharding is what makes the model fit each card")
    return ShardChoice("blocks", reason, slower)
