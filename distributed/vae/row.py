"""Row mode: each rank decodes (or encodes) one band of latent rows; the result equals the single-GPU one.

Design decisions:

* **The model runs unchanged on a band.** :func:`parallelize_vae` applies the family's row plan (a table:
  layer type -> adapter style, :data:`ROW_PLANS`) to one half of the VAE, then ``row_decode`` simply calls the
  diffusers ``vae.decode`` on the rank's latent band. Every layer that looks beyond its own rows is adapted
  (halo convolutions, exact GroupNorm, gathered attention); everything else is verified row-local and left
  alone, so the family's own decode logic (Wan's frame loop and feature caches, HunyuanVideo's framewise
  decoding, clamps, unpatchify) keeps working. conv_in and the mid-block are sharded like every other layer.
* **Every decision comes from shapes every rank shares.** Validation (family, channels, rank count) happens
  before the first collective and raises the same ``ValueError`` on every rank. Band boundaries at every layer
  are the latent band table times the layer's scale (see ``parallel/plan.py``), never a metadata collective.
* **The output travels once**, to group rank 0 (``comm.gather_to``); other ranks return ``None``.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..comm import gather_to
from ..context import ParallelContext
from ..parallel.attention import (GatheredAttention, GatheredAttnBlock, GatheredCausalAttnBlock, GatheredCosmosAttention,
                                  GatheredFrameAttention, RecordVideoLayout)
from ..parallel.conv import HaloCogVideoXCausalConv, HaloConv, HaloCosmosCausalConv, HaloCosmosDownsample, HaloPadThenConv, HaloPaddedCausalConv, HaloWanCausalConv
from ..bands import row_bands
from ..parallel.groupnorm import ShardedGroupNorm
from ..parallel.resnet import HaloResnetBlock
from ..parallel.plan import Applied, ClaimedOnly, RowLocal, RowState, apply_plan, undo_all
from .families import FAMILIES, family_of, get_family, image_channels, plain_decode

__all__ = ["ROW_PLANS", "row_bands", "parallelize_vae", "RowShardHandle", "row_decode", "row_encode", "validate_latent", "check_encode_input"]

_HANDLE_ATTR = "_patchray_row_shard"
_LOCAL = RowLocal()

_TORCH_COMMON = {
    "Conv2d": HaloConv(),
    "Conv3d": HaloConv(),
    "GroupNorm": ShardedGroupNorm(),  # exact statistics, one collective per call
    "SiLU": _LOCAL,
    "Dropout": _LOCAL,
    "Identity": _LOCAL,
    "Linear": _LOCAL,
    "ModuleList": _LOCAL,
    "Sequential": _LOCAL,
}


def _local(*names: str) -> dict:
    return {name: _LOCAL for name in names}


_KL_PLAN = {
    **_TORCH_COMMON,
    **_local(
        "Decoder",
        "Encoder",
        "UNetMidBlock2D",
        "UpDecoderBlock2D",
        "DownEncoderBlock2D",
        "Upsample2D",
    ),
    "ResnetBlock2D": HaloResnetBlock(),  # one two-row halo exchange per block instead of one per conv
    "Downsample2D": HaloPadThenConv(),
    "Attention": GatheredAttention(),
}


def _wan_like(prefix: str) -> dict:
    return {
        **_TORCH_COMMON,
        **_local(
            f"{prefix}Decoder3d",
            f"{prefix}Encoder3d",
            f"{prefix}MidBlock",
            f"{prefix}ResidualBlock",
            f"{prefix}UpBlock",
            f"{prefix}RMS_norm",
            f"{prefix}Upsample",
        ),
        f"{prefix}CausalConv3d": HaloWanCausalConv(),
        f"{prefix}Resample": HaloPadThenConv(),
        f"{prefix}AttentionBlock": GatheredFrameAttention(),
        "ZeroPad2d": ClaimedOnly(parent=f"{prefix}Resample"),
    }


_LTX_PLAN = {
    **_TORCH_COMMON,
    **_local(
        "LTXVideoDecoder3d",
        "LTXVideoEncoder3d",
        "LTXVideoMidBlock3d",
        "LTXVideoUpBlock3d",
        "LTXVideoDownBlock3D",
        "LTXVideo095DownBlock3D",
        "LTXVideoUpsampler3d",
        "LTXVideoDownsampler3d",
        "LTXVideoCausalConv3d",
        "RMSNorm",
        "LayerNorm",
        "PixArtAlphaCombinedTimestepSizeEmbeddings",
        "Timesteps",
        "TimestepEmbedding",
    ),
    "LTXVideoResnetBlock3d": RowLocal(refuse=("per_channel_scale1", "per_channel_scale2")),
}


def _hunyuan_video_plan(mid_block: str) -> dict:
    """HunyuanVideo's row plan; ``mid_block``: diffusers' class, or the whole-clip variant's (``variants.py``)."""
    return {
        **_TORCH_COMMON,
        **_local(
            "HunyuanVideoDecoder3D",
            "HunyuanVideoEncoder3D",
            "HunyuanVideoUpBlock3D",
            "HunyuanVideoDownBlock3D",
            "HunyuanVideoResnetBlockCausal3D",
            "HunyuanVideoUpsampleCausal3D",
            "HunyuanVideoDownsampleCausal3D",
        ),
        "HunyuanVideoCausalConv3d": HaloPaddedCausalConv(),
        mid_block: RecordVideoLayout(),
        "Attention": GatheredAttention(frame_causal=True),
    }


ROW_PLANS: Dict[str, dict] = {
    "kl": _KL_PLAN,
    "flux2": _KL_PLAN,
    "wan": _wan_like("Wan"),
    "qwen_image": _wan_like("QwenImage"),
    "hunyuan_video": _hunyuan_video_plan("HunyuanVideoMidBlock3D"),
    "hunyuan_video_15": {
        **_TORCH_COMMON,
        **_local(
            "HunyuanVideo15Decoder3D",
            "HunyuanVideo15Encoder3D",
            "HunyuanVideo15UpBlock3D",
            "HunyuanVideo15DownBlock3D",
            "HunyuanVideo15ResnetBlock",
            "HunyuanVideo15RMS_norm",
            "HunyuanVideo15Upsample",
            "HunyuanVideo15Downsample",
            "HunyuanVideo15MidBlock",
        ),
        "HunyuanVideo15CausalConv3d": HaloPaddedCausalConv(),
        "HunyuanVideo15AttnBlock": GatheredCausalAttnBlock(),
    },
    "ltx2": {
        **_TORCH_COMMON,
        **_local(
            "LTX2VideoDecoder3d",
            "LTX2VideoEncoder3d",
            "LTX2VideoMidBlock3d",
            "LTX2VideoUpBlock3d",
            "LTX2VideoDownBlock3D",
            "LTX2VideoUpsampler3d",
            "LTX2VideoDownsampler3d",
            "LTX2VideoCausalConv3d",
            "PerChannelRMSNorm",
            "LayerNorm",
        ),
        # the spatial noise injection draws fresh noise per position: not reproducible per band
        "LTX2VideoResnetBlock3d": RowLocal(refuse=("per_channel_scale1", "per_channel_scale2")),
    },
    # --- Wan 2.2 and LTX-Video
    # Wan 2.2: Wan 2.1's layers plus residual up/down blocks whose shortcuts only regroup each 2x2 (x2 frames) cell
    # into channels (AvgDown3D averages, DupUp3D repeats): row-local because every band starts on an even row at
    # every level (bands are whole latent rows, 16 pixel rows); the patchify/unpatchify of the model is the same.
    "wan22": {
        **_wan_like("Wan"),
        **_local("WanResidualDownBlock", "WanResidualUpBlock", "AvgDown3D", "DupUp3D"),
    },
    # LTX-Video: causal convs pad time only (their inner Conv3d pads rows, by reflection in ComfyUI's decoder: the
    # halo conv's edge mode), pixel-wise RMS/Layer norms, space<->depth resamplers that regroup each 2x2 cell (bands
    # start on even rows at every level), timestep embeddings with no spatial extent. The 0.9.1 decoder's spatial
    # noise injection draws fresh noise per position: not reproducible per band, refused by name.
    "ltx_video": _LTX_PLAN,
    "ltx_video_090": _LTX_PLAN,
    # --- Hunyuan image VAEs: pixel-(un)shuffle resamplers move whole rows (a band boundary at an even row
    # stays one), the refiner's RMS norm is per position, attention gathers K/V over every rank ---
    "hunyuan_image": {
        **_TORCH_COMMON,
        **_local(
            "HunyuanImageEncoder2D",
            "HunyuanImageDecoder2D",
            "HunyuanImageMidBlock",
            "HunyuanImageResnetBlock",
            "HunyuanImageDownsample",
            "HunyuanImageUpsample",
        ),
        "HunyuanImageAttentionBlock": GatheredAttnBlock(),
    },
    "hunyuan_image_refiner": {
        **_TORCH_COMMON,
        **_local(
            "HunyuanImageRefinerEncoder3D",
            "HunyuanImageRefinerDecoder3D",
            "HunyuanImageRefinerMidBlock",
            "HunyuanImageRefinerDownBlock3D",
            "HunyuanImageRefinerUpBlock3D",
            "HunyuanImageRefinerResnetBlock",
            "HunyuanImageRefinerRMS_norm",
            "HunyuanImageRefinerDownsampleDCAE",
            "HunyuanImageRefinerUpsampleDCAE",
        ),
        "HunyuanImageRefinerCausalConv3d": HaloPaddedCausalConv(),
        "HunyuanImageRefinerAttnBlock": GatheredAttnBlock(),
    },
    # the refiner's architecture with plain Conv3d: its zero-padded convs go through the same padding wrapper, the
    # GroupNorms (which replace the RMS norms) are exact, the uniform resamplers regroup whole 2x2 cells of rows
    "hunyuan_refiner_conv3d": {
        **_TORCH_COMMON,
        **_local(
            "HunyuanImageRefinerEncoder3D",
            "HunyuanImageRefinerDecoder3D",
            "HunyuanImageRefinerMidBlock",
            "HunyuanImageRefinerDownBlock3D",
            "HunyuanImageRefinerUpBlock3D",
            "HunyuanImageRefinerResnetBlock",
            "HunyuanImageRefinerDownsampleUniform",
            "HunyuanImageRefinerUpsampleUniform",
        ),
        "HunyuanImageRefinerCausalConv3d": HaloPaddedCausalConv(),
        "HunyuanImageRefinerAttnBlock": GatheredAttnBlock(),
    },
    # Cosmos: per-frame GroupNorm(1) (frames folded into the batch), factorised causal convs (first frame repeated,
    # zero rows), per-frame spatial attention with gathered K/V, temporal attention over one pixel's frames
    # (row-local), Haar wavelet (un)patching with stride-2 kernels that move whole 2-row cells (bands start on even
    # rows at every level), nearest upsampling, and the pad-then-strided-conv downsampler with its average pool
    "cosmos": {
        **_TORCH_COMMON,
        **_local(
            "CosmosEncoder3d",
            "CosmosDecoder3d",
            "CosmosDownBlock3d",
            "CosmosUpBlock3d",
            "CosmosMidBlock3d",
            "CosmosResnetBlock3d",
            "CosmosCausalGroupNorm",
            "CosmosConvProjection3d",
            "CosmosPatchEmbed3dConstants",
            "CosmosUnpatcher3dConstants",
            "CosmosUpsample3d",
        ),
        "CosmosCausalConv3d": HaloCosmosCausalConv(),
        "CosmosDownsample3d": HaloCosmosDownsample(),
        "CosmosCausalAttention": GatheredCosmosAttention(),
    },
    # Mochi: GroupNorm per frame (each chunk of frames is a batch of images to nn.GroupNorm: one exact collective
    # per chunk, the same chunks on every rank since frames are never split), causal convs padded by replication
    # in time and space, 1x1 projections and depth-to-space up blocks that move whole rows (bands scale by 2 at
    # every level), Fourier features per pixel. The encoder's attention runs over the frames of one pixel at a
    # time (tokens [(B h w), T, C]), so it is row-local: no keys come from another row.
    "mochi": {
        **_TORCH_COMMON,
        **_local(
            "MochiEncoder3D",
            "MochiDecoder3D",
            "MochiMidBlock3D",
            "MochiDownBlock3D",
            "MochiUpBlock3D",
            "MochiUpBlock3DFrameDrop",
            "MochiResnetBlock3D",
            "MochiChunkedGroupNorm3D",
            "FourierFeatures",
            "Attention",
            "LpNorm",
        ),
        "CogVideoXCausalConv3d": HaloCogVideoXCausalConv(),
        "CogVideoXSafeConv3d": ClaimedOnly(parent="CogVideoXCausalConv3d"),
    },
    # HunyuanVideo with full mid-block attention: the same layers as "hunyuan_video"; the mid-block calls its
    # attention without a mask, which the gathered attention then computes over every rank's tokens
    "hunyuan_video_full_attention": _hunyuan_video_plan("HunyuanVideoMidBlock3DFullAttention"),
}

# backstop, not the guard: an import-time check of the two tables
assert set(ROW_PLANS) == set(FAMILIES), "every family needs a row plan"


# --------------------------------------------------------------------------------------------------
# validation (the band table itself, row_bands, is distributed/bands.py's; re-exported here)


def _latent_channels(vae) -> int:
    config = vae.config
    for key in ("latent_channels", "z_dim"):
        if key in config:
            return int(config[key])
    raise ValueError(f"cannot tell the latent channels of {type(vae).__name__}")  # pragma: no cover


def validate_latent(vae, z: torch.Tensor, world_size: int, weights=None) -> List[Tuple[int, int]]:
    """Check ``z`` against ``vae`` and the rank count (shared data only); return the latent bands (proportional to
    ``weights`` when given, see ``distributed/bands.py``)."""
    family = family_of(vae)
    spec = get_family(family)
    want_dim = 5 if spec.is_video else 4
    layout = "[B, C, T, h, w]" if spec.is_video else "[B, C, h, w]"
    if z.dim() != want_dim:
        raise ValueError(f"{family} latents are {want_dim}-D {layout}; got shape {tuple(z.shape)}")
    channels = _latent_channels(vae)
    if z.shape[1] != channels:
        raise ValueError(
            f"latent has {z.shape[1]} channels but this {family} VAE expects {channels}; "
            f"pass a latent made by this VAE (or load the matching VAE)"
        )
    return row_bands(z.shape[-2], world_size, weights=weights)


def _bounds(bands) -> Tuple[int, ...]:
    return (0,) + tuple(stop for _, stop in bands)


# --------------------------------------------------------------------------------------------------
# apply / remove


class RowShardHandle:
    """An applied row plan on one half of a VAE. :meth:`remove` restores the model exactly."""

    def __init__(self, vae: nn.Module, half: str, family: str, state: RowState, applied: List[Applied]):
        self.vae, self.half, self.family, self.state = vae, half, family, state
        self._applied = applied

    @property
    def active(self) -> bool:
        return self._applied is not None

    def remove(self) -> None:
        """Undo every adapter (idempotent)."""
        if self._applied is None:
            return
        undo_all(self._applied)
        self._applied = None
        handles = self.vae.__dict__.get(_HANDLE_ATTR, {})
        handles.pop(self.half, None)
        if not handles:
            self.vae.__dict__.pop(_HANDLE_ATTR, None)


def _half_roots(vae, half: str):
    if half == "decoder":
        return [("post_quant_conv", getattr(vae, "post_quant_conv", None)), ("decoder", vae.decoder)]
    if half == "encoder":
        return [("encoder", vae.encoder), ("quant_conv", getattr(vae, "quant_conv", None))]
    raise ValueError(f"half must be 'decoder' or 'encoder' (got {half!r})")


def parallelize_vae(vae: nn.Module, ctx: ParallelContext, half: str = "decoder") -> RowShardHandle:
    """Apply the family's row plan to ``vae.decoder`` (or ``vae.encoder``) for the ranks of ``ctx``.

    Args:
        vae: a diffusers VAE of a known family (see ``FAMILIES``).
        ctx: the parallel context (group, rank, device).
        half: ``"decoder"`` or ``"encoder"``.

    Returns:
        a :class:`RowShardHandle`; ``handle.remove()`` restores the model (no weights were copied).

    Raises:
        ValueError: unknown family, bad ``half``, or the half is already parallelized.
        NotImplementedError: a module no adapter covers (named with its path and class).

    Example:
        >>> handle = parallelize_vae(vae, ctx)          # doctest: +SKIP
        >>> handle.state.latent_bounds = (0, 32, 64)    # doctest: +SKIP  (row_decode does this)
        >>> handle.remove()                             # doctest: +SKIP
    """
    family = family_of(vae)
    roots = _half_roots(vae, half)
    if half in vae.__dict__.get(_HANDLE_ATTR, {}):
        raise ValueError(f"the {half} of this VAE is already parallelized; call handle.remove() first")
    state = RowState(ctx)
    applied = apply_plan(roots, ROW_PLANS[family], state)
    handle = RowShardHandle(vae, half, family, state, applied)
    vae.__dict__.setdefault(_HANDLE_ATTR, {})[half] = handle
    return handle


@contextlib.contextmanager
def _sharded(vae, ctx: ParallelContext, half: str, bounds: Tuple[int, ...]):
    """Use an existing handle for ``half`` (same group) or apply one for the duration of the block."""
    existing = vae.__dict__.get(_HANDLE_ATTR, {}).get(half)
    if existing is not None and existing.state.ctx != ctx:
        raise ValueError(f"the {half} of this VAE is parallelized for another group; remove that handle first")
    handle = existing or parallelize_vae(vae, ctx, half)
    saved_tiling = getattr(vae, "use_tiling", None)
    try:
        handle.state.latent_bounds = bounds
        if saved_tiling:
            vae.use_tiling = False  # row mode replaces tiling for this call; restored below
        yield handle
    finally:
        handle.state.latent_bounds = None
        if saved_tiling:
            vae.use_tiling = saved_tiling
        if existing is None:
            handle.remove()


@contextlib.contextmanager
def _untiled(vae):
    """Row mode replaces the VAE's own tiling for one call (as :func:`_sharded` does); restored afterwards."""
    saved_tiling = getattr(vae, "use_tiling", None)
    try:
        if saved_tiling:
            vae.use_tiling = False
        yield
    finally:
        if saved_tiling:
            vae.use_tiling = saved_tiling


def _param_dtype_device(vae):
    p = next(vae.parameters())
    return p.dtype, p.device


def _gather_rows(out: torch.Tensor, ctx: ParallelContext, bands) -> Optional[torch.Tensor]:
    rows_dim = out.dim() - 2
    rank_rows = bands[ctx.rank][1] - bands[ctx.rank][0]
    scale, rem = divmod(out.shape[rows_dim], rank_rows)
    if rem:
        raise RuntimeError(f"band output of {out.shape[rows_dim]} rows is not a multiple of {rank_rows}")  # backstop
    sizes = [(stop - start) * scale for start, stop in bands]
    return gather_to(out.contiguous(), ctx, rows_dim, sizes, dst=0)


@torch.no_grad()
def row_decode(vae: nn.Module, z: torch.Tensor, ctx: ParallelContext, weights=None) -> Optional[torch.Tensor]:
    """Decode ``z`` with the rows split across the ranks of ``ctx``; the sample arrives on group rank 0 only.

    Args:
        vae: a diffusers VAE of a known family, on ``ctx.device``.
        z: the FULL latent, the same on every rank (any dtype; cast to the VAE's).
        ctx: the parallel context (``ParallelContext.single()`` decodes on one rank).
        weights: one positive figure per rank (e.g. measured throughput, ``topology.throughput``): bands
            proportional to them, so faster ranks decode more rows; default ``ctx.band_weights`` (``None``: equal
            bands). The same on every rank; the result is the same either way.

    Returns:
        on rank 0 the decoded sample, equal to ``vae.decode(z).sample``; ``None`` on the other ranks.

    Raises:
        ValueError: unknown family, a latent whose rank/channels do not fit, too many ranks for its rows
            (identically on every rank, before any communication).
        NotImplementedError: the VAE holds a layer no adapter covers.

    Example:
        >>> image = row_decode(vae, z, ctx)  # doctest: +SKIP
    """
    bands = validate_latent(vae, z, ctx.world_size, ctx.band_weights if weights is None else weights)
    dtype, device = _param_dtype_device(vae)
    if ctx.world_size == 1 and "decoder" not in vae.__dict__.get(_HANDLE_ATTR, {}):
        # one rank holds every row: the plain decode, with no plan applied and nothing gathered
        with _untiled(vae):
            return plain_decode(vae, z.to(device=device, dtype=dtype))
    start, stop = bands[ctx.rank]
    with _sharded(vae, ctx, "decoder", _bounds(bands)):
        band = z.narrow(-2, start, stop - start).to(device=device, dtype=dtype)
        out = _decode_band(vae, band)
    return _gather_rows(out, ctx, bands)


def _stats_view(vae, like: torch.Tensor):
    view = (1, -1) + (1,) * (like.dim() - 2)
    return vae.latents_mean.view(view).to(like), vae.latents_std.view(view).to(like)


def _decode_band(vae, band: torch.Tensor) -> torch.Tensor:
    """``vae.decode`` on a band, with the model's PatchRay options (``families.plain_decode``)."""
    return plain_decode(vae, band)


@torch.no_grad()
def check_encode_input(family: str, x: torch.Tensor, in_channels: int, world_size: int, weights=None):
    """Refuse an encode input that cannot work (rank, channels, size multiple, rows vs ranks); return the bands.

    The same checks run on the driver before anything is shipped and on every rank, from shared data only.
    """
    fam = get_family(family)
    want_dim = 5 if fam.is_video else 4
    if not torch.is_tensor(x) or x.dim() != want_dim:
        raise ValueError(f"{family} inputs are {want_dim}-D; got shape {tuple(getattr(x, 'shape', ()))}")
    if x.shape[1] != in_channels:
        raise ValueError(f"input has {x.shape[1]} channels but this {family} VAE expects {in_channels}")
    ratio = fam.spatial_ratio
    height, width = x.shape[-2], x.shape[-1]
    if height % ratio or width % ratio:
        raise ValueError(
            f"{family} encodes sizes divisible by {ratio}; got {height}x{width}: crop or pad to "
            f"{height // ratio * ratio}x{width // ratio * ratio}"
        )
    return row_bands(height // ratio, world_size, weights=weights)


def row_encode(vae: nn.Module, x: torch.Tensor, ctx: ParallelContext, *, return_parameters: bool = False, weights=None):
    """Encode ``x`` with the rows split across the ranks; the latent mean arrives on group rank 0 only.

    Args:
        vae: a diffusers VAE of a known family, on ``ctx.device``.
        x: the FULL input image/video, the same on every rank; height and width divisible by the family's
            spatial ratio.
        ctx: the parallel context.
        return_parameters: return the latent distribution's parameters (mean and log-variance channels, what
            ``DiagonalGaussianDistribution`` takes) instead of its mean.
        weights: band weights, as for :func:`row_decode` (default ``ctx.band_weights``).

    Returns:
        on rank 0 ``vae.encode(x).latent_dist.mean`` (or ``.parameters``); ``None`` on the other ranks.
    """
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    family = family_of(vae)
    ratio = get_family(family).spatial_ratio
    bands = check_encode_input(family, x, image_channels(family, vae.config), ctx.world_size,
                               ctx.band_weights if weights is None else weights)
    dtype, device = _param_dtype_device(vae)
    start, stop = bands[ctx.rank]
    if ctx.world_size == 1 and "encoder" not in vae.__dict__.get(_HANDLE_ATTR, {}):
        with _untiled(vae):  # one rank: the plain encode
            dist = vae.encode(x.to(device=device, dtype=dtype)).latent_dist
            params = dist.parameters
    else:
        with _sharded(vae, ctx, "encoder", _bounds(bands)):
            band = x.narrow(-2, start * ratio, (stop - start) * ratio).to(device=device, dtype=dtype)
            dist = vae.encode(band).latent_dist
            params = dist.parameters
        params = _gather_rows(params, ctx, bands)
    if params is None or return_parameters:
        return params  # the raw parameters, before a normalising family's latent statistics
    # a deterministic autoencoder (Cosmos) returns its latent itself; a KL VAE its mean and log-variance
    mean = params if not isinstance(dist, DiagonalGaussianDistribution) else DiagonalGaussianDistribution(params).mean
    if vae.config.get("patchray_latents_normalized"):
        latents_mean, latents_std = _stats_view(vae, mean)
        mean = (mean - latents_mean) / latents_std
    return mean
