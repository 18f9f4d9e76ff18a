"""Module adapters: one class (a frozen ``Style``) per layer type, applied by a plan that is data.

* ``plan``: :class:`Style`, :class:`RowState` (the shared band table), :func:`apply_plan` / :func:`undo_all`.
* ``conv``: halo convolutions (2D, 3D, causal 3D with temporal caches, strided, padded wrappers).
* ``groupnorm``: exact GroupNorm in one collective (Chan's merge of count/mean/M2).
* ``attention``: gathered attention (local queries, all keys/values), incl. frame-causal video attention.

Which layer type gets which style, per VAE family, is the table ``distributed/vae/row.py:ROW_PLANS``.
"""

from .attention import GatheredAttention, GatheredCausalAttnBlock, GatheredFrameAttention, RecordVideoLayout
from .conv import HaloConv, HaloPadThenConv, HaloPaddedCausalConv, HaloWanCausalConv, conv_rows, halo_plan
from .groupnorm import ExactGroupNorm, exact_group_norm
from .plan import Applied, ClaimedOnly, RowLocal, RowState, Style, apply_plan, check_coverage, undo_all

__all__ = [
    "Applied",
    "ClaimedOnly",
    "ExactGroupNorm",
    "GatheredAttention",
    "GatheredCausalAttnBlock",
    "GatheredFrameAttention",
    "HaloConv",
    "HaloPadThenConv",
    "HaloPaddedCausalConv",
    "HaloWanCausalConv",
    "RecordVideoLayout",
    "RowLocal",
    "RowState",
    "Style",
    "apply_plan",
    "check_coverage",
    "conv_rows",
    "exact_group_norm",
    "halo_plan",
    "undo_all",
]
