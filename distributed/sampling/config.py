"""Patch-parallel sampling configuration: one frozen dataclass, validated on construction, and named presets.

Design decisions:

* **Three orthogonal axes, not one mode string.** DistriFusion's reference code folds "how layers talk" and "how
  GroupNorm talks" into one ``mode`` (``corrected_async_gn``, ``no_sync``, ...), so "GroupNorm synchronised,
  everything else stale" cannot be asked for without patching it. Here :class:`PatchConfig` has ``layer_mode``
  (conv halos and self-attention K/V), ``groupnorm`` (the statistics) and ``output`` (how the denoiser output is
  completed on every rank) as separate fields, so every combination is a value, not a patch.
* **Synchronous steps are a function of the logical step index** (:meth:`PatchConfig.is_sync_step`): the warm-up
  steps and every ``refresh_every``-th step. Nothing resets a step counter to force a refresh, so the refresh
  cannot disturb the schedule that decides it (resetting the model's own counter would also restart the warm-up
  bookkeeping that reads it).
* **Presets are data** (:data:`PRESETS`), named by what they do, and :func:`preset` applies overrides through
  ``dataclasses.replace`` so the result is validated again. Old names stay accepted as deprecated aliases
  (:data:`DEPRECATED_PRESETS`): saved workflows may still use them.

Presets (what each trades is in docs/sampling.md, "Presets"):

* ``full_sync``: every step synchronous; equals the single-rank result within floating-point tolerance.
* ``displaced``: DistriFusion's displaced patch parallelism: halos and K/V one step stale through asynchronous
  all-gathers, corrected-async GroupNorm, full gather of the denoiser output, 4 synchronous warm-up steps.
* ``otil_unsynced``: OTIL with nothing else synchronised after the warm-up: halos and K/V frozen at the last
  warm-up step, each band normalised with its own GroupNorm statistics, only the top-k latent blocks travel
  (k/K = 1/4, 8x8 blocks). The least traffic and the largest error; formerly ``guide``.
* ``otil``: ``otil_unsynced`` plus two fixes for what stays stale: synchronised GroupNorm statistics and a
  synchronous refresh of halos and K/V every 10 steps.
* ``balanced``: keeps the full output gather (cheap: one band per step) and spends the budget on quality:
  synchronised GroupNorm and a refresh every 5 steps.
* ``compressed``: ``displaced`` whose per-step halo and K/V refresh travels as 4-bit residuals with error feedback
  (CompactFusion-style, ``exchange_bits``): about 1/4 of displaced's bf16 bytes at displaced's error (within a
  few percent), for links without GPU peer-to-peer.
* ``compressed_2bit`` / ``compressed_1bit``: the same with 2-bit (Lloyd-Max) or 1-bit (sign) residuals: about
  1/7.5 and 1/14 of displaced's bytes, for slower links (Ethernet), at a somewhat larger error.
* ``otil_compressed``: ``otil``'s latent blocks as 4-bit residuals (``compress_bits``) on top of ``compressed``
  halos and K/V.

:func:`auto_preset` picks one from a link profile (the probe's nearest profile; none known -> ``full_sync``) and the
rank count: the fastest by the modelled step time (``topology/preset_cost.py``: a rank's compute share 1/N against
the (N-1)/N of the exchange it sends), ``full_sync`` when within 10% of it. Without a rank count, the link class
alone: NVLink-class -> ``full_sync``, PCIe with peer-to-peer -> ``displaced``, PCIe without peer-to-peer or slower
-> ``compressed``, Ethernet-class (< 2 GB/s) -> ``compressed_2bit``.

Every preset keeps ``cfg_repair`` on (with ``split_batch``, a rank would otherwise combine a fresh CFG half with
the other half as of the last synchronous step); turn it off only to reproduce that error.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from dataclasses import dataclass
from typing import Dict, Optional

__all__ = [
    "LayerMode",
    "GroupNormMode",
    "OutputMode",
    "PatchConfig",
    "PRESETS",
    "DEPRECATED_PRESETS",
    "preset",
    "auto_preset",
    "EXCHANGE_BITS",
]

#: ``exchange_bits`` values: 0 (values as they are) or the compressed exchange's code widths
EXCHANGE_BITS = (0, 1, 2, 4)

log = logging.getLogger(__name__)


class LayerMode(str, enum.Enum):
    """How conv halos and self-attention K/V travel between ranks."""

    FULL_SYNC = "full_sync"  # every step, blocking: exact
    DISPLACED = "displaced"  # DistriFusion: the neighbours' values from the previous step, async all-gather
    NO_SYNC = "no_sync"  # only on synchronous steps (warm-up, refresh); stale in between


class GroupNormMode(str, enum.Enum):
    """How GroupNorm statistics are formed on steps that are not synchronous."""

    SYNC = "sync"  # one all-gather of (mean, M2) per GroupNorm, merged exactly (Chan)
    STALE = "stale"  # previous step's statistics of the peers, this rank's fresh ones
    CORRECTED_ASYNC = "corrected_async"  # DistriFusion: stale global moments + (fresh - stale) local moments
    SEPARATE = "separate"  # local statistics only


class OutputMode(str, enum.Enum):
    """How every rank completes the denoiser output outside its band."""

    GATHER = "gather"  # one all-gather of the bands: every rank holds the exact output
    OTIL = "otil"  # only the top-k most-changed sub-blocks of each band travel; the rest is stale memory


def _enum(cls, value, field_name):
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{field_name} must be one of {choices} (got {value!r})") from None


@dataclass(frozen=True)
class PatchConfig:
    """Everything patch-parallel sampling needs to know; validated in ``__post_init__``.

    Args:
        layer_mode: ``"full_sync"``, ``"displaced"`` or ``"no_sync"`` (see :class:`LayerMode`).
        groupnorm: ``"sync"``, ``"stale"``, ``"corrected_async"`` or ``"separate"`` (see :class:`GroupNormMode`);
            used on steps that are not synchronous.
        output: ``"gather"`` or ``"otil"`` (see :class:`OutputMode`).
        warmup_steps: the first logical steps run fully synchronous (DistriFusion: 4). Must be >= 1 unless
            ``layer_mode="full_sync"``: stale modes need one synchronous step to fill their memory. On DiTs only the
            last one fills it; the ones before run the cheapest exact attention (``sampling/dit.py``).
        refresh_every: every ``refresh_every``-th logical step (step % R == 0) after warm-up runs synchronous,
            refreshing halos, K/V, GroupNorm statistics and the output memory; 0 = never.
        split_batch: put the two CFG halves on two halves of the ranks (needs an even world size and a caller
            that batches [uncond, cond]); otherwise every rank patch-parallelises the whole batch.
        cfg_repair: with ``split_batch``, exchange each rank's fresh band with the rank holding the same band of
            the other CFG half (one all-gather over that pair) every step. Off reproduces the stale-half CFG
            error this repairs (docs/sampling.md, "CFG repair").
        cfg_repair_half: exchange the whole completed half (own band fresh, remote bands as this rank's OTIL memory
            holds them) instead of the band, so both CFG halves are equally fresh outside the band too; costs
            (ranks per half) x the band's bytes.
        block_size: OTIL square sub-block side, in latent pixels (the paper: 8).
        k_ratio: OTIL blocks sent per step as a fraction of the band's blocks (the paper: 1/4).
        k_blocks: an absolute k instead of ``k_ratio`` (clipped to each band's block count).
        adaptive_k: choose k from the link bandwidth (``link_bandwidth_gbps``, or measured once at setup) so the
            latent exchange fits ``comm_budget_ms`` per step.
        link_bandwidth_gbps: the link's bandwidth in GB/s for ``adaptive_k`` (None: measure it once).
        comm_budget_ms: per-step time budget of the latent exchange for ``adaptive_k``.
        compress_bits: 0 (off) or 8/4/2/1: send OTIL's selected blocks as low-bit residuals against what the peers
            hold, with error feedback (CompactFusion-style).
        exchange_bits: 0 (off) or 4/2/1, with ``layer_mode="displaced"``: the per-step refresh of halos and K/V
            travels as low-bit residuals with error feedback (``parallel.exchange.CompressedExchange``);
            synchronous steps stay exact.
        comm_checkpoint: in ``displaced`` mode, issue one asynchronous all-gather per this many buffers.

    Example:
        >>> cfg = preset("otil", k_ratio=0.5)
        >>> cfg.is_sync_step(3), cfg.is_sync_step(5)
        (True, False)
    """

    layer_mode: LayerMode = LayerMode.DISPLACED
    groupnorm: GroupNormMode = GroupNormMode.CORRECTED_ASYNC
    output: OutputMode = OutputMode.GATHER
    warmup_steps: int = 4
    refresh_every: int = 0
    split_batch: bool = True
    cfg_repair: bool = True
    cfg_repair_half: bool = False
    block_size: int = 8
    k_ratio: float = 0.25
    k_blocks: Optional[int] = None
    adaptive_k: bool = False
    link_bandwidth_gbps: Optional[float] = None
    comm_budget_ms: float = 1.0
    compress_bits: int = 0
    comm_checkpoint: int = 60
    exchange_bits: int = 0

    def __post_init__(self):
        object.__setattr__(self, "layer_mode", _enum(LayerMode, self.layer_mode, "layer_mode"))
        object.__setattr__(self, "groupnorm", _enum(GroupNormMode, self.groupnorm, "groupnorm"))
        object.__setattr__(self, "output", _enum(OutputMode, self.output, "output"))
        for name in ("warmup_steps", "refresh_every", "block_size", "comm_checkpoint", "compress_bits", "exchange_bits"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0 (got {self.warmup_steps}); use 0 only with layer_mode='full_sync'")
        if self.layer_mode is not LayerMode.FULL_SYNC and self.warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be >= 1 with layer_mode={self.layer_mode.value!r} (got {self.warmup_steps}): stale "
                "halos and K/V are filled by a synchronous step; set warmup_steps=1 or more (DistriFusion uses 4)"
            )
        if self.layer_mode is LayerMode.FULL_SYNC and self.groupnorm is not GroupNormMode.SYNC:
            raise ValueError(
                f"groupnorm must be 'sync' with layer_mode='full_sync' (got {self.groupnorm.value!r}): full_sync promises "
                "the single-rank result; set groupnorm='sync' or pick layer_mode='displaced'/'no_sync'"
            )
        if self.layer_mode is LayerMode.FULL_SYNC and self.output is not OutputMode.GATHER:
            raise ValueError(
                f"output must be 'gather' with layer_mode='full_sync' (got {self.output.value!r}): OTIL leaves remote "
                "regions stale, which breaks full_sync's exactness; set output='gather' or layer_mode='no_sync'"
            )
        if self.refresh_every < 0:
            raise ValueError(f"refresh_every must be >= 0 (got {self.refresh_every}); 0 disables the periodic refresh")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 latent pixel (got {self.block_size}); the OTIL paper uses 8")
        if not (isinstance(self.k_ratio, (int, float)) and 0.0 < float(self.k_ratio) <= 1.0):
            raise ValueError(f"k_ratio must be in (0, 1] (got {self.k_ratio!r}); the OTIL paper uses 0.25")
        if self.k_blocks is not None and (not isinstance(self.k_blocks, int) or self.k_blocks < 1):
            raise ValueError(f"k_blocks must be a positive int or None (got {self.k_blocks!r}); None uses k_ratio")
        if self.cfg_repair_half and not self.cfg_repair:
            raise ValueError("cfg_repair_half widens cfg_repair; set cfg_repair=True or cfg_repair_half=False")
        if self.compress_bits not in (0, 1, 2, 4, 8):
            raise ValueError(f"compress_bits must be 0 (off), 1, 8, 4 or 2 (got {self.compress_bits})")
        if self.exchange_bits not in EXCHANGE_BITS:
            raise ValueError(f"exchange_bits must be 0 (off), 4, 2 or 1 (got {self.exchange_bits})")
        if self.exchange_bits and self.layer_mode is not LayerMode.DISPLACED:
            raise ValueError(
                f"exchange_bits={self.exchange_bits} compresses the displaced per-step refresh of halos and K/V; set "
                f"layer_mode='displaced' (got {self.layer_mode.value!r}) or exchange_bits=0"
            )
        if self.compress_bits and self.output is not OutputMode.OTIL:
            raise ValueError(
                f"compress_bits={self.compress_bits} compresses OTIL's selected blocks; set output='otil' or compress_bits=0"
            )
        if self.adaptive_k and self.output is not OutputMode.OTIL:
            raise ValueError("adaptive_k chooses OTIL's k; set output='otil' or adaptive_k=False")
        if self.adaptive_k and self.k_blocks is not None:
            raise ValueError("adaptive_k and k_blocks both choose k; set k_blocks=None or adaptive_k=False")
        if self.link_bandwidth_gbps is not None and not float(self.link_bandwidth_gbps) > 0:
            raise ValueError(f"link_bandwidth_gbps must be > 0 GB/s or None (got {self.link_bandwidth_gbps!r})")
        if not float(self.comm_budget_ms) > 0:
            raise ValueError(f"comm_budget_ms must be > 0 (got {self.comm_budget_ms!r})")
        if self.comm_checkpoint < 1:
            raise ValueError(f"comm_checkpoint must be >= 1 buffer per all-gather (got {self.comm_checkpoint}); DistriFusion uses 60")

    # ------------------------------------------------------------------------------------------------

    def is_sync_step(self, step: int) -> bool:
        """Whether logical step ``step`` (0-based) runs fully synchronous (warm-up or periodic refresh)."""
        if self.layer_mode is LayerMode.FULL_SYNC or step < self.warmup_steps:
            return True
        return self.refresh_every > 0 and step % self.refresh_every == 0

    def k_for(self, num_blocks: int) -> int:
        """OTIL's k for a band of ``num_blocks`` sub-blocks (before ``adaptive_k``)."""
        if self.k_blocks is not None:
            return max(1, min(num_blocks, self.k_blocks))
        return max(1, min(num_blocks, math.ceil(float(self.k_ratio) * num_blocks)))

    def replace(self, **overrides) -> "PatchConfig":
        """A validated copy with ``overrides`` applied (unknown names raise ``TypeError`` naming them)."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"PatchConfig has no field(s) {unknown}; fields: {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, enum.Enum) else v
        return out


PRESETS: Dict[str, PatchConfig] = {
    "full_sync": PatchConfig(layer_mode="full_sync", groupnorm="sync", output="gather", warmup_steps=0),
    "displaced": PatchConfig(layer_mode="displaced", groupnorm="corrected_async", output="gather", warmup_steps=4),
    "otil_unsynced": PatchConfig(layer_mode="no_sync", groupnorm="separate", output="otil", warmup_steps=4, refresh_every=0),
    "otil": PatchConfig(layer_mode="no_sync", groupnorm="sync", output="otil", warmup_steps=4, refresh_every=10),
    "balanced": PatchConfig(layer_mode="no_sync", groupnorm="sync", output="gather", warmup_steps=4, refresh_every=5),
    "compressed": PatchConfig(layer_mode="displaced", groupnorm="corrected_async", output="gather", warmup_steps=4, exchange_bits=4),
    "compressed_2bit": PatchConfig(layer_mode="displaced", groupnorm="corrected_async", output="gather", warmup_steps=4, exchange_bits=2),
    "compressed_1bit": PatchConfig(layer_mode="displaced", groupnorm="corrected_async", output="gather", warmup_steps=4, exchange_bits=1),
    "otil_compressed": PatchConfig(layer_mode="displaced", groupnorm="corrected_async", output="otil", warmup_steps=4,
                                   exchange_bits=4, compress_bits=4),
}

#: the presets :func:`auto_preset` chooses from, fastest link first (least lossy first: ties go to the earlier)
AUTO_CHOICES = ("full_sync", "displaced", "compressed", "compressed_2bit")
#: without a rank count: at or above this effective bandwidth (GB/s, one copy, no host staging) the exact exchange is
#: nearly free
AUTO_EXACT_GBPS = 100.0
#: without a rank count: below this effective bandwidth (GB/s) 2-bit residuals (Ethernet between machines)
AUTO_TWO_BIT_GBPS = 2.0


def auto_preset(profile, world_size: Optional[int] = None, *, kind: str = "unet", exchange_gbps: Optional[float] = None) -> str:
    """The preset for a link (a ``topology.links`` profile or its name, e.g. the probe's nearest profile) and a rank count.

    With ``world_size`` (the ranks that share the latent): the fastest of :data:`AUTO_CHOICES` by the modelled step
    time (:mod:`..topology.preset_cost`: a rank's compute share ``1/N`` against the ``(N-1)/N`` of the exchange it
    sends, over the link), ``full_sync`` when it is within 10% of the fastest (exact is worth that much). The stream
    of displaced hides behind compute while ``(N - 1) x exchange rate <= the link's effective bandwidth``, so more
    ranks tip a link towards the compressed presets: PCIe 4.0 without P2P (13.8 GB/s effective) at the UNet default
    (13.3 GB/s) gives ``displaced`` at 2 ranks and ``compressed`` at 4; NVLink gives ``full_sync`` up to 3 ranks and
    ``displaced`` from 4 (the exact exchange then costs over 10% of a step).

    Without ``world_size`` (rank count unknown) the link class alone: NVLink-class (>= 100 GB/s, peer-to-peer) ->
    ``full_sync``; PCIe with peer-to-peer -> ``displaced``; staged through host memory (PCIe without P2P) or slower
    -> ``compressed`` (4-bit residuals); below 2 GB/s (10 GbE between machines) -> ``compressed_2bit``.

    ``None`` (no GPU link known, e.g. CPU ranks) -> ``full_sync`` (nothing to save: keep the exact result).

    Args:
        profile: the link profile or its name, or ``None``.
        world_size: the ranks that share the latent (the sequence ranks), or ``None``.
        kind: ``"unet"`` or ``"dit"``: picks the default exchange rate (``topology.preset_cost.EXCHANGE_GBPS``).
        exchange_gbps: the workload's exchange rate instead of the kind's default (GB/s of displaced's whole-latent
            exchange per second of one rank's compute).

    Example:
        >>> auto_preset("nvlink"), auto_preset("pcie4_x16_no_p2p"), auto_preset("10gbe")
        ('full_sync', 'compressed', 'compressed_2bit')
        >>> auto_preset("pcie4_x16_no_p2p", 2), auto_preset("pcie4_x16_no_p2p", 4)
        ('displaced', 'compressed')
    """
    if profile is None:
        return "full_sync"
    from ..topology.links import effective_gbps, get_profile

    p = get_profile(profile)
    if world_size is not None:
        from ..topology.preset_cost import EXCHANGE_GBPS, PresetTraffic, choose_preset

        if kind not in EXCHANGE_GBPS:
            raise ValueError(f"kind must be one of {', '.join(EXCHANGE_GBPS)} (got {kind!r})")
        rate = EXCHANGE_GBPS[kind] if exchange_gbps is None else float(exchange_gbps)
        candidates = [
            PresetTraffic(name, PRESETS[name].layer_mode is LayerMode.FULL_SYNC, PRESETS[name].exchange_bits)
            for name in AUTO_CHOICES
        ]
        return choose_preset(candidates, int(world_size), p, rate).preset
    gbps = effective_gbps(p)
    if gbps < AUTO_TWO_BIT_GBPS:
        return "compressed_2bit"
    if p.via_host:
        return "compressed"
    if gbps >= AUTO_EXACT_GBPS:
        return "full_sync"
    return "displaced" if gbps >= 10.0 else "compressed"


DEPRECATED_PRESETS: Dict[str, str] = {
    "guide": "otil_unsynced",
}
"""Old preset names, still accepted (with a warning), and the preset each now names."""


def preset(name: str, **overrides) -> PatchConfig:
    """The preset ``name`` with ``overrides`` applied (validated).

    A deprecated name (:data:`DEPRECATED_PRESETS`) resolves to its new name and logs a warning.

    Raises:
        ValueError: for an unknown preset name (the message lists the known ones).
    """
    if name in DEPRECATED_PRESETS:
        new = DEPRECATED_PRESETS[name]
        log.warning("preset %r is deprecated and will be removed; it is now called %r (same settings)", name, new)
        name = new
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
