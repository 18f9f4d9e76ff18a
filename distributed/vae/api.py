"""Distributed VAE decode and encode on the rank cluster: the one entry point the nodes call.

Design decisions:

* **Weights travel once per VAE.** A :class:`VaeSpec` carries a content key. The first call on a cluster
  puts the state dict into Ray's object store once (every rank reads the same object) and each rank
  builds the diffusers model and keeps it in its :func:`~patchray.distributed.cluster.rank_cache` under
  ``(key, dtype)``. Later calls send only the key. A rebuilt cluster (after a fault) starts with an empty
  record, so the weights are sent again exactly when they are needed.
* **The output goes to the caller only.** Row and tile-runs modes gather the image to group rank 0; the
  other ranks return ``None``, so only one copy crosses back to the driver.
* **Plans are data.** A tile plan travels as ``TilePlan.to_dict()`` and is rebuilt on the ranks.
* **auto** picks row mode (exact: equals the single-GPU decode) unless the link is slow enough that the
  topology advice prefers whole tiles (:func:`choose_mode`).
* **Refuse on the driver.** What can be checked from shapes (latent rank and channels against the VAE, rows
  against the rank count, input size against the compression ratio) is checked here, with the same verdicts
  the ranks would reach, before any weights or tensors are shipped; the ranks keep their own checks as the
  backstop.
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
* **One weight format.** A spec holds a diffusers config and a diffusers-layout state dict
  (:func:`spec_from_diffusers`, checked by ``convert.check_state_dict``); host applications convert their own
  layouts before they call here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional

import torch

from ..context import ParallelContext

__all__ = [
    "VaeSpec", "DecodeReport", "spec_for_family", "spec_from_diffusers", "distributed_decode", "decode_report",
    "distributed_encode", "check_decode_input", "latent_channels", "tile_plan_for", "choose_mode", "MODES", "OOM_POLICIES",
]

log = logging.getLogger(__name__)

MODES = ("auto", "row", "tile-runs")
#: what a decode does when a rank runs out of memory: raise it, or retry row-tiled with ever smaller tiles
OOM_POLICIES = ("raise", "row-tiled")
#: row-tiled retries cut the image into 2, 4, 8 ... full-width tiles, at most this many times
_OOM_RETRIES = 3
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class VaeSpec(NamedTuple):
    """What the ranks need to build one VAE.

    Args:
        family: a key of ``families.FAMILIES``.
        config: keyword arguments for the family's diffusers class (``None``: the family's ``size`` config).
        state_dict: diffusers-layout weights (``None``: deterministic synthetic weights, seeded from ``key``).
        key: content key; equal keys mean equal models (see ``convert.state_dict_key``).
        size: ``"full"`` or ``"tiny"``, used only when ``config`` is ``None``.
    """

    family: str
    config: Optional[dict]
    state_dict: Optional[Mapping[str, torch.Tensor]]
    key: str
    size: str = "full"


def spec_for_family(family: str, size: str = "full", seed: int = 0) -> VaeSpec:
    """A spec with synthetic weights (benchmarks, demos, tests)."""
    from .families import get_family

    get_family(family)  # unknown family -> ValueError listing the known ones
    return VaeSpec(family=family, config=None, state_dict=None, key=f"synthetic:{family}:{size}:{seed}", size=size)


def spec_from_diffusers(family: str, config: dict, state_dict: Mapping[str, torch.Tensor]) -> VaeSpec:
    """A spec for real weights in the diffusers format, checked against the family's diffusers class.

    Args:
        family: a key of ``families.FAMILIES`` (``"kl"``, ``"wan"``...).
        config: keyword arguments for the family's diffusers class.
        state_dict: that model's weights, diffusers layout (the tensors are kept, not copied).

    Raises:
        ValueError: unknown family.
        UnsupportedVaeError: the weights do not fit ``diffusers.<class>(**config)`` (the message names what differs).

    Example:
        >>> vae = diffusers.AutoencoderKL(**cfg)  # doctest: +SKIP
        >>> spec = spec_from_diffusers("kl", cfg, vae.state_dict())  # doctest: +SKIP
    """
    from .convert import check_state_dict, state_dict_key
    from .families import get_family

    check_state_dict(get_family(family).diffusers_class, config, state_dict)
    return VaeSpec(family=family, config=dict(config), state_dict=state_dict, key=state_dict_key(state_dict, family))


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype (got {dtype!r})")
    return _DTYPES[dtype]


# --------------------------------------------------------------------------------------------------
# rank side


def _rank_vae(ctx: ParallelContext, spec: VaeSpec, weights: Optional[Mapping[str, torch.Tensor]], dtype: torch.dtype):
    from ..cluster import rank_cache
    from .families import build_vae, instantiate

    cache = rank_cache()
    key = ("vae", spec.key, str(dtype), str(ctx.device))
    vae = cache.get(key)
    if vae is not None:
        return vae
    if spec.config is None:
        vae = build_vae(spec.family, size=spec.size, seed=int(spec.key.rsplit(":", 1)[-1]) if spec.key.startswith("synthetic:") else 0, dtype=dtype, device=ctx.device)
    else:
        if weights is None:
            raise _NeedWeights(spec.key)
        with torch.device("meta"):
            vae = instantiate(spec.family, spec.config)
        vae.load_state_dict(dict(weights), assign=True)
        vae = vae.to(device=ctx.device, dtype=dtype).eval()
    # keep one VAE per dtype/device at a time: a new checkpoint replaces the old one
    for old in [k for k in cache if isinstance(k, tuple) and k and k[0] == "vae"]:
        del cache[old]
    cache[key] = vae
    return vae


class _NeedWeights(RuntimeError):
    """The rank has no cached model for this key (e.g. the cluster was rebuilt): the driver resends."""


def _pieces(mode: str, plan: Optional[dict], rank: int) -> int:
    """How many times rank 0 decodes a whole piece of the input (for its progress total)."""
    if mode == "row" or plan is None:
        return 1
    if mode == "row-tiled":
        return len(plan["tiles_latent"])
    start, stop = plan["runs"][rank]
    return stop - start


def _frames(x: torch.Tensor) -> Optional[int]:
    return int(x.shape[2]) if x.dim() == 5 else None


def _release_after_oom(device: torch.device) -> None:
    """Give back what a failed call allocated: its frames are gone once the exception is; cycles and caches next."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _decode_task(ctx: ParallelContext, spec: VaeSpec, weights, z: torch.Tensor, mode: str, plan: Optional[dict], dtype: torch.dtype, gn_sync: bool):
    from .planner import TilePlan
    from .row import row_decode
    from .stages import stage_progress
    from .tiled import decode_row_tiled, decode_tile_runs

    vae = _rank_vae(ctx, spec, weights, dtype)
    z = z.to(device=ctx.device)
    oom = None
    try:
        with stage_progress(vae.decoder, ctx, frames=_frames(z), pieces=_pieces(mode, plan, ctx.rank)):
            if mode == "row":
                out = row_decode(vae, z, ctx)
            elif mode == "row-tiled":
                out = decode_row_tiled(vae, z, TilePlan.from_dict(plan), ctx)
            else:
                out = decode_tile_runs(vae, z, TilePlan.from_dict(plan), ctx, gn_sync=gn_sync)
    except torch.OutOfMemoryError as exc:
        oom = str(exc)
    if oom is not None:  # outside the except block: the traceback (and the activations its frames hold) is gone
        _release_after_oom(ctx.device)
        raise torch.OutOfMemoryError(oom)
    return None if out is None else out.float().cpu()


def _encode_task(ctx: ParallelContext, spec: VaeSpec, weights, x: torch.Tensor, dtype: torch.dtype):
    from .row import row_encode
    from .stages import stage_progress

    vae = _rank_vae(ctx, spec, weights, dtype)
    x = x.to(device=ctx.device)
    oom = None
    try:
        with stage_progress(vae.encoder, ctx, frames=_frames(x)):
            out = row_encode(vae, x, ctx)
    except torch.OutOfMemoryError as exc:
        oom = str(exc)
    if oom is not None:
        _release_after_oom(ctx.device)
        raise torch.OutOfMemoryError(oom)
    return None if out is None else out.float().cpu()


# --------------------------------------------------------------------------------------------------
# driver side


def choose_mode(family: str, height: int, width: int, frames: int, world_size: int, topology: Any = None) -> str:
    """``auto``'s choice: row mode (exact) unless the topology advice says the link favours whole tiles.

    Args:
        topology: a ``topology.TopologyReport`` (e.g. from ``topology.cached_probe``); ``None``: row mode.
    """
    if world_size == 1 or topology is None:
        return "row"
    try:
        from ..topology import choose_decode_mode

        mode = choose_decode_mode(topology).mode
    except Exception as exc:  # advice is optional: never fail a decode over it
        log.debug("topology advice unavailable: %s", exc)
        return "row"
    if mode == "tile-runs":
        from .planner import plan_tiles

        try:
            plan_tiles(family, height, width, frames, world_size)
        except ValueError:  # the image is too small for tiles on this many ranks: row mode works
            return "row"
    return mode if mode in ("row", "tile-runs") else "row"


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


def _run_with_weights(cluster, task: Callable, spec: VaeSpec, *args, cancel_check=None, timeout_s=None, progress=None):
    loaded = cluster.__dict__.setdefault("_patchray_weights_on_ranks", set())
    send = spec.state_dict is not None and spec.key not in loaded
    meta = spec._replace(state_dict=None)
    kw = dict(cancel_check=cancel_check, timeout_s=timeout_s, progress=progress)
    try:
        results = cluster.run(task, meta, spec.state_dict if send else None, *args, **kw)
    except Exception as exc:
        if spec.state_dict is None or not _is_need_weights(exc):
            raise
        results = cluster.run(task, meta, spec.state_dict, *args, **kw)
    if spec.state_dict is not None:
        loaded.add(spec.key)
    return results


def _is_need_weights(exc: BaseException) -> bool:
    from ..cluster import caused_by

    return caused_by(exc, _NeedWeights)


def latent_channels(spec: VaeSpec) -> Optional[int]:
    """The latent channels the ranks' VAE will expect (None when only the diffusers class default knows)."""
    from .families import get_family

    fam = get_family(spec.family)
    if spec.config is None and spec.size == "full":
        return fam.latent_channels
    config = fam.tiny_config if spec.config is None else spec.config
    for key in ("latent_channels", "z_dim"):
        if key in config:
            return int(config[key])
    # a tiny config without the key builds the released width (families.latent_shape); a given config without it
    # leaves the diffusers class default, which only the ranks see: their own check decides
    return fam.latent_channels if spec.config is None else None


def _is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` (a rank's failure as the cluster reports it) is a rank running out of memory."""
    from ..cluster import caused_by

    return caused_by(exc, torch.OutOfMemoryError) or "OutOfMemoryError" in str(exc)


def check_decode_input(spec: VaeSpec, z: torch.Tensor, world_size: int, mode: str = "auto") -> None:
    """Every check of a decode's input that needs no rank: call it before the cluster starts.

    Refuses a latent whose rank or channels do not fit the VAE, one holding NaN or infinite values, and (in row
    and auto mode) one with fewer latent rows than ranks, with the same verdicts the ranks would reach.

    Raises:
        ValueError: naming what is wrong and the fix.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
    _check_latent(spec, z, world_size, "row" if mode == "auto" else mode)
    finite = torch.isfinite(z)
    if not bool(finite.all()):
        nan, inf = int(torch.isnan(z).sum()), int(torch.isinf(z).sum())
        raise ValueError(
            f"the latent holds {nan} NaN and {inf} infinite value(s) of {z.numel()}: it would decode to a black or "
            "broken image; the sampler that made it diverged (often fp16 overflow: sample in bf16 or fp32)"
        )


def _check_latent(spec: VaeSpec, z: torch.Tensor, world_size: int, mode: str) -> None:
    """The ranks' latent checks (``row.validate_latent``), made here before anything is shipped."""
    from .families import get_family
    from .row import row_bands

    fam = get_family(spec.family)
    want_dim = 5 if fam.is_video else 4
    if not torch.is_tensor(z) or z.dim() != want_dim:
        layout = "[B, C, T, h, w]" if fam.is_video else "[B, C, h, w]"
        raise ValueError(f"{spec.family} latents are {want_dim}-D {layout}; got shape {tuple(getattr(z, 'shape', ()))}")
    channels = latent_channels(spec)
    if channels is not None and z.shape[1] != channels:
        raise ValueError(
            f"latent has {z.shape[1]} channels but this {spec.family} VAE expects {channels}; "
            "pass a latent made by this VAE (or load the matching VAE)"
        )
    if mode == "row":
        row_bands(z.shape[-2], world_size)  # too few rows for the ranks: ValueError naming the rank count that fits


def _check_input(spec: VaeSpec, x: torch.Tensor, world_size: int) -> None:
    """The ranks' encode-input checks (``row.check_encode_input``), made here before anything is shipped."""
    from .families import image_channels
    from .row import check_encode_input

    check_encode_input(spec.family, x, image_channels(spec.family, spec.config), world_size)


def _latent_frames_hw(spec_family: str, z: torch.Tensor):
    from .families import get_family

    fam = get_family(spec_family)
    frames_lat = z.shape[2] if z.dim() == 5 else 1
    frames = (frames_lat - 1) * fam.temporal_ratio + 1 if fam.is_video else 1
    return fam.spatial_ratio * z.shape[-2], fam.spatial_ratio * z.shape[-1], frames


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


def _row_tiled_plan(spec: VaeSpec, z: torch.Tensor, world_size: int, tiles: int) -> Optional[dict]:
    """A plan of ``tiles`` full-width tiles over the latent rows (a quarter-window overlap), or None when the rows
    cannot give every rank a row of every tile."""
    from collections import namedtuple

    from .families import get_family
    from .planner import exact_plan

    fam = get_family(spec.family)
    ratio = fam.spatial_ratio
    rows, cols = int(z.shape[-2]), int(z.shape[-1])
    overlap = max(1, rows // (4 * tiles))
    window = -(-(rows + (tiles - 1) * overlap) // tiles)
    if tiles < 2 or window >= rows or window <= overlap or window < world_size:
        return None
    height, width, frames = _latent_frames_hw(spec.family, z)
    family = namedtuple("Family", "name spatial_ratio")(spec.family, ratio)
    plan = exact_plan(family, height, width, frames, 1, (window * ratio, cols * ratio), (overlap * ratio, 0), min_tile_latent=1)
    if min(y1 - y0 for y0, y1, _, _ in plan.tiles_latent) < world_size:
        return None
    return plan.to_dict()


def tile_plan_for(spec: VaeSpec, z: torch.Tensor, world_size: int, plan=None) -> dict:
    """The tile-runs plan for ``z`` as a dict: ``plan`` checked against the rank count, or the planner's balanced
    (else coarse) plan. Needs no rank, so callers can refuse before the cluster starts.

    Raises:
        ValueError: a plan for another rank count, or an image too small for tiles on this many ranks.
    """
    from .planner import TilePlan, plan_tiles

    if plan is None:
        height, width, frames = _latent_frames_hw(spec.family, z)
        report = plan_tiles(spec.family, height, width, frames, world_size)
        plan = (report.balanced or report.coarse).to_dict()
    elif isinstance(plan, TilePlan):
        plan = plan.to_dict()
    if int(plan.get("world_size", world_size)) != world_size:
        raise ValueError(
            f"the tile plan was made for {plan.get('world_size')} ranks but the cluster has {world_size}; re-plan for {world_size}"
        )
    return plan


def decode_report(
    cluster,
    spec: VaeSpec,
    z: torch.Tensor,
    mode: str = "auto",
    plan: Optional[dict] = None,
    dtype="fp32",
    gn_sync: bool = False,
    topology: Any = None,
    cancel_check: Optional[Callable[[], None]] = None,
    timeout_s: Optional[float] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    on_oom: str = "row-tiled",
) -> DecodeReport:
    """:func:`distributed_decode`, reporting the mode used and what happened (see :class:`DecodeReport`).

    Args:
        on_oom: ``"row-tiled"`` (default): when a rank runs out of memory, decode again in row-tiled mode with
            2, 4, 8 full-width tiles until it fits; ``"raise"``: let the failure propagate.
        progress: ``progress(done, total)`` with rank 0's stages (the VAE's top-level blocks) as they finish.

    Raises:
        as :func:`distributed_decode`; ``torch.OutOfMemoryError`` when the smallest row-tiled decode still does not fit.
    """
    from ..cluster import get_cluster

    if on_oom not in OOM_POLICIES:
        raise ValueError(f"on_oom must be one of {OOM_POLICIES} (got {on_oom!r})")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
    dt = _dtype(dtype)
    n = cluster.config.num_ranks
    _check_latent(spec, z, n, "any")
    height, width, frames = _latent_frames_hw(spec.family, z)
    if mode == "auto":
        mode = choose_mode(spec.family, height, width, frames, n, topology if topology is not None else _cluster_topology(cluster))
    _check_latent(spec, z, n, mode)
    if mode == "tile-runs":
        plan = tile_plan_for(spec, z, n, plan)
    z = z.detach().cpu()
    asked, tiles, failures = mode, 1, []
    retry_tiles = [2 ** i for i in range(1, _OOM_RETRIES + 1)]
    fits_key = (spec.key, str(dt), tuple(z.shape), mode, repr(cluster.config))
    earlier = _FITS.get(fits_key) if on_oom != "raise" else None
    if earlier is not None:  # this decode ran out of memory before: start where it fitted
        mode, plan, tiles, failures = "row-tiled", earlier[0], earlier[1], list(earlier[2])
    relay = _Monotonic(progress)
    while True:
        try:
            results = _run_with_weights(cluster, _decode_task, spec, z, mode, plan, dt, gn_sync,
                                        cancel_check=cancel_check, timeout_s=timeout_s, progress=relay.sink if relay else None)
            break
        except Exception as exc:
            if on_oom == "raise" or not _is_oom(exc):
                raise
            failures.append(f"{mode} ({tiles} tiles)" if mode == "row-tiled" else mode)
            plan = None
            while plan is None and retry_tiles:
                candidate = _row_tiled_plan(spec, z, n, retry_tiles.pop(0))
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


def distributed_decode(
    cluster,
    spec: VaeSpec,
    z: torch.Tensor,
    mode: str = "auto",
    plan: Optional[dict] = None,
    dtype="fp32",
    gn_sync: bool = False,
    topology: Any = None,
    cancel_check: Optional[Callable[[], None]] = None,
    timeout_s: Optional[float] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    on_oom: str = "raise",
) -> torch.Tensor:
    """Decode ``z`` on every rank of ``cluster``; return the sample (in about [-1, 1]) on the CPU.

    Args:
        cluster: a :class:`~patchray.distributed.cluster.RankCluster`.
        spec: which VAE (:func:`spec_from_diffusers`, :func:`spec_for_family`).
        z: the latent, ``[B, C, h, w]`` (images) or ``[B, C, T, h, w]`` (video).
        mode: ``"auto"``, ``"row"`` (exact) or ``"tile-runs"`` (whole tiles, blended).
        plan: a ``TilePlan.to_dict()`` for tile-runs (default: the planner's balanced plan, else coarse).
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or a torch dtype for the VAE's weights and activations.
        gn_sync: tile-runs only: normalise every tile with image-wide GroupNorm statistics.
        topology: a ``topology.TopologyReport`` for ``auto`` (default: probed once per cluster on GPU clusters).
        cancel_check: polled while the ranks work; raise from it to stop every rank.
        progress: ``progress(done, total)`` with rank 0's stages as they finish.
        on_oom: ``"raise"`` (default) or ``"row-tiled"`` (see :func:`decode_report`).

    Returns:
        ``[B, 3, H, W]`` or ``[B, 3, F, H, W]`` float32 on the CPU.

    Raises:
        ValueError: a bad mode or dtype, a latent whose rank or channels do not fit the VAE, too few rows for the
            ranks in row mode, a plan for another rank count (all before anything is shipped).
    """
    return decode_report(cluster, spec, z, mode, plan, dtype, gn_sync, topology, cancel_check, timeout_s, progress, on_oom).sample


def distributed_encode(
    cluster,
    spec: VaeSpec,
    x: torch.Tensor,
    dtype="fp32",
    cancel_check: Optional[Callable[[], None]] = None,
    timeout_s: Optional[float] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> torch.Tensor:
    """Row-sharded encode of ``x`` (in [-1, 1], ``[B, 3, H, W]`` or ``[B, 3, F, H, W]``); returns the latent mean on the CPU.

    Raises:
        ValueError: an input whose rank, channels or size do not fit the VAE, or too few rows for the ranks
            (before anything is shipped).
    """
    dt = _dtype(dtype)
    _check_input(spec, x, cluster.config.num_ranks)
    results = _run_with_weights(cluster, _encode_task, spec, x.detach().cpu(), dt, cancel_check=cancel_check, timeout_s=timeout_s,
                                progress=progress)
    return results[0]
