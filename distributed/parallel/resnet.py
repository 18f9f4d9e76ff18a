"""A resnet block on a row band with one halo exchange instead of two: :class:`HaloResnetBlock`.

Design decisions:

* **Exchange the block input once, two rows deep.** diffusers ``ResnetBlock2D`` (norm1, SiLU, conv1, norm2, SiLU,
  conv2, shortcut) has two 3x3 convolutions; adapted layer by layer it makes two halo exchanges (one row each) and
  two GroupNorm all-reduces. Normalisation and SiLU are pointwise once the (global) statistics are known, so the
  block can instead receive **two raw input rows** from each neighbour in one exchange, normalise them with the
  same coefficients as its own band, compute conv1 on one extra row per inner boundary (the halo conv2 needs), and
  normalise that row with norm2's coefficients: three collectives per block instead of four, at the cost of one
  recomputed conv1 row per inner boundary. The result is the same arithmetic as the layer-by-layer path (each
  output row is computed from the same rows with the same weights), so it stays exact up to the backend's
  rounding, like every row-mode layer.
* **No band-sized copies.** As in :func:`~.conv.conv_rows`, each convolution runs on the band with its own zero
  padding and only the rows next to an inner boundary are recomputed from thin strips; SiLU runs in place on the
  freshly normalised tensor, and the residual sum is formed in place in the ``(input + hidden) / factor`` order of
  diffusers.
* **Anything else keeps the layer-by-layer path.** A configuration this block does not reproduce (a time
  embedding, an up/down-sampling block, another activation or kernel, dropout in training, bands thinner than two
  rows) calls the block's own forward, whose layers carry their own adapters. Every such decision depends on the
  module and on shapes every rank shares.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import exchange_halo
from .groupnorm import exact_group_norm_coefficients, normalize_with
from .plan import Applied, RowState, Style, replace_forward

__all__ = ["HaloResnetBlock"]

#: rows each neighbour sends: one for conv1's own halo, one more so conv1 yields the row conv2's halo needs
_DEPTH = 2


def _plain_conv3(conv) -> bool:
    return (
        isinstance(conv, nn.Conv2d)
        and tuple(conv.kernel_size) == (3, 3)
        and tuple(conv.stride) == (1, 1)
        and tuple(conv.padding) == (1, 1)
        and tuple(conv.dilation) == (1, 1)
        and conv.padding_mode == "zeros"
        and conv.groups == 1
    )


def _supported(block) -> bool:
    shortcut = getattr(block, "conv_shortcut", None)
    return (
        getattr(block, "time_emb_proj", None) is None
        and getattr(block, "upsample", None) is None
        and getattr(block, "downsample", None) is None
        and getattr(block, "time_embedding_norm", "default") in ("default", "group")
        and isinstance(getattr(block, "norm1", None), nn.GroupNorm)
        and isinstance(getattr(block, "norm2", None), nn.GroupNorm)
        and isinstance(getattr(block, "nonlinearity", None), nn.SiLU)
        and _plain_conv3(getattr(block, "conv1", None))
        and _plain_conv3(getattr(block, "conv2", None))
        and (shortcut is None or (isinstance(shortcut, nn.Conv2d) and tuple(shortcut.kernel_size) == (1, 1)
                                  and tuple(shortcut.stride) == (1, 1) and tuple(shortcut.padding) == (0, 0)))
    )


def _conv_valid_rows(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``conv`` with no row padding (its own width padding): ``rows - 2`` output rows."""
    return F.conv2d(x, conv.weight, conv.bias, 1, (0, conv.padding[1]))


def _norm_silu(x: torch.Tensor, scale, shift, groups: int) -> torch.Tensor:
    if x.shape[0] != scale.shape[0]:  # boundary strips stacked along the batch: the coefficients repeat with them
        times = x.shape[0] // scale.shape[0]
        scale, shift = scale.repeat(times, 1), shift.repeat(times, 1)
    return F.silu(normalize_with(x, scale, shift, groups), inplace=True)


def _batched(strips):
    """One tensor of the boundary strips (one or two, the same shape) stacked along the batch: one launch each."""
    return strips[0] if len(strips) == 1 else torch.cat(strips, dim=0)


def resnet_rows(block, x: torch.Tensor, state: RowState) -> torch.Tensor:
    """``block(x)`` on this rank's band ``x`` (``[B, C, rows, W]``), exact at band boundaries.

    The rows next to inner boundaries are recomputed from thin strips of *raw* rows (the halo and the band's edge
    rows), normalised with the same coefficients as the band: the same elementwise arithmetic as normalising the
    band and the halo apart, with the two boundaries of a middle rank stacked in one batch (one normalisation
    and one conv launch for both).
    """
    ctx = state.ctx
    n = ctx.world_size
    halos = tuple((_DEPTH if i > 0 else 0, _DEPTH if i < n - 1 else 0) for i in range(n))
    halo = exchange_halo(x, ctx, 2, halos, buffers=state.halo_buffers)
    g1, g2 = block.norm1.num_groups, block.norm2.num_groups
    batch, rows = x.shape[0], x.shape[2]
    above, below = halo.before is not None, halo.after is not None
    sides = [side for side, present in (("above", above), ("below", below)) if present]
    conv1, conv2 = block.conv1, block.conv2

    scale, shift = exact_group_norm_coefficients(x, block.norm1, ctx)
    # raw input rows -2..1 (above) and R-2..R+1 (below): conv1 gives rows -1, 0 and R-1, R
    strips = []
    if above:
        strips.append(torch.cat([halo.before, x.narrow(2, 0, 2)], dim=2))
    if below:
        strips.append(torch.cat([x.narrow(2, rows - 2, 2), halo.after], dim=2))
    edge = _conv_valid_rows(_norm_silu(_batched(strips), scale, shift, g1), conv1) if strips else None
    del strips
    h = _norm_silu(x, scale, shift, g1)
    out = F.conv2d(h, conv1.weight, conv1.bias, 1, conv1.padding)
    del h
    parts = {side: edge.narrow(0, i * batch, batch) for i, side in enumerate(sides)}
    if above:  # edge rows -1 (conv2's halo) and 0
        out.narrow(2, 0, 1).copy_(parts["above"].narrow(2, 1, 1))
    if below:  # edge rows R-1 and R (conv2's halo)
        out.narrow(2, rows - 1, 1).copy_(parts["below"].narrow(2, 0, 1))
    # raw conv1 rows for conv2's boundary rows, -1..1 and R-2..R, cut after both fixes (a two-row band shares them)
    strips = []
    if above:
        strips.append(torch.cat([parts["above"].narrow(2, 0, 1), out.narrow(2, 0, 2)], dim=2))
    if below:
        strips.append(torch.cat([out.narrow(2, rows - 2, 2), parts["below"].narrow(2, 1, 1)], dim=2))
    del edge, parts

    scale, shift = exact_group_norm_coefficients(out, block.norm2, ctx)
    fixed = _conv_valid_rows(block.dropout(_norm_silu(_batched(strips), scale, shift, g2)), conv2) if strips else None
    del strips
    h = _norm_silu(out, scale, shift, g2)
    del out
    h = block.dropout(h)
    out = F.conv2d(h, conv2.weight, conv2.bias, 1, conv2.padding)
    del h
    for i, side in enumerate(sides):
        row = 0 if side == "above" else rows - 1
        out.narrow(2, row, 1).copy_(fixed.narrow(0, i * batch, batch))
    del fixed
    shortcut = block.conv_shortcut(x) if block.conv_shortcut is not None else x
    # diffusers: (input_tensor + hidden_states) / output_scale_factor; a + b == b + a exactly in IEEE arithmetic
    out.add_(shortcut)
    if block.output_scale_factor != 1:
        out.div_(block.output_scale_factor)
    return out


@dataclasses.dataclass(frozen=True)
class HaloResnetBlock(Style):
    """diffusers ``ResnetBlock2D`` on a row band: one two-row halo exchange and two GroupNorm all-reduces.

    Configurations outside the supported set run the block's own forward (its layers' adapters do the work);
    see the module docstring.
    """

    def _apply(self, module, path, state):
        if not _supported(module):
            return Applied()  # the layer-by-layer path: conv and norm adapters of the plan

        def build(prior):
            def forward(input_tensor, temb=None, *args, **kwargs):
                ctx = state.ctx
                if (
                    ctx.world_size == 1
                    or temb is not None
                    or args
                    or input_tensor.dim() != 4
                    or (module.training and module.dropout.p > 0)
                ):
                    return prior(input_tensor, temb, *args, **kwargs)
                bounds = state.bounds_at(input_tensor.shape[2])
                if min(b - a for a, b in zip(bounds, bounds[1:])) < _DEPTH:
                    return prior(input_tensor, temb)  # bands thinner than the halo: the one-row path
                return resnet_rows(module, input_tensor, state)

            return forward

        return Applied(replace_forward(module, path, build))
