"""The explicit, immutable parallel context every adapter and helper receives.

Design decision: nothing in ``distributed/`` reads the WORLD group, ``LOCAL_RANK`` or derives a device
from the rank number. In a Ray actor the GPU Ray assigned is usually ``cuda:0``, and one process may
host several groups (a VAE group and a sampling group), so the group, rank and device travel together
in one frozen value that is passed in explicitly.

The context also carries the group's **band weights** (``None``: equal bands), one figure per rank (its measured
throughput, ``topology.throughput``): every band table of the group (VAE row bands, UNet row bands, DiT token
shards, ``distributed/bands.py``) is derived from them, so every rank of a group derives the same speed-weighted
table from the same shared value, with no collective at the layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .bands import quantize_weights

__all__ = ["ParallelContext"]


@dataclass(frozen=True)
class ParallelContext:
    """Who this rank is, inside which group, on which device.

    Args:
        group: the ``torch.distributed`` process group the ranks share, or ``None`` for one rank.
        rank: this process's rank inside ``group``.
        world_size: number of ranks in ``group``.
        global_ranks: the WORLD ranks of ``group``'s members, in group-rank order.
        device: the device this rank computes on (what Ray assigned; ``cpu`` for CPU ranks).
        backend: ``"gloo"`` or ``"nccl"`` (``"none"`` for one rank without a group).
        band_weights: one positive figure per member (e.g. its measured throughput) that makes the group's band
            tables proportional to them; ``None`` (default): equal bands.

    Example:
        >>> ctx = ParallelContext.single(torch.device("cpu"))
        >>> ctx.world_size
        1
    """

    group: Any
    rank: int
    world_size: int
    global_ranks: tuple = field(default=())
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "none"
    band_weights: Optional[tuple] = None

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1 (got {self.world_size})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size) (got rank {self.rank}, world_size {self.world_size})")
        if self.global_ranks and len(self.global_ranks) != self.world_size:
            raise ValueError(
                f"global_ranks must list one WORLD rank per member (got {len(self.global_ranks)} for "
                f"world_size {self.world_size})"
            )
        if self.world_size > 1 and self.group is None:
            raise ValueError("a context with world_size > 1 needs a process group; pass group=")
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))
        if self.band_weights is not None:
            weights = tuple(float(w) for w in self.band_weights) if all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.band_weights) else tuple(self.band_weights)
            quantize_weights(weights, self.world_size)  # one positive finite figure per member, else ValueError
            object.__setattr__(self, "band_weights", weights)

    def with_band_weights(self, weights: Optional[Sequence[float]]) -> "ParallelContext":
        """This context with ``weights`` (one per member; ``None``: equal bands) as its band weights."""
        return dataclasses.replace(self, band_weights=None if weights is None else tuple(weights))

    def member_weights(self, parent_weights: Optional[Sequence[float]], parent_ranks: Sequence[int]) -> "ParallelContext":
        """This (sub)group's context with its members' figures taken from a parent group's weights.

        Args:
            parent_weights: the parent group's band weights (``None``: equal bands here too).
            parent_ranks: the parent's WORLD ranks in its group-rank order (``parent.global_ranks``).
        """
        if parent_weights is None or self.world_size == 1:
            return self.with_band_weights(None)
        index = {g: i for i, g in enumerate(parent_ranks)}
        members = self.global_ranks or tuple(range(self.world_size))
        return self.with_band_weights([parent_weights[index[g]] for g in members])

    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelContext":
        """A one-rank context: every collective becomes a no-op."""
        return cls(group=None, rank=0, world_size=1, global_ranks=(0,), device=torch.device(device or "cpu"))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def stages_p2p_through_host(self) -> bool:
        """gloo cannot send/recv CUDA tensors ('writev: Bad address'), so point-to-point is staged on the host."""
        return self.backend == "gloo" and self.device.type == "cuda"
