"""Module adapters, the one library for the VAE and the UNet: one class (a frozen ``Style``) per layer type,
applied by a plan that is data; the exchange mode of each is a strategy, not another class.

* ``bands``: the band table (row bands, and token shards for sequence parallelism: the same split).
* ``plan``: :class:`Style`, :class:`RowState` (the shared band table), :func:`apply_plan`, the one undo path
  (:func:`replace_forward`, :func:`undo_all`).
* ``exchange``: stepwise peer exchange strategies for sampling (:data:`EXACT`, :data:`STALE`, :data:`DISPLACED`)
  and :class:`StepState`, what a sampled model's adapters share.
* ``conv``: halo convolutions (2D, 3D, causal 3D with temporal caches, strided, padded wrappers; stepwise).
* ``groupnorm``: :class:`ShardedGroupNorm` with its statistics modes (exact in one collective, sync, stale,
  corrected, separate); ``imagewide``: the image-wide mode for tiles.
* ``sequence``: sequence (token) parallelism for DiTs: token shards by latent rows (:class:`TokenShards`), shard /
  gather / RoPE slicing by one index, and :class:`SequenceAttention` (gathered K/V through the exchange strategies,
  or Ulysses all-to-all; exact), with the styles that apply it to a host model (``seq_route``: a diffusers
  processor's attention call rerouted by rebinding the one name it calls).
* ``resnet``: a diffusers resnet block on a band with one two-row halo exchange instead of one per convolution.
* ``attention``: gathered attention (local queries, all keys/values), incl. frame-causal video attention, and
  the K/V-strategy path for host-application attention modules.

Which layer type gets which style: per VAE family, the table ``distributed/vae/row.py:ROW_PLANS``; for the
UNet, ``distributed/sampling/denoiser.py:unet_plan``.
"""

from .attention import GatheredAttention, GatheredAttnBlock, GatheredCausalAttnBlock, GatheredFrameAttention, RecordVideoLayout
from ..bands import band_heights, row_bands, token_shards
from .conv import HaloConv, HaloPadThenConv, HaloPaddedCausalConv, HaloWanCausalConv, conv_rows, halo_plan
from .exchange import DISPLACED, EXACT, STALE, ExactExchange, PeerExchange, StaleExchange, StepState
from .groupnorm import (
    CorrectedStats,
    ExactStats,
    SeparateStats,
    ShardedGroupNorm,
    StaleStats,
    SyncStats,
    exact_group_norm,
)
from .imagewide import ImageWideStats, TileStatistics
from .plan import (
    Applied,
    ClaimedOnly,
    RowLocal,
    RowState,
    Style,
    apply_plan,
    check_coverage,
    is_adapted,
    replace_forward,
    undo_all,
)

__all__ = [
    "Applied",
    "ClaimedOnly",
    "CorrectedStats",
    "DISPLACED",
    "EXACT",
    "ExactExchange",
    "ExactStats",
    "GatheredAttention",
    "GatheredAttnBlock",
    "GatheredCausalAttnBlock",
    "GatheredFrameAttention",
    "HaloConv",
    "HaloPadThenConv",
    "HaloPaddedCausalConv",
    "HaloWanCausalConv",
    "ImageWideStats",
    "PeerExchange",
    "RecordVideoLayout",
    "RowLocal",
    "RowState",
    "STALE",
    "SeparateStats",
    "ShardedGroupNorm",
    "StaleExchange",
    "StaleStats",
    "StepState",
    "Style",
    "SyncStats",
    "TileStatistics",
    "apply_plan",
    "band_heights",
    "check_coverage",
    "conv_rows",
    "exact_group_norm",
    "halo_plan",
    "is_adapted",
    "replace_forward",
    "row_bands",
    "token_shards",
    "undo_all",
]
