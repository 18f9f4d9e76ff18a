"""Modelled step time of the patch-parallel sampling presets on a link and a rank count: what ``preset=auto`` uses.

Design decisions:

* **The sampling benchmark's step model, per rank, after the warm-up.** A step is the rank's compute ``c``, plus a
  blocking exchange in full, plus the part of an asynchronous stream that does not hide behind compute:
  ``step = c + blocking * k + max(0, stream * k - c)`` with ``k`` the link's milliseconds per byte (doubled when
  staged through host memory, :func:`.links.effective_gbps`). The compressed presets add their codec to ``c`` and
  shrink the stream by their packing. It is the formula of ``bench/compressed_model.step_ms`` (which imports the codec constants from here), which produced the
  MODELLED figures of ``results/compressed/``; it is written here because the runtime never imports the benchmark.
  Message latencies are left out (every preset makes about the same calls) and so are the warm-up steps (the same
  synchronous steps for every stale preset; the step count is not known when the preset is chosen).
* **One number describes the workload: its exchange rate** ``E`` (GB/s): the K/V and halo bytes of the *whole*
  latent that displaced mode streams per step, divided by one rank's compute time for that step. Over N sequence
  ranks a rank computes ``C / N`` (the ideal share) and puts ``(N - 1) / N`` of the whole on its link (its 1/N piece
  to each of N - 1 peers; counted for SDXL on an H200: 436 MB per rank at N = 2, 679 MB at N = 4, 1.56x where
  (3/4) / (1/2) = 1.5). Relative to the one-rank step, the stream then takes ``(N - 1) / N * E / b`` against a
  compute share of ``1 / N``: the stream hides behind compute while ``(N - 1) * E <= b`` (``b`` the link's effective
  bandwidth). That is how the rank count enters: N - 1 peers' worth of traffic against 1/N of the compute.
* **Measured exchange rates** (counted bytes per step over the one-rank step, on an H200): SDXL 1024x1024 872 MB /
  65.8 ms = 13.3 GB/s; FLUX.1 1024x1024 2,870 MB / 172.3 ms = 16.7 GB/s; Qwen-Image 1328x1328 10,282 MB / 694 ms
  = 14.8 GB/s; Wan 2.1 14B 480x832x81 53,682 MB / 6,460 ms = 8.3 GB/s (results/compressed/README.md). The defaults
  are SDXL's for UNets and the highest DiT figure (FLUX.1) for DiTs: where a DiT's real rate is lower, the choice errs
  towards compression, whose cost is its codec (measured: :data:`CODEC_MS_PER_GB`; the Triton kernels, 4-bit,
  SDXL's rate at N = 2: 1.3% of a one-rank step, 2.6% of a rank's share), not towards an uncovered stream. A slower GPU computes longer per byte, so
  its rate is lower and the stream hides more easily: on consumer cards the defaults lean towards less traffic.
* **Exactness is worth a margin.** ``full_sync`` (exact) is chosen when its modelled step is within
  :data:`EXACT_MARGIN` of the fastest preset's; otherwise the fastest wins, ties going to the earlier (less lossy)
  candidate.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence

from .links import effective_gbps, get_profile

__all__ = [
    "EXCHANGE_GBPS",
    "EXACT_MARGIN",
    "CODEC_GBPS",
    "CODEC_PASSES",
    "CODEC_MS_PER_GB",
    "PresetTraffic",
    "PresetChoice",
    "packing",
    "preset_step",
    "choose_preset",
]

#: default exchange rate per model kind, GB/s of displaced's whole-latent K/V and halo bytes per second of one rank's
#: compute (measured on an H200, see the module docstring)
EXCHANGE_GBPS: Dict[str, float] = {"unet": 13.3, "dit": 16.7}
#: full_sync (exact) is chosen when its modelled step is at most this much slower than the fastest preset's
EXACT_MARGIN = 0.10
#: the earlier ASSUMED codec cost (memory traffic: 5 passes over the streamed bytes at 2 TB/s); kept for the
#: benchmark's comparison (``bench/compressed_model`` without ``--codec``)
CODEC_GBPS = 2000.0
CODEC_PASSES = 5
#: MEASURED codec cost on an H200 (``tools/dev/codec_bench.py``, bf16 chunks of 1.3e8 elements, torch 2.11, Triton 3.6,
#: results/h200/codec/): milliseconds per GB of a rank's own uncompressed stream to encode it, and per GB of one
#: peer's stream to apply it, by code width, for each codec a rank may run (``comm_manager.CODECS``): ``triton``
#: (two fused kernels, GPU ranks with Triton), ``compiled`` (``torch.compile``), ``eager`` (op by op)
CODEC_MS_PER_GB: Dict[str, Dict[int, tuple]] = {
    "triton": {4: (1.28, 0.70), 2: (1.36, 0.80), 1: (1.16, 0.65)},
    "compiled": {4: (4.97, 2.57), 2: (5.58, 2.91), 1: (4.07, 3.06)},
    "eager": {4: (27.48, 9.56), 2: (31.75, 14.79), 1: (23.09, 10.64)},
}


class PresetTraffic(NamedTuple):
    """What the model needs to know about a preset.

    Args:
        name: the preset's name.
        blocking: its exchange waits every step (``full_sync``); else it streams behind the next step's compute.
        bits: 0 (values as they are) or the width of its packed residuals (``exchange_bits``).
    """

    name: str
    blocking: bool
    bits: int = 0


class PresetChoice(NamedTuple):
    """The chosen preset and every candidate's modelled step, in units of one rank's whole step (1 / speed-up)."""

    preset: str
    steps: Dict[str, float]


def packing(bits: int, itemsize: int = 2, group: int = 256) -> float:
    """Bytes sent per byte of ``itemsize``-byte values: 1 for ``bits=0``, else ``bits``-bit codes plus one float32
    scale per ``group`` values (the compressed exchange's layout: 4-bit 0.258, 2-bit 0.133, 1-bit 0.070 of fp16)."""
    if not bits:
        return 1.0
    return (group * bits / 8 + 4) / (group * itemsize)


def preset_step(traffic: PresetTraffic, world_size: int, profile, exchange_gbps: float, codec: str = "triton") -> float:
    """The modelled step of one rank, in units of one rank's whole step (so ``1 / result`` is the speed-up).

    Args:
        traffic: the preset (:class:`PresetTraffic`).
        world_size: the ranks that share the latent (N).
        profile: a link profile or its name (:mod:`.links`).
        exchange_gbps: the workload's exchange rate ``E`` (:data:`EXCHANGE_GBPS`).
        codec: ``"triton"`` (GPU ranks with Triton, the default), ``"compiled"`` or ``"eager"``: which measured
            codec cost a compressed preset adds to its compute (:data:`CODEC_MS_PER_GB`).

    Example:
        >>> round(preset_step(PresetTraffic("displaced", False), 2, "nvlink", 13.3), 3)  # the stream hides
        0.5
    """
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    compute = 1.0 / n
    whole = (n - 1) / n * float(exchange_gbps)  # GB per one-rank step-second this rank exchanges, uncompressed
    transfer = whole * packing(traffic.bits) / effective_gbps(get_profile(profile))
    if traffic.blocking:
        return compute + transfer
    if traffic.bits:
        if codec not in CODEC_MS_PER_GB:
            raise ValueError(f"codec must be one of {', '.join(CODEC_MS_PER_GB)} (got {codec!r})")
        table = CODEC_MS_PER_GB[codec]
        enc, app = table.get(traffic.bits, table[4])
        own = float(exchange_gbps) / n  # this rank's own stream, GB per one-rank step-second
        compute += own * (enc + (n - 1) * app) / 1e3
    return compute + max(0.0, transfer - compute)


def choose_preset(candidates: Sequence[PresetTraffic], world_size: int, profile, exchange_gbps: float,
                  exact_margin: Optional[float] = None, codec: str = "triton") -> PresetChoice:
    """The fastest candidate on ``profile`` at ``world_size`` ranks, or the blocking (exact) one when it is within
    ``exact_margin`` (default :data:`EXACT_MARGIN`) of the fastest. Ties go to the earlier candidate."""
    if not candidates:
        raise ValueError("choose_preset needs at least one candidate")
    margin = EXACT_MARGIN if exact_margin is None else float(exact_margin)
    steps = {c.name: preset_step(c, world_size, profile, exchange_gbps, codec) for c in candidates}
    best = min(candidates, key=lambda c: steps[c.name])  # min keeps the first of equal ones
    for c in candidates:
        if c.blocking and not c.bits and steps[c.name] <= (1.0 + margin) * steps[best.name]:
            return PresetChoice(c.name, steps)
    return PresetChoice(best.name, steps)
