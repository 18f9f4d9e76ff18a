"""The VAE nodes' one call each: ComfyUI's VAE, LATENT and IMAGE in, the stock nodes' outputs out.

Design decisions:

* **Refuse in ComfyUI's process, in the node's terms, before any rank starts.** What can be judged from the
  inputs alone (a latent made by another VAE, too few latent rows for the ranks, NaN or infinite values, an image
  too small to encode) is checked here, before the cluster is started or a weight is shipped, and the message
  names the node's inputs (``samples``, ``vae``, ``pixels``, ``mode``) and the PatchRay Cluster node's
  ``num_ranks``. The library keeps the same checks as its backstop.
* **A note on the node for everything the user did not ask for.** A VAE PatchRay cannot shard falls back to
  ComfyUI's own decode/encode; a rank that ran out of memory made the decode retry in row-tiled mode. Either way
  the output is produced and the node shows why it differs from the request (and it is logged as a warning).
  The fallback note lists the VAE classes PatchRay shards, read from the layout table.
* **Progress per stage.** ``progress(done, total)`` receives rank 0's stages (the VAE's top-level blocks, or its
  frame chunks) through the cluster's progress relay.
* **Two levels, one decode.** :func:`decode_latent` / :func:`encode_pixels` take and return what ComfyUI's
  ``VAE.decode`` / ``VAE.encode`` do (a latent tensor in, ``[B, (T,) H, W, C]`` out; pixels in, a latent tensor out):
  the PatchRay Parallel VAE's methods (:mod:`.parallel_vae`) are exactly these. :func:`decode` / :func:`encode` are
  the Distributed VAE Decode / Encode nodes: the same calls wrapped in the stock nodes' own steps (the LATENT dict,
  a video's frames folded into the IMAGE batch), so the two ways to decode on the ranks cannot drift apart. Every
  message names the PatchRay node the user set the decode up with (``node``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, NamedTuple, Optional

import torch

from . import convert as cv
from . import plan_words
from . import validate
from .errors import rank_errors_for_user

__all__ = ["Result", "Settings", "decode", "encode", "decode_latent", "encode_pixels", "check_settings", "covered_vaes",
           "fallback_note", "plain_vae"]

log = logging.getLogger(__name__)

_DECODE = "PatchRay Distributed VAE Decode"
_ENCODE = "PatchRay Distributed VAE Encode"


class Result(NamedTuple):
    """What a VAE node returns: the output and, when it differs from what was asked, why (else None)."""

    value: object
    note: Optional[str]


def covered_vaes() -> list:
    """The VAE layouts PatchRay shards, as users name them: every row of the layout table that has a family."""
    from .vae_layouts import LAYOUTS

    names = []
    for row in LAYOUTS:
        if row.family and row.name not in names:
            names.append(row.name)
    return names


def fallback_note(exc: Exception, what: str, done: bool = True) -> str:
    """Why a VAE decodes/encodes as stock, with the VAEs PatchRay shards (logged as a warning).

    ``done``: the note of a call that fell back ("used ... instead"); else of a VAE that will ("uses ... instead").
    """
    reason = str(exc)
    covered = "" if "PatchRay covers" in reason else f" PatchRay shards: {', '.join(covered_vaes())}."
    verb = "used" if done else "uses"
    msg = f"PatchRay cannot shard this VAE ({reason}); {verb} ComfyUI's own single-device {what} instead.{covered}"
    log.warning(msg)
    return msg


def _vae_label(spec) -> str:
    names = covered_vaes_by_family().get(spec.family, [])
    return names[0] if names else f"{spec.family} VAE"


def covered_vaes_by_family() -> dict:
    from .vae_layouts import LAYOUTS

    out: dict = {}
    for row in LAYOUTS:
        if row.family and row.name not in out.setdefault(row.family, []):
            out[row.family].append(row.name)
    return out


def _cluster_config(cluster_config, node: Optional[str] = None):
    from ...distributed.cluster import ClusterConfig

    if not isinstance(cluster_config, ClusterConfig):
        lead = f"{node}: 'cluster'" if node else "the cluster input"
        raise TypeError(f"{lead} must come from a PatchRay Cluster node (got {type(cluster_config).__name__})")
    return cluster_config


def _refuse_non_finite(node: str, name: str, x: torch.Tensor, what: str) -> None:
    if bool(torch.isfinite(x).all()):
        return
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    raise ValueError(
        f"{node}: '{name}' holds {nan} NaN and {inf} infinite value(s) out of {x.numel()}; {what}"
    )


def _check_balance(node: str, balance: str) -> None:
    from ...distributed.vae.api import BALANCE_MODES

    if balance not in BALANCE_MODES:
        raise ValueError(f"{node}: 'balance' must be one of {', '.join(BALANCE_MODES)} (got {balance!r})")


def _check_mode(node: str, mode: str) -> None:
    from ...distributed.vae.api import MODES

    if mode not in MODES:
        raise ValueError(f"{node}: 'mode' must be one of {', '.join(MODES)} (got {mode!r})")


def _check_samples(spec, z: torch.Tensor, num_ranks: int, mode: str, node: str = _DECODE) -> None:
    """The decode's input checks, in the node's terms (see the module docstring)."""
    from ...distributed.vae.api import latent_channels
    from ...distributed.vae.families import get_family
    from ...distributed.vae.row import row_bands

    _check_mode(node, mode)
    label = _vae_label(spec)
    fam = get_family(spec.family)
    want = 5 if fam.is_video else 4
    if z.dim() != want:
        kind = "video latents [B, C, T, h, w]" if fam.is_video else "image latents [B, C, h, w]"
        got = "a video latent" if z.dim() == 5 else "an image latent"
        raise ValueError(
            f"{node}: 'samples' is {got} of shape {tuple(z.shape)}, but 'vae' ({label}) decodes {kind}: "
            "connect the latent made for this VAE, or load the VAE that made it"
        )
    channels = latent_channels(spec)
    if channels is not None and z.shape[1] != channels:
        raise ValueError(
            f"{node}: 'samples' has {z.shape[1]} latent channels but 'vae' ({label}) takes {channels}: the latent "
            "was made by another model's VAE; connect the VAE that matches the model (or the latent)"
        )
    _refuse_non_finite(
        node, "samples", z,
        "it would decode to a black or broken image. The sampler that made it diverged (often fp16 overflow: "
        "run the model in bf16 or fp32)",
    )
    if mode in ("auto", "row"):
        rows = int(z.shape[-2])
        try:
            row_bands(rows, num_ranks)
        except ValueError:
            raise ValueError(
                f"{node}: 'samples' has {rows} latent rows, fewer than the {num_ranks} ranks of 'cluster' (row mode "
                f"gives each rank at least one row): set num_ranks on the PatchRay Cluster node to {rows} or fewer, "
                "or decode a taller image"
            ) from None


def _check_plan_family(plan: Optional[dict], spec, node: str = _DECODE) -> None:
    """A plan's tiles are latent rectangles at its family's pixels per latent; another VAE's latent has other ones."""
    if plan is None or "ratio" not in plan:
        return
    from ...distributed.vae.families import get_family

    ratio = cv.spatial_ratio(spec)
    if int(plan["ratio"]) != ratio:
        fix = (f"set family on the PatchRay Tile Planner node to {spec.family}" if get_family(spec.family).spatial_ratio == ratio
               else f"plan with a family of {ratio} px per latent on the PatchRay Tile Planner node")
        raise ValueError(
            f"{node}: 'plan' was made for family {plan.get('family')} ({plan['ratio']} px per latent), but 'vae' "
            f"({_vae_label(spec)}) has {ratio} px per latent: {fix}"
        )


def _check_plan_ranks(plan: Optional[dict], num_ranks: int, node: str = _DECODE) -> None:
    if plan is not None and int(plan.get("world_size", num_ranks)) != num_ranks:
        raise ValueError(
            f"{node}: 'plan' was made for {plan.get('world_size')} ranks but 'cluster' has {num_ranks}: set ranks on "
            f"the PatchRay Tile Planner node to {num_ranks} (the PatchRay Cluster node's num_ranks)"
        )


def _tile_plan(spec, z: torch.Tensor, num_ranks: int, plan, node: str = _DECODE):
    """tile-runs' plan, resolved before the cluster starts; refusals name the inputs and widgets."""
    from ...distributed.vae.api import tile_plan_for

    _check_plan_ranks(plan, num_ranks, node)
    try:
        return tile_plan_for(spec, z, num_ranks, plan)
    except ValueError as exc:
        ratio = cv.spatial_ratio(spec)
        raise ValueError(plan_words.for_decode(str(exc), int(z.shape[-1]) * ratio, int(z.shape[-2]) * ratio, num_ranks, node)) from None


_GIB = 2**30

#: the share of ComfyUI's memory estimate the CPU-rank check counts (see :func:`check_host_memory`)
ESTIMATE_SHARE = 0.5
#: decode families whose CPU ranks' live tensors were measured above :data:`ESTIMATE_SHARE` of ComfyUI's figure: the
#: share counted for them, rounded up from the measured peak (results/cpu-vae-memory/, 2 CPU ranks, fp32: Wan 2.1
#: 0.66-0.73 from its second 4-frame chunk on, HunyuanVideo 0.55-0.68 from 5 frames, measured on ComfyUI's own class,
#: which the layout table converts to ``hunyuan_video_full_attention``)
DECODE_SHARE = {"wan": 0.75, "hunyuan_video": 0.7, "hunyuan_video_full_attention": 0.7}


def _cpu_ranks_here(config) -> bool:
    """Whether the ranks are CPU processes of the embedded cluster, i.e. compute in this machine's memory."""
    from ...distributed.cluster.limits import this_machine

    if config.address:
        return False
    return config.device == "cpu" or (config.device == "auto" and this_machine().gpus == 0)


def host_need(estimate: Optional[int], out_bytes: int, config, share: float = ESTIMATE_SHARE) -> int:
    """What one call needs of this machine's memory (see :func:`check_host_memory`): CPU ranks of the embedded cluster
    ``share`` of ComfyUI's estimate (half, or the family's measured :data:`DECODE_SHARE`) plus the result twice; GPU
    ranks the result three times."""
    if _cpu_ranks_here(config):
        return int((estimate or 0) * share) + 2 * out_bytes
    return 3 * out_bytes


def check_host_memory(node: str, name: str, what: str, estimate: Optional[int], out_bytes: int, config, verb: str = "decode",
                      available: Optional[int] = None, fits: Optional[Callable[[int], str]] = None,
                      share: float = ESTIMATE_SHARE) -> None:
    """Refuse, before any rank starts, a decode/encode whose memory this machine does not have free.

    CPU ranks of the embedded cluster compute in this machine's memory: row mode spreads the activations over the
    ranks, so together they need about what one process needs. ``estimate`` is ComfyUI's own figure for the call
    (``VAE.memory_used_decode``/``memory_used_encode``, the one it sizes its batches by), an upper bound: the real fp32
    peak of one process measured 0.44 of it for the KL VAE (0.93 of 2.13 GiB at 512x512 px) and 0.81 for Wan 2.1
    (1.39 of 1.71 GiB at 256x256 px x 9 frames). It follows the decode's shape: for Wan 2.1 / 2.2, whose decoders
    run one latent frame at a time with a feature cache, ComfyUI's figure is per chunk and does not grow with the frame
    count (nor does the ranks' measured peak, beyond the frames decoded: results/cpu-vae-memory/); for HunyuanVideo,
    LTX-Video and the 3-D KL VAEs, which decode the whole clip at once, it grows with the frames, as their peak does.
    Half of it is counted (:data:`ESTIMATE_SHARE`; Wan 2.1 and HunyuanVideo decodes: their measured
    :data:`DECODE_SHARE`), plus the result twice (rank 0's copy and the node's output): the check is for requests that cannot fit; a decode between that and the
    machine's limit meets Ray's memory monitor, which stops a rank at 95% of the machine's memory (a clear error, the
    machine keeps working). The weights are not counted: ranks that already hold them have them in the memory in use, and on a
    first call their one copy per rank stays within the estimate's margin. Past the free memory Ray stops rank
    processes at 95% and the kernel kills processes, ComfyUI's included; the stock node would try and fail the same
    way. GPU ranks compute on their GPUs (an out-of-memory there retries row-tiled), but the result comes back through
    this machine's memory: ``out_bytes`` (the IMAGE or the pixels shipped) is checked for them, three copies (the
    rank's host copy, Ray's object store, the node's output).

    ``share`` replaces :data:`ESTIMATE_SHARE` for a family measured above it (:data:`DECODE_SHARE`).
    ``fits(free)``, when given, says what would fit in ``free`` bytes (how many frames at this size, or how much smaller
    an image) in the node's terms; it leads the advice.
    """
    from ...distributed.cluster.limits import this_machine

    free = this_machine().available_bytes if available is None else available
    if not free:
        return
    need = host_need(estimate, out_bytes, config, share)
    if need <= free:
        return
    if _cpu_ranks_here(config):
        where = f"the {config.num_ranks} CPU rank(s) of 'cluster'"
        # not bf16: PyTorch's CPU bf16 convolutions are many times slower than fp32 (minutes instead of seconds)
        tail = "or use GPU ranks (device on the PatchRay Cluster node)"
    else:
        where = "the result coming back from the GPU ranks"
        tail = ""
    lead = fits(free) if fits is not None else f"{verb} fewer frames or a smaller image per call (split the batch)"
    fix = f"{lead}; {tail}" if tail else lead
    raise ValueError(
        f"{node}: '{name}' is {what}; that needs about {need / _GIB:.1f} GiB of this machine's memory for {where}, "
        f"and {free / _GIB:.1f} GiB is free: {fix}"
    )


def _largest_fitting(need_at: Callable[[int], int], top: int, free: int) -> int:
    """The largest count in 1..top whose need fits in ``free`` (needs grow with the count), 0 when even 1 does not."""
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need_at(mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fits_words(verb: str, need_at: Callable[[int], int], count: int, frames_of: Callable[[int], int], video: bool,
                width: int, height: int, widget: str) -> Callable[[int], str]:
    """``fits(free)`` for :func:`check_host_memory`: the most frames (video) or images (a batch) this machine holds per
    call at this size, else how much smaller one frame or image must be."""

    def fits(free: int) -> str:
        n = _largest_fitting(need_at, count, free) if count > 1 else 0
        if n >= 1:
            what = f"{frames_of(n)} frame(s)" if video else f"{n} image(s)"
            return (f"at {width}x{height} px this machine's free memory holds about {what} per call: {verb} at most that "
                    f"many at a time ({widget})")
        one = need_at(1)
        shrink = max(1.1, (one / free) ** 0.5)
        w, h = (max(16, int(v / shrink) // 16 * 16) for v in (width, height))
        return (f"even one {'frame' if video else 'image'} at {width}x{height} px needs about {one / _GIB:.1f} GiB: {verb} a "
                f"smaller image (about {w}x{h} px or less)")

    return fits


def _estimate(fn, shape, dtype: torch.dtype, per_sample: bool) -> Optional[int]:
    """ComfyUI's own memory estimate for a VAE call (``None`` when the VAE has none)."""
    if not callable(fn):
        return None
    try:
        one = int(fn(tuple(shape), dtype))
    except Exception:  # an estimate is advice: a VAE class whose formula does not take this shape is not refused
        return None
    return one * int(shape[0]) if per_sample else one


@contextlib.contextmanager
def _out_of_memory_hint(config, node: str = _DECODE):
    """When even the smallest row-tiled decode ran out of memory: the same error, with what the user can change."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise torch.OutOfMemoryError(
            f"{node}: {exc}. Decode fewer frames or a smaller image per call, add GPUs (num_ranks on the PatchRay "
            f"Cluster node, now {config.num_ranks}), or set 'precision' to bf16"
        ) from exc


def _check_decode_memory(vae, samples, z: torch.Tensor, spec, dtype: torch.dtype, config, node: str = _DECODE) -> None:
    raw = cv.latent_tensor(samples)
    ratio = cv.spatial_ratio(spec)
    height, width = int(z.shape[-2]) * ratio, int(z.shape[-1]) * ratio
    frames = _decoded_frames(vae, raw)
    batch = int(raw.shape[0])
    video = raw.dim() == 5 and int(raw.shape[2]) > 1
    what = f"{batch} x {frames} frame(s) of {width}x{height} px" if frames > 1 else f"{batch} image(s) of {width}x{height} px"
    fn = getattr(vae, "memory_used_decode", None)
    share = DECODE_SHARE.get(spec.family, ESTIMATE_SHARE)

    def shape_at(n: int) -> tuple:  # n latent frames (video) or n samples of the batch
        return tuple(raw.shape[:2]) + (n,) + tuple(raw.shape[3:]) if video else (n,) + tuple(raw.shape[1:])

    def need_at(n: int) -> int:
        out = (batch * _decoded_frames(vae, raw[:, :, :n]) if video else n * frames) * height * width * 3 * 4
        return host_need(_estimate(fn, shape_at(n), dtype, per_sample=True), out, config, share)

    count = int(raw.shape[2]) if video else batch
    frames_of = (lambda n: _decoded_frames(vae, raw[:, :, :n])) if video else (lambda n: n)
    widget = ("e.g. a shorter length on the node that made the latent, or decode the video in parts" if video
              else "e.g. a smaller batch_size on the node that made the latent")
    fits = _fits_words("decode", need_at, count, frames_of, video, width, height, widget)
    out_bytes = batch * frames * height * width * 3 * 4  # ComfyUI's IMAGE: float32 RGB
    estimate = _estimate(fn, raw.shape, dtype, per_sample=True)
    check_host_memory(node, "samples", f"{what} to decode", estimate, out_bytes, config, "decode", fits=fits, share=share)


def _decoded_frames(vae, raw: torch.Tensor) -> int:
    if raw.dim() != 5:
        return 1
    fn = getattr(vae, "upscale_ratio", None)
    temporal = fn[0] if isinstance(fn, (tuple, list)) and callable(fn[0]) else None
    try:
        return max(1, int(temporal(int(raw.shape[2])))) if temporal else int(raw.shape[2])
    except Exception:
        return int(raw.shape[2])


class Settings(NamedTuple):
    """:func:`check_settings`' answer.

    Args:
        config: the cluster's ``ClusterConfig``.
        plan: the plan dict, ``None`` when absent or unused (row mode).
        fallback: why the VAE decodes and encodes as stock (a VAE PatchRay cannot shard), else ``None``.
        unused: the note for a plan row mode does not use, else ``None``.
    """

    config: object
    plan: Optional[dict]
    fallback: Optional[str]
    unused: Optional[str]


def check_settings(node: str, vae, cluster_config, mode: str = "auto", precision: str = "auto", plan=None,
                   balance: str = "equal") -> Settings:
    """The decode settings, checked as far as they can be without a latent, before any rank starts.

    Raises ``TypeError`` / ``ValueError`` naming ``node``'s inputs; the notes (:class:`Settings`) are logged.
    """
    from ...distributed.vae.convert import UnsupportedVaeError

    try:
        cv.first_stage(vae)
    except TypeError:
        if callable(getattr(vae, "decode", None)) and hasattr(vae, "first_stage_model"):
            raise TypeError(
                f"{node}: 'vae' holds no VAE weights (a checkpoint without a VAE, from a checkpoint loader): load the "
                "VAE with Load VAE and connect that"
            ) from None
        raise TypeError(
            f"{node}: 'vae' must be ComfyUI's VAE (from Load VAE or a checkpoint loader), got {type(vae).__name__}"
        ) from None
    config = _cluster_config(cluster_config, node)
    _check_mode(node, mode)
    _check_balance(node, balance)
    try:
        cv.resolve_dtype(precision, vae)
        plan = cv.plan_dict(plan)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{node}: {exc}") from None
    try:
        spec = cv.vae_spec(vae)
    except UnsupportedVaeError as exc:
        spec, fallback = None, fallback_note(exc, "decode and encode", done=False)
    else:
        fallback = None
    unused = validate.plan_use_note(mode, plan)
    if unused:
        plan = None
        log.warning("%s: %s", node, unused)
    elif spec is not None:
        _check_plan_family(plan, spec, node)
        if mode == "tile-runs":
            _check_plan_ranks(plan, config.num_ranks, node)
    return Settings(config, plan, fallback, unused)


def decode(
    samples,
    vae,
    cluster_config,
    mode: str = "auto",
    precision: str = "auto",
    gn_sync: bool = False,
    plan=None,
    cancel_check: Optional[Callable[[], None]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    balance: str = "equal",
) -> Result:
    """LATENT -> IMAGE ``[N, H, W, 3]`` in 0..1 on the cluster's ranks, like the stock VAE Decode.

    :func:`decode_latent` with the stock VAE Decode's own steps around it: the tensor of the LATENT dict in, a video's
    frames folded into the IMAGE batch out.

    Raises:
        ValueError / TypeError: inputs that cannot work, before the cluster starts (messages name the inputs).
        RankFailure: a rank failed (clean message; the trace is chained for the log).
    """
    _check_balance(_DECODE, balance)
    z = cv.latent_tensor(samples)
    vae = plain_vae(vae)
    result = decode_latent(z, vae, cluster_config, mode, precision, gn_sync, plan, cancel_check=cancel_check,
                           progress=progress, balance=balance)
    return Result(cv.combine_batches(result.value), result.note)


def decode_latent(
    z: torch.Tensor,
    vae,
    cluster_config,
    mode: str = "auto",
    precision: str = "auto",
    gn_sync: bool = False,
    plan=None,
    cancel_check: Optional[Callable[[], None]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    balance: str = "equal",
    *,
    node: str = _DECODE,
    stock: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Result:
    """A latent tensor -> what ComfyUI's ``VAE.decode`` returns for it, decoded on the cluster's ranks.

    Args:
        z: the latent as ``VAE.decode`` takes it (``LATENT["samples"]``): ``[B, C, h, w]`` or ``[B, C, T, h, w]``.
        vae: ComfyUI's VAE (its weights go to the ranks once; its ``output_device`` places the result).
        node: the PatchRay node named in refusals and notes.
        stock: ComfyUI's own decode of ``z``, run for a VAE PatchRay cannot shard (default ``vae.decode``).

    Returns:
        :class:`Result`: ``[B, H, W, 3]`` (image latent) or ``[B, T, H, W, 3]`` (video latent) float32 in 0..1 on
        ``vae.output_device``, as ``VAE.decode``; the note (fallback, row-tiled retry, unused plan) is logged too.

    Raises:
        ValueError / TypeError: inputs that cannot work, before the cluster starts (messages name the inputs).
        RankFailure: a rank failed (clean message; the trace is chained for the log).
    """
    from ...distributed.cluster import get_cluster
    from ...distributed.vae.api import decode_report
    from ...distributed.vae.convert import UnsupportedVaeError

    _check_balance(node, balance)
    raw = cv.check_latent(z)
    plan = cv.plan_dict(plan)
    config = _cluster_config(cluster_config, node)
    try:
        spec = cv.vae_spec(vae)
    except UnsupportedVaeError as exc:
        return Result((stock or vae.decode)(raw), fallback_note(exc, "decode"))
    z = cv.latent_to_library(spec, raw.detach().cpu())
    _check_samples(spec, z, config.num_ranks, mode, node)
    unused = validate.plan_use_note(mode, plan)
    if unused:
        plan = None
    else:
        _check_plan_family(plan, spec, node)
        validate.plan_for_latent(plan, z.shape, cv.spatial_ratio(spec))
    if mode == "tile-runs":
        plan = _tile_plan(spec, z, config.num_ranks, plan, node)
    dtype = cv.resolve_dtype(precision, vae)
    _check_decode_memory(vae, {"samples": raw}, z, spec, dtype, config, node)
    check_note = None
    if mode in ("auto", "row") and config.num_ranks > 1:
        # row mode rebuilds ComfyUI's VAE from its weights: checked against ComfyUI's own decode once per VAE layout,
        # ComfyUI version and PatchRay version (a mismatch decodes as stock, never a wrong image)
        ok, check_note = _verify_row(spec, raw, vae, config, dtype, plain_vae(vae).decode, cancel_check, node)
        if not ok:
            log.warning("%s: %s", node, check_note)
            return Result((stock or vae.decode)(raw), check_note)
    with _out_of_memory_hint(config, node), rank_errors_for_user():
        report = decode_report(
            get_cluster(config, cancel_check=cancel_check),  # the ranks start here on first use
            spec,
            z,
            mode=mode,
            plan=plan,
            dtype=dtype,
            gn_sync=bool(gn_sync),
            cancel_check=cancel_check,
            progress=progress,
            on_oom="row-tiled",
            balance=balance,
        )
    if mode == "auto" and plan is not None and report.mode != "tile-runs":
        unused = (f"plan is unused: mode auto chose {report.mode} mode (exact) for this cluster; set mode to tile-runs to "
                  "decode with the plan")
    note = "; ".join(n for n in (unused, report.note) if n) or None
    if note:
        log.warning("%s: %s", node, note)
    if check_note:  # a passed check: in the log and in `python -m patchray exactness`; the node notes deviations only
        log.info("%s: %s", node, check_note)
    return Result(cv.to_output_device(vae, cv.decoded_to_pixels(report.sample)), note)


#: relative L2 bound of PatchRay's row decode of a small latent against ComfyUI's own decode, by compute dtype. Two
#: implementations of the same network (diffusers' classes against ComfyUI's) in fp32 differ by reordered sums: the
#: opt-in suite measures them within one 8-bit level (max abs <= 1/255, relative L2 ~1e-6..1e-5), so 1e-3 leaves two
#: orders of margin; a wrongly converted weight or layout gives errors of order 0.1. bf16 / fp16 round at 7.8e-3 /
#: 9.8e-4 per layer: 5e-2 / 1e-2 sit above that and below a wrong conversion.
_ROW_BOUNDS = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _row_refusal(spec, error: float, bound: float) -> str:
    from . import runtime_check

    return (f"row mode is refused for the {_vae_label(spec)} VAE on ComfyUI {runtime_check.comfy_version()}: PatchRay's "
            f"exactness check found its row decode differs from ComfyUI's own (relative error {error:.2e} > {bound:.0e}); "
            "decoded with ComfyUI's own decode instead (`python -m patchray exactness --clear` checks again)")


def _verify_row(spec, raw: torch.Tensor, vae, config, dtype: torch.dtype, stock: Callable, cancel_check, node: str):
    """The runtime exactness check of a VAE row: ``(ok, note)``. On first use of the VAE's layout (per ComfyUI and
    PatchRay version), a small crop of ``raw`` is decoded in row mode on the ranks and by ComfyUI's own decode, and
    compared within :data:`_ROW_BOUNDS`; the verdict is kept (``runtime_check``). ``note`` is the node's line.
    ``stock``: ComfyUI's own untiled decode of the VAE (never a tiled one: tiles blend, row mode is exact)."""
    import time

    from ...distributed.cluster import get_cluster
    from ...distributed.sampling.exactness import Verdict, VerdictCache, now, relative_error
    from ...distributed.vae.api import decode_report
    from . import runtime_check

    label = f"VAE {_vae_label(spec)}"
    key, verdict = runtime_check.cached_verdict(label, "row")
    if verdict is not None:
        if verdict.ok:
            return True, None
        return False, _row_refusal(spec, verdict.error, verdict.bound)
    n = config.num_ranks
    rows = min(int(raw.shape[-2]), max(8, 2 * n))
    cols = min(int(raw.shape[-1]), 8)
    crop = raw[..., :rows, :cols]
    if crop.ndim == 5:
        crop = crop[:, :, : min(int(crop.shape[2]), 2)]
    crop = crop[:1].contiguous()
    start = time.perf_counter()
    z = cv.latent_to_library(spec, crop.detach().cpu())
    try:
        _check_samples(spec, z, n, "row", node)
    except ValueError:
        return True, None  # too small a latent to split: this decode runs whole (nothing to check here)
    with rank_errors_for_user():
        report = decode_report(get_cluster(config, cancel_check=cancel_check), spec, z, mode="row", plan=None,
                               dtype=dtype, gn_sync=False, cancel_check=cancel_check, on_oom=None)
    ours = cv.decoded_to_pixels(report.sample).float().cpu()
    theirs = stock(crop).float().cpu()
    error = relative_error(theirs, ours)
    bound = _ROW_BOUNDS.get(dtype, _ROW_BOUNDS[torch.float32])
    verdict = Verdict(ok=error <= bound, error=error, bound=bound, seconds=time.perf_counter() - start, when=now())
    VerdictCache().put(key, verdict)
    if not verdict.ok:
        return False, _row_refusal(spec, error, bound)
    return True, (f"exactness check: row decode of the {_vae_label(spec)} VAE (ComfyUI {runtime_check.comfy_version()}) "
                  f"equals ComfyUI's own, relative error {error:.1e} <= {bound:.0e}; checked now in {verdict.seconds:.2f} s")


def plain_vae(vae):
    """The VAE a PatchRay Parallel VAE was made from (the object itself for any other): its spec is cached, and its
    own decode is ComfyUI's. A Parallel VAE (``parallel_vae``, built on this module) carries its settings, the source
    VAE among them, as ``_patchray``; reading that attribute keeps this module free of the one above it."""
    settings = getattr(vae, "_patchray", None)
    return vae if settings is None else settings.source


def _check_encode_memory(vae, pixels, x: torch.Tensor, dtype: torch.dtype, config, spec=None, node: str = _ENCODE) -> None:
    """Refuse an encode this machine cannot hold (:func:`check_host_memory`). The count the refusal names is one whose
    decode fits as well (given ``spec``): a workflow decodes what it encodes, and for whole-clip video VAEs
    (HunyuanVideo) ComfyUI's decode estimate is many times the encode's, so an encode-only count would be refused by
    the decode after it."""
    frames = int(pixels.shape[0])
    height, width = int(pixels.shape[1]), int(pixels.shape[2])
    video = x.dim() == 5 and x.shape[0] == 1
    fn = getattr(vae, "memory_used_encode", None)
    per_frame = int(x.numel()) * 4 // max(1, frames)  # the pixels shipped, float32
    # a causal video VAE encodes 1 + k x its temporal ratio frames: count in those steps
    t = _temporal_ratio(vae) if video else 1

    def shape_at(n: int) -> tuple:
        return (1, 3, n, height, width) if video else (n, 3, height, width)

    def decode_need(n: int) -> int:  # the decode of the latent n frames (video) or n images encode to
        if spec is None:
            return 0
        ratio = cv.spatial_ratio(spec)
        channels = int(getattr(vae, "latent_channels", 4) or 4)
        lat = ((1, channels, (n - 1) // t + 1, height // ratio, width // ratio) if video
               else (n, channels, height // ratio, width // ratio))
        out = n * height * width * 3 * 4  # the decoded IMAGE, float32 RGB
        return host_need(_estimate(getattr(vae, "memory_used_decode", None), lat, dtype, per_sample=True), out, config,
                         DECODE_SHARE.get(spec.family, ESTIMATE_SHARE))

    def need_at(n: int) -> int:
        return host_need(_estimate(fn, shape_at(n), dtype, per_sample=not video), n * per_frame, config)

    steps = (frames - 1) // t + 1 if t > 1 else frames
    frames_of = (lambda k: (k - 1) * t + 1) if t > 1 else (lambda k: k)
    widget = ("e.g. fewer frames from the node that made the images, or encode the video in parts" if video
              else "e.g. a smaller batch on the node that made the images")
    if spec is not None:
        widget += "; that count leaves room for decoding them"
    fits = _fits_words("encode", lambda k: max(need_at(frames_of(k)), decode_need(frames_of(k))), steps, frames_of, video,
                       width, height, widget)
    check_host_memory(node, "pixels", f"{frames} frame(s) of {width}x{height} px to encode",
                      _estimate(fn, shape_at(frames), dtype, per_sample=not video), int(x.numel()) * 4, config, "encode",
                      fits=fits)


def _check_encode_frames(spec, x: torch.Tensor, node: str = _ENCODE) -> None:
    """Refuse a clip whose frame count ComfyUI's own encoder of this VAE refuses (LTX-Video: 1 + 8k frames only), as
    the stock VAE Encode does, instead of encoding fewer frames than it was given."""
    from .vae_layouts import encode_frame_step

    step = encode_frame_step(spec.family)
    frames = int(x.shape[2]) if x.dim() == 5 else 1
    if step > 1 and (frames - 1) % step:
        lower = (frames - 1) // step * step + 1
        raise ValueError(
            f"{node}: 'pixels' has {frames} frame(s), but the {_vae_label(spec)} encodes 1 + {step}k frames (1, "
            f"{1 + step}, {1 + 2 * step}, ...), as the stock VAE Encode does: give it {lower} or {lower + step} frames "
            f"(e.g. length on the node that made the images)"
        )


def _temporal_ratio(vae) -> int:
    """Frames per latent frame of a causal video VAE (ComfyUI's ``upscale_index_formula``), 1 when unknown."""
    formula = getattr(vae, "upscale_index_formula", None)
    try:
        return max(1, int(formula[0])) if isinstance(formula, (tuple, list)) else 1
    except (TypeError, ValueError):
        return 1


def encode(
    pixels,
    vae,
    cluster_config,
    precision: str = "auto",
    cancel_check: Optional[Callable[[], None]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    balance: str = "equal",
) -> Result:
    """IMAGE -> LATENT ``{"samples": mean}`` on the cluster's ranks, like the stock VAE Encode.

    :func:`encode_pixels` with the stock VAE Encode's own steps around it: its first three channels in (ComfyUI's
    own encode, for a VAE PatchRay cannot shard, gets them sliced as the stock node does), the LATENT dict out.
    """
    vae = plain_vae(vae)
    result = encode_pixels(pixels, vae, cluster_config, precision, cancel_check=cancel_check, progress=progress,
                           balance=balance, stock=lambda p: cv.stock_encode(vae, p))
    return Result({"samples": result.value}, result.note)


def encode_pixels(
    pixels,
    vae,
    cluster_config,
    precision: str = "auto",
    cancel_check: Optional[Callable[[], None]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    balance: str = "equal",
    *,
    node: str = _ENCODE,
    stock: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Result:
    """Pixels -> what ComfyUI's ``VAE.encode`` returns for them (the latent mean), encoded on the cluster's ranks.

    Args:
        pixels: IMAGE ``[B, H, W, C]`` in 0..1 (for video VAEs the batch is the clip's frames), cropped about the centre
            to the VAE's compression as ``VAE.encode`` crops it.
        node: the PatchRay node named in refusals and notes.
        stock: ComfyUI's own encode of ``pixels``, run for a VAE PatchRay cannot shard (default ``vae.encode``).

    Returns:
        :class:`Result`: ``[B, C, h, w]`` (image VAEs), ``[1, C, t, h, w]`` (a video VAE's clip) or ``[B, C, 1, h, w]``
        (images through a 5-D VAE ComfyUI marks ``not_video``), float32 on ``vae.output_device``, as ``VAE.encode``.
    """
    from ...distributed.cluster import get_cluster
    from ...distributed.vae.api import distributed_encode
    from ...distributed.vae.convert import UnsupportedVaeError
    from ...distributed.vae.families import image_channels
    from ...distributed.vae.row import check_encode_input

    _check_balance(node, balance)
    config = _cluster_config(cluster_config, node)
    try:
        spec = cv.vae_spec(vae)
    except UnsupportedVaeError as exc:
        return Result((stock or vae.encode)(pixels), fallback_note(exc, "encode"))
    try:
        x = cv.encode_input(pixels.detach().cpu() if torch.is_tensor(pixels) else pixels, spec)
    except ValueError as exc:
        raise ValueError(f"{node}: 'pixels': {exc}") from None
    _refuse_non_finite(node, "pixels", x, "the image is broken upstream (a node that produced it diverged)")
    _check_encode_frames(spec, x, node)
    try:
        check_encode_input(spec.family, x, image_channels(spec.family, spec.config), config.num_ranks)
    except ValueError as exc:
        raise ValueError(
            f"{node}: 'pixels' cannot be encoded on the {config.num_ranks} ranks of 'cluster': {exc} (num_ranks is "
            "set on the PatchRay Cluster node)"
        ) from None
    dtype = cv.resolve_dtype(precision, vae)
    _check_encode_memory(vae, pixels, x, dtype, config, spec=spec, node=node)
    with rank_errors_for_user():
        z: torch.Tensor = distributed_encode(
            get_cluster(config, cancel_check=cancel_check), spec, x, dtype=dtype, cancel_check=cancel_check, progress=progress,
            balance=balance,
        )
    return Result(cv.to_output_device(vae, cv.latent_from_library(spec, z).float()), None)
