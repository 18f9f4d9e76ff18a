"""Distributed VAE decode and encode on the rank cluster: the one entry point the nodes call.

The pieces live beside it: :mod:`.spec` (what the ranks build: :class:`VaeSpec`), :mod:`.checks` (the driver's
refusals and plans, made before anything is shipped), :mod:`.rank_tasks` (what each rank runs). This module runs
them on the cluster and keeps every public name in one place.

Design decisions:

* **Weights travel once per VAE and dtype**, by the one model transport (``sampling.ship.ship_model``, into the
  ranks' VAE slot, :mod:`.rank_tasks`): each call first asks the ranks whether they hold it, so a rebuilt cluster
  is sent the weights again; a rank replaced between that question and the call asks for them and is sent them.
* **balance** (``"equal"`` / ``"speed"``): row-mode bands are equal, or proportional to each rank's measured
  throughput (``topology.throughput``: a short fixed workload, measured once per cluster configuration and
  agreed by every rank). The same figures travel to every rank with the call, so every rank derives the same band
  table; the result is the same either way (row mode is exact for any band table). Tile-runs and the row-tiled
  retry keep their own plans.
* **A rank that runs out of memory does not fail the decode** (``on_oom="row-tiled"``, what the ComfyUI node
  uses): the decode is retried in row-tiled mode, the image cut into 2, then 4, then 8... full-width tiles that
  every rank row-shards in turn, so a rank holds 1/k of its row band at a time while every rank keeps working.
  More, smaller row bands of one image would need the image-wide GroupNorm statistics of a pass the ranks
  cannot afford; whole tiles per rank (tile-runs) would *raise* a rank's share (one tile instead of 1/N of
  one). The result is blended at the tile seams (within 1/255 for families without GroupNorm, close otherwise)
  and the report says so. An out-of-memory rank frees what its call allocated before it returns, and a group
  left waiting on it is rebuilt, so the retry starts from empty ranks.
* **Progress per stage** (``progress=``): rank 0 counts the VAE's top-level blocks as they finish (``stages.py``)
  and the cluster relays the figure; no collective is added.
* **Options are values.** What a decode or an encode does is one frozen dataclass (:class:`DecodeOptions`,
  :class:`EncodeOptions`, validated on construction) and how the call is watched is another (:class:`RunControls`:
  cancel check, time limit, progress), so the entry points share one parameter list instead of repeating it. The
  fields are also accepted as keywords (``distributed_decode(cluster, spec, z, mode="row")``), which is how the
  nodes and the tests call them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch

from .checks import MODES, check_decode_input, check_input, check_latent, choose_mode, row_tiled_plan, tile_plan_for
from .rank_tasks import VAE_SLOT, NeedWeights, begin_vae, decode_task, encode_task, end_vae, vae_key
from .spec import VaeSpec, latent_channels, latent_frames_hw, resolve_dtype, spec_for_family, spec_from_diffusers

__all__ = [
    "VaeSpec", "DecodeReport", "DecodeOptions", "EncodeOptions", "RunControls", "spec_for_family", "spec_from_diffusers", "distributed_decode", "decode_report",
    "distributed_encode", "check_decode_input", "latent_channels", "tile_plan_for", "choose_mode", "MODES", "OOM_POLICIES",
    "BALANCE_MODES",
]

log = logging.getLogger(__name__)

#: what a decode does when a rank runs out of memory: raise it, or retry row-tiled with ever smaller tiles
OOM_POLICIES = ("raise", "row-tiled")
#: how row-mode bands are sized: equal, or proportional to each rank's measured throughput
BALANCE_MODES = ("equal", "speed")
#: row-tiled retries cut the image into 2, 4, 8 ... full-width tiles, at most this many times
_OOM_RETRIES = 3
# names kept for callers of the pre-split module (tests import the tile helper by this name)
_row_tiled_plan = row_tiled_plan


def _cluster_topology(cluster) -> Any:
    """The probe's report for this cluster's GPUs, probed once per cluster configuration (no bandwidth runs)."""
    if getattr(cluster, "device_kind", "cpu") != "cuda":
        return None
    try:
        from ..topology import cached_probe

        return cached_probe(("vae-auto", cluster.config), measure=False)
    except Exception as exc:
        log.debug("topology probe unavailable: %s", exc)
        return None


@dataclass(frozen=True)
class RunControls:
    """How a call on the ranks is watched (the same for decode and encode).

    Args:
        cancel_check: polled while the ranks work; raise from it to stop every rank.
        timeout_s: the call's time limit in seconds (default: the cluster's).
        progress: ``progress(done, total)`` with rank 0's stages (the VAE's top-level blocks) as they finish.
    """

    cancel_check: Optional[Callable[[], None]] = None
    timeout_s: Optional[float] = None
    progress: Optional[Callable[[int, int], None]] = None

    def as_fields(self) -> dict:
        """The fields by name, the callables as they are (``dataclasses.asdict`` would deep-copy a callable object)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def run_kwargs(self, progress: Optional[Callable[[int, int], None]] = None) -> dict:
        """Keywords of ``cluster.run`` (``progress`` replaces this one's, e.g. a relay across retries)."""
        return dict(cancel_check=self.cancel_check, timeout_s=self.timeout_s, progress=progress or self.progress)


def _ship_vae(cluster, spec: VaeSpec, dtype: torch.dtype, controls: RunControls) -> None:
    """Make every rank hold ``spec``'s VAE in ``dtype`` (nothing to send for a synthetic VAE or a key-only spec)."""
    if spec.state_dict is None:
        return
    from ..sampling.ship import ship_model

    weights = spec.state_dict
    ship_model(cluster, vae_key(spec, dtype), lambda: {"family": spec.family, "config": spec.config, "dtype": dtype},
               begin_vae, names=list(weights), tensor=weights.__getitem__, end=end_vae, slot=VAE_SLOT,
               timeout_s=controls.timeout_s, cancel_check=controls.cancel_check)


def _run_with_weights(cluster, task: Callable, spec: VaeSpec, dtype: torch.dtype, *args, controls: RunControls = RunControls(),
                      progress=None):
    """``task(ctx, spec without weights, *args, dtype, ...)`` on every rank, the VAE shipped first."""
    meta = spec._replace(state_dict=None)
    kw = controls.run_kwargs(progress)
    _ship_vae(cluster, spec, dtype, controls)
    try:
        return cluster.run(task, meta, *args, **kw)
    except Exception as exc:
        if spec.state_dict is None or not _is_need_weights(exc):
            raise
        _ship_vae(cluster, spec, dtype, controls)  # a rank was replaced after the weights were shipped
        return cluster.run(task, meta, *args, **kw)


def _is_need_weights(exc: BaseException) -> bool:
    from ..cluster import caused_by

    return caused_by(exc, NeedWeights)


def _is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` (a rank's failure as the cluster reports it) is a rank running out of memory."""
    from ..cluster import caused_by

    return caused_by(exc, torch.OutOfMemoryError) or "OutOfMemoryError" in str(exc)


class DecodeReport(NamedTuple):
    """What :func:`decode_report` returns.

    Args:
        sample: the decoded sample, ``[B, 3, H, W]`` or ``[B, 3, F, H, W]`` float32 on the CPU.
        mode: the mode that produced it (``"row"``, ``"tile-runs"`` or ``"row-tiled"``).
        note: what happened that the caller did not ask for (a retry after a rank ran out of memory), else ``None``.
    """

    sample: torch.Tensor
    mode: str
    note: Optional[str]


#: decodes that ran out of memory in this process, by (weights, dtype, latent shape, mode, cluster): the row-tiled
#: plan that fitted, so a repeated prompt does not run out of memory (and rebuild ranks) again. Bounded.
_FITS: Dict[tuple, tuple] = {}
_FITS_MAX = 64


def _remember_fit(key: tuple, value: tuple) -> None:
    _FITS.pop(key, None)
    _FITS[key] = value
    while len(_FITS) > _FITS_MAX:
        _FITS.pop(next(iter(_FITS)))


class _Monotonic:
    """Relays ``progress(done, total)`` across retries without going back: a retry continues after what the
    failed attempt had shown."""

    def __init__(self, progress: Optional[Callable[[int, int], None]]):
        self.progress, self.offset, self.last = progress, 0, 0

    def sink(self, done: int, total: int) -> None:
        if self.progress is None:
            return
        self.last = self.offset + int(done)
        self.progress(self.last, self.offset + int(total))

    def next_attempt(self) -> None:
        self.offset = self.last

    def __bool__(self) -> bool:
        return self.progress is not None


def _band_weights(cluster, balance: str):
    """``None`` (equal bands) or the cluster's measured speeds as band weights (measured once per configuration)."""
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance must be one of {BALANCE_MODES} (got {balance!r})")
    if balance == "equal" or cluster.config.num_ranks == 1:
        return None
    from ..topology.throughput import cluster_band_weights

    return cluster_band_weights(cluster, balance)


@dataclass(frozen=True)
class DecodeOptions:
    """What a decode does (:func:`decode_report`, :func:`distributed_decode`); validated on construction.

    Args:
        mode: ``"auto"``, ``"row"`` (exact) or ``"tile-runs"`` (whole tiles, blended).
        plan: a ``TilePlan.to_dict()`` for tile-runs (default: the planner's balanced plan, else coarse).
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or a torch dtype for the VAE's weights and activations.
        gn_sync: tile-runs only: normalise every tile with image-wide GroupNorm statistics.
        topology: a ``topology.TopologyReport`` for ``auto`` (default: probed once per cluster on GPU clusters).
        on_oom: ``"raise"`` or ``"row-tiled"``: when a rank runs out of memory, decode again in row-tiled mode with
            2, 4, 8 full-width tiles until it fits. ``None``: the entry point's default (:func:`decode_report`:
            ``"row-tiled"``; :func:`distributed_decode`: ``"raise"``).
        balance: row mode's bands: ``"equal"`` or ``"speed"`` (proportional to each rank's measured throughput,
            ``topology.throughput``, so mixed GPUs finish together; the output is the same).
    """

    mode: str = "auto"
    plan: Optional[dict] = None
    dtype: Any = "fp32"
    gn_sync: bool = False
    topology: Any = None
    on_oom: Optional[str] = None
    balance: str = "equal"

    def __post_init__(self):
        if self.on_oom is not None and self.on_oom not in OOM_POLICIES:
            raise ValueError(f"on_oom must be one of {OOM_POLICIES} (got {self.on_oom!r})")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {self.mode!r})")
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES} (got {self.balance!r})")


@dataclass(frozen=True)
class EncodeOptions:
    """What an encode does (:func:`distributed_encode`); validated on construction.

    Args:
        dtype: as :class:`DecodeOptions`.
        balance: ``"equal"`` or ``"speed"``: bands proportional to each rank's measured throughput.
    """

    dtype: Any = "fp32"
    balance: str = "equal"

    def __post_init__(self):
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES} (got {self.balance!r})")


_CONTROL_FIELDS = tuple(f.name for f in dataclasses.fields(RunControls))


def _options(cls, options, fields: dict, entry: str) -> Tuple[Any, RunControls]:
    """``options`` (default ``cls()``) with the keyword ``fields`` that name its fields applied, and the
    :class:`RunControls` made of the rest; an unknown keyword is a ``TypeError`` naming the accepted ones."""
    if options is not None and not isinstance(options, cls):
        raise TypeError(f"{entry}: options must be a {cls.__name__} (got {type(options).__name__}); pass the other "
                        f"settings by keyword")
    own = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - own - set(_CONTROL_FIELDS))
    if unknown:
        raise TypeError(f"{entry}() got unexpected keyword(s) {', '.join(unknown)}; accepted: "
                        f"{', '.join(sorted(own) + list(_CONTROL_FIELDS))}")
    controls = RunControls(**{k: fields[k] for k in _CONTROL_FIELDS if k in fields})
    picked = {k: v for k, v in fields.items() if k in own}
    options = options if options is not None else cls()
    return (dataclasses.replace(options, **picked) if picked else options), controls


def decode_report(cluster, spec: VaeSpec, z: torch.Tensor, options: Optional[DecodeOptions] = None, **fields) -> DecodeReport:
    """:func:`distributed_decode`, reporting the mode used and what happened (see :class:`DecodeReport`).

    Args:
        options: a :class:`DecodeOptions`; its ``on_oom=None`` means ``"row-tiled"`` here (when a rank runs out of
            memory, decode again in row-tiled mode with 2, 4, 8 full-width tiles until it fits).
        **fields: any field of :class:`DecodeOptions` or :class:`RunControls` by keyword (applied over ``options``).

    Raises:
        as :func:`distributed_decode`; ``torch.OutOfMemoryError`` when the smallest row-tiled decode still does not fit.
    """
    from ..cluster import get_cluster

    opts, controls = _options(DecodeOptions, options, fields, "decode_report")
    mode, plan, gn_sync, balance = opts.mode, opts.plan, opts.gn_sync, opts.balance
    on_oom = opts.on_oom if opts.on_oom is not None else "row-tiled"
    topology = opts.topology
    dt = resolve_dtype(opts.dtype)
    n = cluster.config.num_ranks
    check_latent(spec, z, n, "any")
    height, width, frames = latent_frames_hw(spec.family, z)
    if mode == "auto":
        mode = choose_mode(spec.family, height, width, frames, n, topology if topology is not None else _cluster_topology(cluster))
    check_latent(spec, z, n, mode)
    weights = _band_weights(cluster, balance) if mode == "row" else None
    if weights is not None:
        check_latent(spec, z, n, mode, weights)  # a weighted table that would leave a rank without rows: refuse here
    if mode == "tile-runs":
        plan = tile_plan_for(spec, z, n, plan)
    z = z.detach().cpu()
    asked, tiles, failures = mode, 1, []
    retry_tiles = [2 ** i for i in range(1, _OOM_RETRIES + 1)]
    fits_key = (spec.key, str(dt), tuple(z.shape), mode, repr(cluster.config))
    earlier = _FITS.get(fits_key) if on_oom != "raise" else None
    if earlier is not None:  # this decode ran out of memory before: start where it fitted
        mode, plan, tiles, failures = "row-tiled", earlier[0], earlier[1], list(earlier[2])
    relay = _Monotonic(controls.progress)
    while True:
        try:
            results = _run_with_weights(cluster, decode_task, spec, dt, z, mode, plan, dt, gn_sync,
                                        weights if mode == "row" else None, controls=controls, progress=relay.sink if relay else None)
            break
        except Exception as exc:
            if on_oom == "raise" or not _is_oom(exc):
                raise
            failures.append(f"{mode} ({tiles} tiles)" if mode == "row-tiled" else mode)
            plan = None
            while plan is None and retry_tiles:
                candidate = row_tiled_plan(spec, z, n, retry_tiles.pop(0))
                if candidate is not None and len(candidate["tiles_latent"]) > tiles:  # strictly smaller tiles
                    plan, tiles = candidate, len(candidate["tiles_latent"])
            if plan is None:
                raise torch.OutOfMemoryError(
                    f"a rank ran out of memory in every mode tried ({', '.join(failures)}); {exc}"
                ) from exc
            mode = "row-tiled"
            relay.next_attempt()
            log.warning("a rank ran out of memory decoding in %s; retrying row-tiled with %d tiles", failures[-1], tiles)
            if getattr(cluster, "broken", False):  # the failure stopped the ranks: start fresh ones
                cluster = get_cluster(cluster.config)
    note = None
    if failures:
        _remember_fit(fits_key, (plan, tiles, tuple(failures)))
        when = "on an earlier run of this size" if earlier is not None else ""
        note = (
            f"a rank ran out of memory in {asked} mode{' ' + when if when else ''}, so PatchRay decoded in row-tiled "
            f"mode instead: {tiles} full-width tiles, each row-sharded across the {n} ranks and blended at the seams "
            f"(close to, not exactly, the {asked} result). Tried: {', '.join(failures)}."
        )
    return DecodeReport(results[0], mode, note)


def distributed_decode(cluster, spec: VaeSpec, z: torch.Tensor, options: Optional[DecodeOptions] = None, **fields) -> torch.Tensor:
    """Decode ``z`` on every rank of ``cluster``; return the sample (in about [-1, 1]) on the CPU.

    Args:
        cluster: a :class:`~patchray.distributed.cluster.RankCluster`.
        spec: which VAE (:func:`spec_from_diffusers`, :func:`spec_for_family`).
        z: the latent, ``[B, C, h, w]`` (images) or ``[B, C, T, h, w]`` (video).
        options: a :class:`DecodeOptions` (mode, plan, dtype, gn_sync, topology, on_oom, balance); its
            ``on_oom=None`` means ``"raise"`` here.
        **fields: any field of :class:`DecodeOptions` or :class:`RunControls` (cancel_check, timeout_s, progress)
            by keyword, applied over ``options``: ``distributed_decode(cluster, spec, z, mode="row")``.

    Returns:
        ``[B, 3, H, W]`` or ``[B, 3, F, H, W]`` float32 on the CPU.

    Raises:
        ValueError: a bad mode or dtype, a latent whose rank or channels do not fit the VAE, too few rows for the
            ranks in row mode, a plan for another rank count (all before anything is shipped).
    """
    opts, controls = _options(DecodeOptions, options, fields, "distributed_decode")
    if opts.on_oom is None:
        opts = dataclasses.replace(opts, on_oom="raise")
    return decode_report(cluster, spec, z, opts, **controls.as_fields()).sample


def distributed_encode(cluster, spec: VaeSpec, x: torch.Tensor, options: Optional[EncodeOptions] = None, **fields) -> torch.Tensor:
    """Row-sharded encode of ``x`` (in [-1, 1], ``[B, 3, H, W]`` or ``[B, 3, F, H, W]``); returns the latent mean on the CPU.

    Args:
        options: an :class:`EncodeOptions` (dtype, balance).
        **fields: any field of :class:`EncodeOptions` or :class:`RunControls` by keyword, applied over ``options``.

    Raises:
        ValueError: an input whose rank, channels or size do not fit the VAE, or too few rows for the ranks
            (before anything is shipped).
    """
    opts, controls = _options(EncodeOptions, options, fields, "distributed_encode")
    dt = resolve_dtype(opts.dtype)
    check_input(spec, x, cluster.config.num_ranks)
    weights = _band_weights(cluster, opts.balance)
    if weights is not None:
        check_input(spec, x, cluster.config.num_ranks, weights)
    results = _run_with_weights(cluster, encode_task, spec, dt, x.detach().cpu(), dt, weights, controls=controls)
    return results[0]
