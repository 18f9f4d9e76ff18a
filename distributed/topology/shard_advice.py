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
* **Then host memory.** When the shards still do not fit (``blocks`` leaves more than the free memory per rank),
  ``auto`` escalates to ``blocks+offload`` (FSDP2's ``CPUOffloadPolicy``): each rank keeps its shards in pinned host
  memory and copies them to the device per block, so the card holds only the parameters outside the blocks, the
  gathered blocks in flight (the running one and the prefetched next) and the activations. The cost is one more copy:
  each rank moves its shard of every block host -> device per model evaluation (``block bytes / N``) before the
  gather; :func:`offload_cost` models it on PCIe 4.0 x16 (the copy, then the gather, overlapped with compute by the
  prefetch) against one card streaming the whole model from host memory (ComfyUI's own offload), and its text says
  plainly when the offloaded sharded step is the slower of the two.
* **Host memory is finite too.** Pinned pages cannot be swapped out; :func:`host_fits` checks the shards one machine's
  ranks would pin against that machine's available memory less a headroom (:func:`host_headroom`), so the node refuses
  instead of exhausting the machine.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .links import get_profile, transfer_ms

__all__ = [
    "ShardChoice", "OffloadCost", "activation_reserve", "choose_sharding", "sharded_step_ms", "offloaded_step_ms",
    "offload_cost", "offload_resident_bytes", "host_headroom", "host_fits", "HOST_LINK",
]

GIB = 1024**3

#: the host -> device copy of one card: PCIe 4.0 x16 (the profile's one-copy rate, 27.6 GB/s achievable)
HOST_LINK = "pcie4_x16_p2p"


def activation_reserve(total_bytes: float) -> float:
    """Room the activations of one model evaluation need besides the weights: 20 % of the card or 3 GiB, whichever
    is more (a rule of thumb from the H200 measurements: a rank's transient peak of Wan 2.1 14B at 480x832x81 over
    2 ranks and of FLUX.1 at 1024x1024 stays below 3 GiB above its resident weights)."""
    return max(0.2 * float(total_bytes), 3.0 * GIB)


class ShardChoice(NamedTuple):
    """What ``auto`` picked and why.

    Args:
        sharding: ``"none"``, ``"blocks"`` or ``"blocks+offload"``.
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


def offload_resident_bytes(weight_bytes: float, *, block_fraction: float = 0.97, largest_block_bytes: Optional[float] = None,
                           prefetch: int = 1) -> float:
    """Device bytes of one ``blocks+offload`` rank besides the activations: the parameters outside the blocks (whole on
    every rank) and the gathered blocks in flight, the running one and ``prefetch`` next ones (``largest_block_bytes``
    each; ``None``: not counted here, the activation reserve then has to hold them, as it does for ``blocks``)."""
    inflight = 0.0 if largest_block_bytes is None else (1 + int(prefetch)) * float(largest_block_bytes)
    return float(weight_bytes) * (1 - block_fraction) + inflight


class OffloadCost(NamedTuple):
    """The modelled cost of ``blocks+offload`` per model evaluation of one rank, against one card with ComfyUI's offload.

    Args:
        h2d_bytes: bytes one rank copies host -> device: its shard of every block (``block bytes / N``).
        h2d_ms: that copy on one card's PCIe 4.0 x16 link (:data:`HOST_LINK`).
        gather_ms: the all-gather of the rest of every block from the peers over the ranks' link (``None``: link unknown).
        step_ms: the offloaded sharded step: ``max(compute / N, copy + gather)`` (the copy and the gather of a block run
            one after the other, the prefetch overlaps both with compute); without a compute time, copy + gather.
        one_card_ms: one card streaming all the weights from host memory (ComfyUI's offload): ``max(compute, weight
            bytes / one host -> device copy)``; without a compute time, the copy alone.
        slower: ``step_ms > one_card_ms`` (``None`` when the link is unknown).
        text: the figures and the verdict in one sentence.
    """

    h2d_bytes: float
    h2d_ms: float
    gather_ms: Optional[float]
    step_ms: Optional[float]
    one_card_ms: float
    slower: Optional[bool]
    text: str


def offload_cost(weight_bytes: float, world_size: int, link=None, *, block_fraction: float = 0.97,
                 compute_ms_one_card: Optional[float] = None) -> OffloadCost:
    """What ``blocks+offload`` costs per model evaluation (a sampling step is one, or two when cond and uncond run in
    separate calls), and whether that is slower than one card with ComfyUI's own offload.

    Each of the ``N`` ranks copies its own shard of the blocks over its own PCIe 4.0 x16 link (the cards copy
    concurrently: each is assumed to have its own x16 link and the host's memory bandwidth to spare), then receives
    the other ``(N-1)/N`` of every block from its peers over ``link``. When the transfers bound the step, the verdict is
    link arithmetic alone: with the block fraction ``f`` and the host copy rate ``B``, one card moves ``W / B`` and a
    rank ``f W / (N B)`` plus the gather; over PCIe 4.0 without peer-to-peer the gather is staged through host memory
    (two copies), ``2 f W (N-1) / (N B)``, so the sum ``f W (2N-1) / (N B)`` exceeds ``W / B`` for every ``N >= 2``
    (f >= 2/3): slower than one card with offload. With peer-to-peer PCIe 4.0 the sum is ``f W / B``, about the one
    card's; NVLink makes the gather nearly free.
    """
    n = int(world_size)
    host = get_profile(HOST_LINK)
    blocks = float(weight_bytes) * block_fraction
    h2d = blocks / max(n, 1)
    h2d_ms = h2d / (host.bandwidth_gbps * 1e9) * 1e3
    one_copy_ms = float(weight_bytes) / (host.bandwidth_gbps * 1e9) * 1e3
    gather_ms = None if link is None else transfer_ms(blocks * (n - 1) / max(n, 1), link)
    moved = h2d_ms + (gather_ms or 0.0)
    if compute_ms_one_card is not None:
        step = max(float(compute_ms_one_card) / max(n, 1), moved)
        one = max(float(compute_ms_one_card), one_copy_ms)
        how = "modelled step"
    else:
        step, one = moved, one_copy_ms
        how = "when the copies, not the compute, bound the step"
    text = (f"each rank copies {h2d / GIB:.2f} GiB host -> device per model call ({h2d_ms:.0f} ms on PCIe 4.0 x16)")
    slower = None
    if link is None:
        text += f"; one card with ComfyUI's offload copies {float(weight_bytes) / GIB:.2f} GiB ({one_copy_ms:.0f} ms)"
        return OffloadCost(h2d, h2d_ms, None, None, one, None, text)
    name = get_profile(link).name
    text += (f", then gathers {blocks * (n - 1) / n / GIB:.2f} GiB from its peers ({gather_ms:.0f} ms on {name}); one card "
             f"with ComfyUI's offload copies {float(weight_bytes) / GIB:.2f} GiB ({one_copy_ms:.0f} ms)")
    slower = step > one
    if slower:
        text += (f". {how}: blocks+offload ({step:.0f} ms) is SLOWER than one card with ComfyUI's offload ({one:.0f} ms); "
                 f"it is what lets each card run the model at all, not a speed-up: with a card that runs the model under "
                 f"ComfyUI's offload, the stock KSampler is the faster choice")
    else:
        text += f". {how}: blocks+offload ({step:.0f} ms) is faster than one card with ComfyUI's offload ({one:.0f} ms)"
    return OffloadCost(h2d, h2d_ms, gather_ms, step, one, slower, text)


def host_headroom(total_bytes: float) -> float:
    """Host memory kept free beside pinned shards: 10 % of the machine's memory or 4 GiB, whichever is more (the OS,
    ComfyUI's own process and one part of the weights in flight while they ship, 256 MB, need room; pinned pages
    cannot be swapped out)."""
    return max(0.1 * float(total_bytes), 4.0 * GIB)


def host_fits(pinned_bytes: float, available_bytes: float, total_bytes: float) -> bool:
    """Whether ``pinned_bytes`` of shards fit one machine: ``pinned + headroom <= available`` (``psutil``'s available
    memory, plus what the ranks' previous model holds there, which is freed before the new one arrives)."""
    return float(pinned_bytes) + host_headroom(total_bytes) <= float(available_bytes)


def choose_sharding(weight_bytes: float, free_bytes_min: float, world_size: int, *, total_bytes_min: Optional[float] = None,
                    link=None, compute_ms_one_card: Optional[float] = None, block_fraction: float = 0.97,
                    largest_block_bytes: Optional[float] = None, prefetch: int = 1, offload: bool = True) -> ShardChoice:
    """``auto`` sharding, from the smallest card's free memory ``F`` and the activation reserve ``R``
    (:func:`activation_reserve`), escalating ``none`` -> ``blocks`` -> ``blocks+offload``:

    * ``none`` when ``W + R <= F`` (the whole weights fit);
    * ``blocks`` when ``W (f / N + 1 - f) + R <= F`` (1/N of the blocks, the rest whole);
    * ``blocks+offload`` otherwise: the card holds ``W (1 - f)`` plus the gathered blocks in flight
      (:func:`offload_resident_bytes`); when that plus ``R`` exceeds ``F`` too, the reason says it still does not fit.

    Args:
        weight_bytes: the model's weight bytes ``W`` (as loaded: fp8 counts one byte per element).
        free_bytes_min: the smallest free memory of the ranks' devices (probe or cluster figure; same on every rank).
        world_size: the ranks the blocks would be sharded over.
        total_bytes_min: the smallest card's total memory (sets the activation reserve); default: ``free_bytes_min``.
        link: the ranks' link profile (for the slower-than-offload verdict).
        compute_ms_one_card: one model evaluation of the whole model on one card, if known (same verdict).
        block_fraction: share ``f`` of the weights in the blocks (the rest stays whole on every rank).
        largest_block_bytes: the largest block's bytes (the gathered blocks in flight with ``blocks+offload``).
        prefetch: blocks gathered ahead of the running one.
        offload: whether ``blocks+offload`` is a choice (not on ranks whose device is the host: CPU ranks' "device
            memory" is host memory already, so offloading frees nothing); without it ``blocks`` is the last step.
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
        f"{per_rank / GIB:.1f} GiB" + ("" if fits else " and still does not fit")
    )
    if not fits and not offload:
        return ShardChoice("blocks", reason + ": add ranks or use fp8 weights")
    if not fits:
        resident = offload_resident_bytes(weight_bytes, block_fraction=block_fraction,
                                          largest_block_bytes=largest_block_bytes, prefetch=prefetch)
        fits_off = resident + reserve <= free_bytes_min
        cost = offload_cost(weight_bytes, world_size, link, block_fraction=block_fraction,
                            compute_ms_one_card=compute_ms_one_card)
        reason += (
            f"; with the shards in host memory (blocks+offload) a card holds about {resident / GIB:.1f} GiB (the "
            f"parameters outside the blocks" + ("" if largest_block_bytes is None else " and the gathered blocks in flight")
            + ")" + ("" if fits_off else " and still does not fit: add ranks or use fp8 weights") + f"; {cost.text}"
        )
        return ShardChoice("blocks+offload", reason, cost.slower)
    slower = None
    if link is not None and compute_ms_one_card is not None:
        sharded = sharded_step_ms(compute_ms_one_card / world_size, weight_bytes * block_fraction, world_size, link)
        offloaded = offloaded_step_ms(compute_ms_one_card, weight_bytes)
        slower = sharded > offloaded
        if slower:
            reason += (f"; on {get_profile(link).name} a sharded step ({sharded:.0f} ms modelled) is slower than one card "
                       f"with the model offloaded ({offloaded:.0f} ms): sharding is what makes the model fit each card")
    return ShardChoice("blocks", reason, slower)
