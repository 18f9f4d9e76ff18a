"""How the cluster's ranks share a sampling run: the widgets of PatchRay Parallel Model (and the Distributed KSampler),
as one typed, immutable value.

The Parallel Model node stores it in the MODEL it returns; whatever sampler node then samples with that MODEL hands it
to :func:`.parallel_model.sample_guided`. It is validated when it is made (``__post_init__``), so a bad widget value
is refused on the node that has it, in that widget's name, before any rank starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

from . import model as bridge_model
from .shard_models import SHARDING_NAMES

__all__ = [
    "SamplingOptions", "PRESET_NAMES", "PRESET_HELP", "PARALLELISM_NAMES", "ATTENTION_NAMES", "BALANCE_NAMES",
    "SHARDING_NAMES", "link_profile", "auto_inputs", "patch_config",
]

log = logging.getLogger(__name__)

PRESET_NAMES = ["full_sync", "auto", "displaced", "compressed", "compressed_2bit", "compressed_1bit", "otil", "otil_compressed", "balanced"]
#: the node's help text for each preset (the widget's tooltip is built from it)
PRESET_HELP = {
    "full_sync": "exact (equal to the stock KSampler): every layer exchanges every step",
    "auto": "picked from the GPUs' link and the number of ranks sharing the latent, by the modelled step time: "
            "displaced while its stream hides behind compute ((ranks - 1) x the model's exchange rate fits the link), "
            "compressed (or compressed_2bit on Ethernet) once it does not, full_sync when exact costs under 10% more "
            "(e.g. PCIe without P2P: displaced at 2 ranks, compressed at 4; NVLink: full_sync up to 3 ranks, "
            "displaced from 4; CPU ranks or no GPU link measured: full_sync)",
    "displaced": "DistriFusion/PipeFusion: the neighbours' halos and K/V of the previous step, sent asynchronously behind "
                 "compute; 4 exact warm-up steps",
    "compressed": "displaced, but the per-step refresh travels as 4-bit residuals with error feedback (CompactFusion): "
                  "~1/4 of displaced's bytes at displaced's error; for PCIe without P2P",
    "compressed_2bit": "compressed with 2-bit residuals: ~1/7.5 of displaced's bytes, slightly larger error (Ethernet)",
    "compressed_1bit": "compressed with 1-bit (sign) residuals: ~1/14 of displaced's bytes, larger error",
    "otil": "stale layers refreshed every 10 steps, plus only the top-k most-changed latent blocks sent per step (OTIL)",
    "otil_compressed": "compressed layers plus OTIL's top-k latent blocks as 4-bit residuals",
    "balanced": "stale layers refreshed every 5 steps, full output exchange",
}
PARALLELISM_NAMES = ["auto", "sequence", "cfg", "cfg+sequence", "batch"]  # dit_layout.MODES, without importing it here
ATTENTION_NAMES = ["auto", "gathered", "overlapped", "ring", "ulysses"]
BALANCE_NAMES = ["equal", "speed"]  # topology.throughput.BALANCE_MODES, without importing it here


def _choice(name: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {list(options)} (got {value!r})")


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling widgets (every name is the widget's). Frozen and hashable; travels nowhere (driver side only).

    Args:
        cluster: the PatchRay Cluster node's ``ClusterConfig``.
        preset: :data:`PRESET_NAMES` (``full_sync``: exact; the others trade exactness for less traffic).
        warmup_steps, refresh_every: the preset's synchronous steps at the start / every Nth step (-1: the preset's).
        k_ratio, block_size: OTIL's fraction of latent blocks sent per step and the block side in latent pixels.
        parallelism: :data:`PARALLELISM_NAMES` (see :mod:`.dit_layout`).
        sequence_attention: :data:`ATTENTION_NAMES`.
        balance: :data:`BALANCE_NAMES`.
        sharding: :data:`SHARDING_NAMES`.
    """

    cluster: object
    preset: str = "full_sync"
    warmup_steps: int = -1
    refresh_every: int = -1
    k_ratio: float = 0.25
    block_size: int = 8
    parallelism: str = "auto"
    sequence_attention: str = "auto"
    balance: str = "equal"
    sharding: str = "none"

    def __post_init__(self):
        from ...distributed.cluster import ClusterConfig

        if not isinstance(self.cluster, ClusterConfig):
            raise TypeError(f"cluster must come from a PatchRay Cluster node (got {type(self.cluster).__name__})")
        _choice("preset", self.preset, PRESET_NAMES)
        _choice("parallelism", self.parallelism, PARALLELISM_NAMES)
        _choice("sequence_attention", self.sequence_attention, ATTENTION_NAMES)
        _choice("balance", self.balance, BALANCE_NAMES)
        _choice("sharding", self.sharding, SHARDING_NAMES)
        for name in ("warmup_steps", "refresh_every", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be a whole number (got {value!r})")
        if self.warmup_steps < -1 or self.refresh_every < -1:
            raise ValueError("warmup_steps and refresh_every must be -1 (the preset's) or >= 0 "
                             f"(got {self.warmup_steps}, {self.refresh_every})")
        if not 1 <= self.block_size <= 64:
            raise ValueError(f"block_size must be 1..64 latent pixels (got {self.block_size})")
        if not 0.0 < float(self.k_ratio) <= 1.0:
            raise ValueError(f"k_ratio must be in (0, 1] (got {self.k_ratio})")

    @property
    def num_ranks(self) -> int:
        return int(self.cluster.num_ranks)

    def replace(self, **changes) -> "SamplingOptions":
        return replace(self, **changes)

    def patch_config(self, model, parallelism: Optional[str] = None):
        """The library's ``PatchConfig`` for these widgets and ``model`` (``preset=auto`` decides from the model's
        kind, the link and the ranks sharing the latent under ``parallelism``, the resolved one when known)."""
        auto = auto_inputs(model, self.cluster, parallelism or self.parallelism) if self.preset == "auto" else {}
        return patch_config(self.preset, self.warmup_steps, self.refresh_every, self.k_ratio, self.block_size, **auto)


def link_profile(cluster_config) -> Optional[str]:
    """The named link profile nearest to the cluster's slowest GPU link (the topology probe, once per cluster
    configuration, no bandwidth runs); ``None`` for CPU ranks or when no link is known."""
    if getattr(cluster_config, "device", "auto") == "cpu":
        return None
    try:
        from ...distributed.topology import cached_probe
        from ...distributed.topology.links import bottleneck_link, nearest_profile

        link = bottleneck_link(cached_probe(("ksampler-auto", cluster_config), measure=False))
        prof = nearest_profile(link.bandwidth_gbps, link.via_host) if link.bandwidth_gbps else None
        return prof.name if prof is not None else None
    except Exception as exc:  # advice is optional: never fail a sampling run over it
        log.debug("topology probe unavailable: %s", exc)
        return None


def auto_inputs(model, cluster_config, parallelism: str = "auto") -> dict:
    """What ``preset=auto`` decides from, as :func:`patch_config`'s keywords: the link profile (:func:`link_profile`),
    the ranks that share the latent and the model kind (``unet`` / ``dit``).

    The ranks that share the latent: one under ``cfg`` and ``batch`` (every rank holds whole latents, so ``auto``
    gives the exact preset), half the cluster's under ``cfg+sequence``, all of them under ``sequence`` and ``auto``
    parallelism (decided later, per call; counting all errs towards less traffic)."""
    n = int(getattr(cluster_config, "num_ranks", 1) or 1)
    ranks = {"cfg": 1, "batch": 1, "cfg+sequence": max(1, n // 2)}.get(parallelism, n)
    try:
        kind = bridge_model.diffusion_kind(model)
    except Exception as exc:  # refused later, in the user's terms, by sample()'s own checks
        log.debug("model kind unknown for preset auto: %s", exc)
        kind = "unet"
    return {"link": link_profile(cluster_config), "ranks": ranks, "kind": kind}


def patch_config(preset: str, warmup_steps: int = -1, refresh_every: int = -1, k_ratio: float = 0.25, block_size: int = 8,
                 link: Optional[str] = None, ranks: Optional[int] = None, kind: str = "unet"):
    """The PatchConfig for the node's widgets (-1: the preset's own value). CFG is not split across ranks.

    ``preset="auto"`` picks one from ``link`` (a link profile name, :func:`link_profile`), ``ranks`` (the ranks that
    share the latent; ``None``: the link class alone) and ``kind`` (``unet`` / ``dit``): see :data:`PRESET_HELP` and
    :func:`auto_inputs`.
    """
    from ...distributed.sampling.config import OutputMode, auto_preset, preset as make

    if preset not in PRESET_NAMES:
        raise ValueError(f"preset must be one of {PRESET_NAMES} (got {preset!r})")
    if preset == "auto":
        preset = auto_preset(link, ranks, kind=kind)
        log.info("PatchRay KSampler: preset auto -> %s (link %s, %s ranks, %s)", preset, link or "unknown",
                 ranks if ranks is not None else "?", kind)
    over = {"split_batch": False}  # ComfyUI may evaluate cond and uncond in separate calls: every rank takes both
    if preset != "full_sync":
        if int(warmup_steps) >= 0:
            over["warmup_steps"] = int(warmup_steps)
        if int(refresh_every) >= 0:
            over["refresh_every"] = int(refresh_every)
    config = make(preset, **over)
    if config.output is OutputMode.OTIL:
        config = config.replace(k_ratio=float(k_ratio), block_size=int(block_size))
    return config
