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
* **One weight format.** A spec holds a diffusers config and a diffusers-layout state dict
  (:func:`spec_from_diffusers`, checked by ``convert.check_state_dict``); host applications convert their own
  layouts before they call here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional

import torch

from ..context import ParallelContext

__all__ = ["VaeSpec", "spec_for_family", "spec_from_diffusers", "distributed_decode", "distributed_encode", "choose_mode", "MODES"]

log = logging.getLogger(__name__)

MODES = ("auto", "row", "tile-runs")
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


def _decode_task(ctx: ParallelContext, spec: VaeSpec, weights, z: torch.Tensor, mode: str, plan: Optional[dict], dtype: torch.dtype, gn_sync: bool):
    from .row import row_decode
    from .tiled import decode_tile_runs
    from .planner import TilePlan

    vae = _rank_vae(ctx, spec, weights, dtype)
    z = z.to(device=ctx.device)
    if mode == "row":
        out = row_decode(vae, z, ctx)
    else:
        out = decode_tile_runs(vae, z, TilePlan.from_dict(plan), ctx, gn_sync=gn_sync)
    return None if out is None else out.float().cpu()


def _encode_task(ctx: ParallelContext, spec: VaeSpec, weights, x: torch.Tensor, dtype: torch.dtype):
    from .row import row_encode

    vae = _rank_vae(ctx, spec, weights, dtype)
    out = row_encode(vae, x.to(device=ctx.device), ctx)
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


def _run_with_weights(cluster, task: Callable, spec: VaeSpec, *args, cancel_check=None, timeout_s=None):
    loaded = cluster.__dict__.setdefault("_patchray_weights_on_ranks", set())
    send = spec.state_dict is not None and spec.key not in loaded
    meta = spec._replace(state_dict=None)
    try:
        results = cluster.run(task, meta, spec.state_dict if send else None, *args, cancel_check=cancel_check, timeout_s=timeout_s)
    except Exception as exc:
        if spec.state_dict is None or not _is_need_weights(exc):
            raise
        results = cluster.run(task, meta, spec.state_dict, *args, cancel_check=cancel_check, timeout_s=timeout_s)
    if spec.state_dict is not None:
        loaded.add(spec.key)
    return results


def _is_need_weights(exc: BaseException) -> bool:
    from ..cluster import caused_by

    return caused_by(exc, _NeedWeights)


def _latent_channels(spec: VaeSpec) -> Optional[int]:
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


def _check_latent(spec: VaeSpec, z: torch.Tensor, world_size: int, mode: str) -> None:
    """The ranks' latent checks (``row.validate_latent``), made here before anything is shipped."""
    from .families import get_family
    from .row import row_bands

    fam = get_family(spec.family)
    want_dim = 5 if fam.is_video else 4
    if not torch.is_tensor(z) or z.dim() != want_dim:
        layout = "[B, C, T, h, w]" if fam.is_video else "[B, C, h, w]"
        raise ValueError(f"{spec.family} latents are {want_dim}-D {layout}; got shape {tuple(getattr(z, 'shape', ()))}")
    channels = _latent_channels(spec)
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

    Returns:
        ``[B, 3, H, W]`` or ``[B, 3, F, H, W]`` float32 on the CPU.

    Raises:
        ValueError: a bad mode or dtype, a latent whose rank or channels do not fit the VAE, too few rows for the
            ranks in row mode, a plan for another rank count (all before anything is shipped).
    """
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
        from .planner import TilePlan, plan_tiles

        if plan is None:
            report = plan_tiles(spec.family, height, width, frames, n)
            chosen = report.balanced or report.coarse
            plan = chosen.to_dict()
        elif isinstance(plan, TilePlan):
            plan = plan.to_dict()
        if int(plan.get("world_size", n)) != n:
            raise ValueError(f"the tile plan was made for {plan.get('world_size')} ranks but the cluster has {n}; re-plan for {n}")
    results = _run_with_weights(cluster, _decode_task, spec, z.detach().cpu(), mode, plan, dt, gn_sync, cancel_check=cancel_check, timeout_s=timeout_s)
    return results[0]


def distributed_encode(
    cluster,
    spec: VaeSpec,
    x: torch.Tensor,
    dtype="fp32",
    cancel_check: Optional[Callable[[], None]] = None,
    timeout_s: Optional[float] = None,
) -> torch.Tensor:
    """Row-sharded encode of ``x`` (in [-1, 1], ``[B, 3, H, W]`` or ``[B, 3, F, H, W]``); returns the latent mean on the CPU.

    Raises:
        ValueError: an input whose rank, channels or size do not fit the VAE, or too few rows for the ranks
            (before anything is shipped).
    """
    dt = _dtype(dtype)
    _check_input(spec, x, cluster.config.num_ranks)
    results = _run_with_weights(cluster, _encode_task, spec, x.detach().cpu(), dt, cancel_check=cancel_check, timeout_s=timeout_s)
    return results[0]
