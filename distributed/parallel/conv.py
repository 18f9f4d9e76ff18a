"""Halo convolutions: 2D, 3D and causal 3D convolutions on a band of rows, exact at band boundaries.

Design decisions:

* **One core, several entry styles.** :func:`conv_rows` convolves a band given the layer's *global* row padding
  (top, bottom, mode); the styles only translate each diffusers wrapper's own padding into that form:
  :class:`HaloConv` (``nn.Conv2d``/``nn.Conv3d`` with their own padding and ``padding_mode``; also the UNet's
  convolutions in stepwise sampling, where the halo comes from a :class:`~.exchange.PeerExchange` strategy),
  :class:`HaloWanCausalConv` (Wan/Qwen-Image causal conv with its temporal feature cache),
  :class:`HaloPaddedCausalConv` (HunyuanVideo/HunyuanVideo-1.5: ``F.pad`` with replicate, then a conv),
  :class:`HaloCogVideoXCausalConv` (``CogVideoXCausalConv3d`` as Mochi uses it: the same, returning a cache slot),
  :class:`HaloCosmosCausalConv` (Cosmos: first frame repeated in time, zero rows and columns, then the conv) and
  :class:`HaloCosmosDownsample` (Cosmos: pad right/bottom, strided conv plus 2x2 average pool),
  :class:`HaloPadThenConv` (KL ``Downsample2D`` and Wan/Qwen ``Resample``: pad right/bottom, strided conv).
  Frames are never sharded: temporal padding and caches run exactly as in diffusers on the band.
* **Halo sizes come from the band table.** For output band ``[a, b)`` a conv with kernel ``k``, stride ``s`` and
  top padding ``p`` reads input rows ``[a*s - p, (b-1)*s - p + k)``; what lies outside the rank's band comes from
  the neighbours (one ``batch_isend_irecv``) or from the image edge padding. Strided convolutions align with the
  stride because every layer's boundaries are the latent boundaries times the layer's scale.
* **No band-sized copies on the stride-1 path.** The band is convolved as is (its own padding at both ends),
  then only the ``p`` rows next to an inner boundary are recomputed from a thin strip (halo + ``k-1`` rows).
  A concatenated ``[halo; band; halo]`` copy would add one activation per conv, which the memory target
  (<= 1.15x of a plain band decode) does not allow. Strided (encoder) convolutions concatenate.
* **Stepwise sampling keeps the module's own forward.** A host application's conv (ComfyUI's ops cast weights
  and apply patches inside ``forward``) cannot be replaced by a functional conv on its parameters, so with an
  ``exchange`` strategy :class:`HaloConv` pads ``[halo; band; halo]`` itself and calls the forward it replaced
  with the row padding set to 0 for that call only (the module's ``padding`` is never left changed). The sync,
  stale and displaced modes are the strategy (:data:`~.exchange.EXACT`, ``STALE``, ``DISPLACED``), not classes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import exchange_halo
from .exchange import PeerExchange, StepState
from .plan import Applied, RowState, Style, replace_forward, swapped

__all__ = [
    "HaloPlan",
    "halo_plan",
    "conv_rows",
    "HaloConv",
    "HaloWanCausalConv",
    "HaloPaddedCausalConv",
    "HaloPadThenConv",
    "HaloCogVideoXCausalConv",
    "HaloCosmosCausalConv",
    "HaloCosmosDownsample",
]

_EDGE_MODES = ("zeros", "replicate", "reflect")


class HaloPlan(NamedTuple):
    """Per-rank row bookkeeping of one conv layer (the same tuple on every rank).

    ``halos[r] = (rows from rank r-1, rows from rank r+1)``; ``pads[r] = (edge rows above, edge rows below)``;
    ``trims[r] = (own rows dropped at the top, at the bottom)``; ``out_bounds`` the output band table.
    """

    halos: Tuple[Tuple[int, int], ...]
    pads: Tuple[Tuple[int, int], ...]
    trims: Tuple[Tuple[int, int], ...]
    out_bounds: Tuple[int, ...]


@functools.lru_cache(maxsize=1024)
def halo_plan(in_bounds: Tuple[int, ...], out_bounds: Tuple[int, ...], k: int, s: int, pad_top: int) -> HaloPlan:
    """The rows each rank needs for a conv (kernel ``k``, stride ``s``, ``pad_top`` rows of top padding).

    Raises:
        ValueError: when a band is thinner than the rows a neighbour needs from it (the halo would have to come
            from beyond the adjacent rank); the message names the layer geometry and the fix.
    """
    height = in_bounds[-1]
    n = len(in_bounds) - 1
    halos, pads, trims = [], [], []
    for r in range(n):
        start, stop = in_bounds[r], in_bounds[r + 1]
        a, b = out_bounds[r], out_bounds[r + 1]
        lo, hi = a * s - pad_top, (b - 1) * s - pad_top + k
        from_prev = max(0, start - max(lo, 0))
        from_next = max(0, min(hi, height) - stop)
        pad_before, pad_after = max(0, -lo), max(0, hi - height)
        thin = (from_prev and (r == 0 or from_prev > in_bounds[r] - in_bounds[r - 1] or pad_before)) or (
            from_next and (r == n - 1 or from_next > in_bounds[r + 2] - in_bounds[r + 1] or pad_after)
        )
        if thin or (pad_before and r != 0) or (pad_after and r != n - 1):
            raise ValueError(
                f"row band {r} ({stop - start} rows of {height}) is thinner than the halo a kernel-{k} stride-{s} "
                f"convolution needs; use fewer ranks or a taller latent"
            )
        halos.append((from_prev, from_next))
        pads.append((pad_before, pad_after))
        trims.append((max(0, lo - start), max(0, stop - hi)))
    return HaloPlan(tuple(halos), tuple(pads), tuple(trims), tuple(out_bounds))


def _spatial_pad(x: torch.Tensor, conv: nn.Module, top: int, bottom: int) -> list:
    """F.pad's list for ``x``: the conv's own non-row padding plus ``top``/``bottom`` rows."""
    pads = []
    spatial = x.dim() - 2
    for i in reversed(range(spatial)):  # F.pad lists the last dim first
        if i == spatial - 2:
            pads += [top, bottom]
        else:
            pads += [conv.padding[i], conv.padding[i]]
    return pads


def _conv(x: torch.Tensor, conv: nn.Module, top: int, bottom: int, row_mode: str) -> torch.Tensor:
    """``conv`` on ``x`` with its own non-row padding and ``top``/``bottom`` rows of ``row_mode`` padding."""
    conv_fn = F.conv2d if x.dim() == 4 else F.conv3d
    own_mode = conv.padding_mode
    if own_mode == "zeros" and row_mode == "zeros" and top == bottom:
        padding = list(conv.padding)
        padding[-2] = top
        return conv_fn(x, conv.weight, conv.bias, conv.stride, tuple(padding), conv.dilation, conv.groups)
    if own_mode == row_mode or not any(conv.padding):
        pads = _spatial_pad(x, conv, top, bottom)
        if any(pads):  # F.pad copies even when it pads nothing
            x = F.pad(x, pads, mode="constant" if row_mode == "zeros" else row_mode)
    else:
        x = F.pad(x, _spatial_pad(x, conv, 0, 0), mode="constant" if own_mode == "zeros" else own_mode)
        rows_only = [0] * (2 * (x.dim() - 2))
        rows_only[2], rows_only[3] = top, bottom
        x = F.pad(x, rows_only, mode="constant" if row_mode == "zeros" else row_mode)
    return conv_fn(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


def _check_conv(conv: nn.Module, path: str) -> None:
    if conv.dilation[-2] != 1:
        raise NotImplementedError(f"{path}: row mode supports dilation 1 along rows (got dilation={conv.dilation})")
    if conv.padding_mode not in _EDGE_MODES:
        raise NotImplementedError(f"{path}: padding_mode={conv.padding_mode!r} is not supported in row mode")
    if isinstance(conv.padding, str):
        raise NotImplementedError(f"{path}: padding={conv.padding!r} (a string) is not supported in row mode")


def conv_rows(
    x: torch.Tensor,
    conv: nn.Module,
    state: RowState,
    pad_top: int,
    pad_bottom: int,
    row_mode: str = "zeros",
    prepadded: bool = False,
) -> torch.Tensor:
    """Run ``conv`` on this rank's band ``x`` as if on the whole image, rows padded by ``pad_top``/``pad_bottom``.

    Args:
        x: the band, ``[B, C, H_band, W]`` or ``[B, C, T, H_band, W]``; non-row padding is the conv's own.
        conv: an ``nn.Conv2d``/``nn.Conv3d`` (its own row padding is ignored: pass it in ``pad_top``/``pad_bottom``).
        state: the shared band table.
        pad_top, pad_bottom: global row padding of the layer (image edges only).
        row_mode: ``"zeros"``, ``"replicate"`` or ``"reflect"``: how the image edge rows are padded.
        prepadded: ``x`` already carries ``pad_top``/``pad_bottom`` rows of ``row_mode`` padding at both ends of the
            band (what a wrapper's own ``F.pad`` makes); only the rows next to inner boundaries are recomputed.
            This keeps a wrapper's single padded copy instead of adding a second one.

    Returns:
        this rank's band of the layer's output.
    """
    ctx = state.ctx
    rows_dim = x.dim() - 2
    padded = None
    if prepadded:
        padded = x
        x = x.narrow(rows_dim, pad_top, x.shape[rows_dim] - pad_top - pad_bottom)
    k, s = conv.kernel_size[-2], conv.stride[-2]
    in_bounds = state.bounds_at(x.shape[rows_dim])
    out_height = (in_bounds[-1] + pad_top + pad_bottom - k) // s + 1
    out_bounds = state.bounds_for_height(out_height)
    plan = halo_plan(in_bounds, out_bounds, k, s, pad_top)
    r = ctx.rank
    halo = exchange_halo(x, ctx, rows_dim, plan.halos, buffers=state.halo_buffers)
    (pad_before, pad_after), (trim_top, trim_bottom) = plan.pads[r], plan.trims[r]
    rows = x.shape[rows_dim]
    out_rows = out_bounds[r + 1] - out_bounds[r]

    # a rank-local choice of how to compute, made after the (shared) exchange: it never changes communication
    stride_one = s == 1 and pad_top + pad_bottom == k - 1 and rows >= k - 1
    if stride_one:
        # whole band with its own (edge-mode) padding, then recompute the rows next to inner boundaries
        out = _conv(padded, conv, 0, 0, row_mode) if prepadded else _conv(x, conv, pad_top, pad_bottom, row_mode)
        del padded
        _edge_rows(out, x, halo, conv, rows_dim, k, pad_top, pad_bottom, row_mode)
    else:
        del padded
        parts = [p for p in (halo.before,) if p is not None]
        parts.append(x.narrow(rows_dim, trim_top, rows - trim_top - trim_bottom))
        parts += [p for p in (halo.after,) if p is not None]
        xin = torch.cat(parts, dim=rows_dim) if len(parts) > 1 else parts[0]
        out = _conv(xin, conv, pad_before, pad_after, row_mode)
    if out.shape[rows_dim] != out_rows:
        # backstop, not the guard: the plan above derives both from the same table
        raise RuntimeError(f"halo conv produced {out.shape[rows_dim]} rows, expected {out_rows}")
    return out


def _edge_rows(out, x, halo, conv, rows_dim: int, k: int, pad_top: int, pad_bottom: int, row_mode: str) -> None:
    """Recompute, in place in ``out``, the rows next to inner band boundaries from thin strips (halo + ``k-1`` rows).

    The two strips of a rank between two neighbours have the same shape, so they go through the conv as one
    batch of two: one launch instead of two (launches, not arithmetic, bound these thin strips on a GPU); batch
    entries are independent, so this stays exact up to the backend's rounding like every row-mode layer.
    """
    rows = x.shape[rows_dim]
    strips, places = [], []
    if halo.before is not None and pad_top:
        strips.append(torch.cat([halo.before, x.narrow(rows_dim, 0, k - 1)], dim=rows_dim))
        places.append(out.narrow(rows_dim, 0, pad_top))
    if halo.after is not None and pad_bottom:
        strips.append(torch.cat([x.narrow(rows_dim, rows - (k - 1), k - 1), halo.after], dim=rows_dim))
        places.append(out.narrow(rows_dim, out.shape[rows_dim] - pad_bottom, pad_bottom))
    if len(strips) == 2 and strips[0].shape == strips[1].shape:
        batch = x.shape[0]
        fixed = _conv(torch.cat(strips, dim=0), conv, 0, 0, row_mode)
        places[0].copy_(fixed.narrow(0, 0, batch))
        places[1].copy_(fixed.narrow(0, batch, batch))
        return
    for strip, place in zip(strips, places):
        place.copy_(_conv(strip, conv, 0, 0, row_mode))


def _needs_rows(conv: nn.Module, extra: int = 0) -> bool:
    return conv.kernel_size[-2] > 1 or conv.stride[-2] > 1 or conv.padding[-2] > 0 or extra > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class HaloConv(Style):
    """``nn.Conv2d``/``nn.Conv3d`` (or a subclass) on a row band, exact at band boundaries.

    Args:
        exchange: ``None`` (row mode: the whole call is sharded): halos from the band table in one exchange,
            computed functionally on the module's parameters (zeros, replicate or reflect padding, any stride,
            no band-sized copy). A :class:`~.exchange.PeerExchange` (stepwise sampling): the strategy supplies
            the halo rows each step (exact, stale or displaced) and the module's own forward runs on
            ``[halo; band; halo]``; zeros padding only.
        cut_input: (stepwise) this conv receives the full latent, which every rank holds: cut the band plus its
            halo locally, at no communication cost.
    """

    exchange: Optional[PeerExchange] = None
    cut_input: bool = False

    def _apply(self, module, path, state):
        if self.exchange is not None:
            return _apply_stepwise(module, path, state, self.exchange, self.cut_input)
        _check_conv(module, path)
        if not _needs_rows(module):
            return Applied()  # a 1-row kernel with no row padding and stride 1 is row-local
        p = module.padding[-2]
        mode = module.padding_mode

        def forward(x):
            return conv_rows(x, module, state, p, p, mode)

        return Applied(replace_forward(module, path, lambda prior: forward))


def _apply_stepwise(module: nn.Module, path: str, state: StepState, exchange: PeerExchange, cut_input: bool) -> Applied:
    """:class:`HaloConv` in stepwise sampling: a wrapper around the module's own forward (see the module docstring)."""
    if not (module.kernel_size[0] > 1 or module.padding[0] != 0 or cut_input):
        return Applied()  # a one-row kernel without row padding is row-local
    if isinstance(module.padding, str):
        raise NotImplementedError(f"{path}: padding={module.padding!r} (string padding) is not supported; use int padding")
    if module.padding_mode != "zeros":
        raise NotImplementedError(f"{path}: padding_mode={module.padding_mode!r} is not supported; only 'zeros'")
    if module.dilation[0] != 1:
        raise NotImplementedError(f"{path}: dilation={module.dilation} is not supported along rows")
    k, p, s = module.kernel_size[0], module.padding[0], module.stride[0]
    before, after = p, max(0, k - p - s)
    keep = max(before, after)  # boundary rows each rank keeps in the stale memory
    rows_unpadded = (0,) + tuple(module.padding[1:])

    def build(prior):
        def call(x, top, bottom):
            if top or bottom:
                x = F.pad(x, (0, 0, top, bottom))
            with swapped(module, padding=rows_unpadded):  # the rows are padded above; for this call only
                return prior(x)

        def forward(x):
            st = state
            if not st.active:
                return prior(x)
            r = st.ctx.rank
            if cut_input and x.shape[-2] == st.height and st.rows[r] != st.height:
                # the full latent: cut this rank's band plus halo locally (every rank holds the whole latent)
                s0, e0 = st.bounds[r], st.bounds[r + 1]
                lo, hi = max(0, s0 - before), min(st.height, e0 + after)
                return call(x[..., lo:hi, :], before - (s0 - lo), after - (hi - e0))
            if st.ctx.world_size == 1:
                return call(x, before, after)
            above, below = exchange.halo(x, path, before, after, keep, st)
            parts = [t for t in (above, x, below) if t is not None]
            top = 0 if above is not None else before
            bottom = 0 if below is not None else after
            return call(torch.cat(parts, dim=-2) if len(parts) > 1 else x, top, bottom)

        return forward

    return Applied(replace_forward(module, path, build))


@dataclasses.dataclass(frozen=True)
class HaloWanCausalConv(Style):
    """Wan / Qwen-Image ``*CausalConv3d`` (an ``nn.Conv3d`` that pads itself and takes a temporal cache).

    The cache holds this rank's rows of earlier frames, so it is prepended in time before the halo exchange,
    exactly as diffusers does before its ``F.pad``.
    """

    def _apply(self, module, path, state):
        _check_conv(module, path)
        w_left, w_right, h_top, h_bottom, t_front, t_back = module._padding
        if any(module.padding) or w_left != w_right:
            raise NotImplementedError(f"{path}: unexpected padding={module.padding}, _padding={module._padding}")
        if not _needs_rows(module, h_top + h_bottom):
            return Applied()

        def forward(x, cache_x=None):
            front = t_front
            if cache_x is not None and t_front > 0:
                x = torch.cat([cache_x.to(x.device), x], dim=2)
                front -= cache_x.shape[2]
            # diffusers' own single F.pad, rows included: the conv then runs with no padding of its own, the very
            # call (and cuDNN algorithm) of the unsharded layer; only the rows next to inner boundaries are redone
            x = F.pad(x, (w_left, w_right, h_top, h_bottom, front, t_back))
            return conv_rows(x, module, state, h_top, h_bottom, "zeros", prepadded=True)

        return Applied(replace_forward(module, path, lambda prior: forward))


@dataclasses.dataclass(frozen=True)
class HaloPaddedCausalConv(Style):
    """HunyuanVideo / HunyuanVideo-1.5 causal conv: ``F.pad(time_causal_padding, pad_mode)`` then ``self.conv``."""

    def _apply(self, module, path, state):
        conv = module.conv
        _check_conv(conv, f"{path}.conv")
        w_left, w_right, h_top, h_bottom, t_front, t_back = module.time_causal_padding
        mode = module.pad_mode
        if mode not in ("constant", "replicate", "reflect"):
            raise NotImplementedError(f"{path}: pad_mode={mode!r} is not supported in row mode")
        if any(conv.padding):
            raise NotImplementedError(f"{path}.conv: a padded conv inside a padding wrapper (padding={conv.padding})")
        if not _needs_rows(conv, h_top + h_bottom):
            return Applied(claims=(conv,))
        row_mode = "zeros" if mode == "constant" else mode

        def forward(hidden_states):
            # diffusers' own single F.pad (rows too: the band ends get edge padding, inner ones are fixed after)
            hidden_states = F.pad(hidden_states, module.time_causal_padding, mode=mode)
            return conv_rows(hidden_states, conv, state, h_top, h_bottom, row_mode, prepadded=True)

        return Applied(replace_forward(module, path, lambda prior: forward), claims=(conv,))


@dataclasses.dataclass(frozen=True)
class HaloPadThenConv(Style):
    """A layer that zero-pads right and bottom by one, then runs a stride-2 conv.

    Covers KL ``Downsample2D`` (``padding=0``: ``F.pad(x, (0, 1, 0, 1))`` then ``self.conv``) and the
    ``resample`` ``nn.Sequential(ZeroPad2d((0, 1, 0, 1)), Conv2d(stride=2))`` of Wan/Qwen-Image ``*Resample``
    in the downsample modes. The bottom row of padding belongs to the image edge, i.e. the last rank only.
    """

    def _apply(self, module, path, state):
        name = type(module).__name__
        if name == "Downsample2D":
            if not module.use_conv or module.norm is not None:
                raise NotImplementedError(f"{path}: Downsample2D without a conv or with a norm is not supported")
            if module.padding != 0:
                return Applied()  # a plain padded conv: its Conv2d gets HaloConv from the plan
            target, conv = module, module.conv
        else:  # *Resample
            if "downsample" not in module.mode:
                return Applied()
            target = module.resample
            pad, conv = target[0], target[1]
            if not isinstance(pad, nn.ZeroPad2d) or tuple(pad.padding) != (0, 1, 0, 1):
                raise NotImplementedError(f"{path}.resample: expected ZeroPad2d((0, 1, 0, 1)) before the conv")
        _check_conv(conv, path)
        if conv.padding[-2]:
            raise NotImplementedError(f"{path}: a padded conv after ZeroPad2d is not supported in row mode")

        def forward(hidden_states, *args, **kwargs):
            hidden_states = F.pad(hidden_states, (0, 1, 0, 0))
            return conv_rows(hidden_states, conv, state, 0, 1, "zeros")

        claims = [conv] + ([target] + list(target) if target is not module else [])
        return Applied(replace_forward(target, path, lambda prior: forward), claims=claims)


@dataclasses.dataclass(frozen=True)
class HaloCogVideoXCausalConv(Style):
    """``CogVideoXCausalConv3d`` in its replicate mode (Mochi's): ``F.pad(time_causal_padding, "replicate")``, then
    the unpadded ``self.conv``; returns ``(output, None)`` as the layer does (no temporal cache in that mode).

    The constant mode (CogVideoX's, and diffusers' framewise Mochi decode) pads rows inside the conv and threads a
    temporal cache; it is refused by name.
    """

    def _apply(self, module, path, state):
        conv = module.conv
        _check_conv(conv, f"{path}.conv")
        if module.pad_mode != "replicate":
            raise NotImplementedError(
                f"{path}: CogVideoXCausalConv3d with pad_mode={module.pad_mode!r} (framewise decoding) is not supported "
                f"in row mode; decode the whole clip at once"
            )
        if any(conv.padding):
            raise NotImplementedError(f"{path}.conv: a padded conv inside a padding wrapper (padding={conv.padding})")
        padding = module.time_causal_padding
        h_top, h_bottom = padding[2], padding[3]
        if not _needs_rows(conv, h_top + h_bottom):
            return Applied(claims=(conv,))

        def forward(inputs, conv_cache=None):
            # the layer's own single F.pad (rows too: the band ends get edge padding, inner ones are fixed after)
            inputs = F.pad(inputs, padding, mode="replicate")
            return conv_rows(inputs, conv, state, h_top, h_bottom, "replicate", prepadded=True), None

        return Applied(replace_forward(module, path, lambda prior: forward), claims=(conv,))


@dataclasses.dataclass(frozen=True)
class HaloCosmosCausalConv(Style):
    """``CosmosCausalConv3d``: an ``nn.Conv3d`` whose forward repeats the first frame ``temporal_pad`` times in
    front, zero-pads rows and columns by ``spatial_pad``, then convolves with no padding of its own."""

    def _apply(self, module, path, state):
        _check_conv(module, path)
        if module.pad_mode != "constant" or any(module.padding):
            raise NotImplementedError(f"{path}: CosmosCausalConv3d with pad_mode={module.pad_mode!r}, padding={module.padding}")
        left, right, top, bottom = module.spatial_pad
        if not _needs_rows(module, top + bottom):
            return Applied()
        if module.stride[-2] != 1:
            # the strided spatial conv runs inside CosmosDownsample3d (HaloCosmosDownsample), never alone
            return Applied()

        def forward(hidden_states):
            front = hidden_states[:, :, :1].repeat(1, 1, module.temporal_pad, 1, 1)
            hidden_states = torch.cat([front, hidden_states], dim=2)
            hidden_states = F.pad(hidden_states, (left, right, top, bottom, 0, 0))
            return conv_rows(hidden_states, module, state, top, bottom, "zeros", prepadded=True)

        return Applied(replace_forward(module, path, lambda prior: forward))


@dataclasses.dataclass(frozen=True)
class HaloCosmosDownsample(Style):
    """``CosmosDownsample3d``: zero-pad right and bottom by one, then ``conv1`` (3x3, stride 2, no padding) plus a 2x2
    average pool; the temporal half and the 1x1 ``conv3`` are row-local. The bottom padding row belongs to the
    image edge (the last rank); the pool never reads it (bands start on even rows at every level)."""

    def _apply(self, module, path, state):
        if not module.spatial_downsample:
            return Applied()
        conv = module.conv1
        _check_conv(conv, f"{path}.conv1")
        if any(conv.padding) or tuple(conv.stride[-2:]) != (2, 2) or any(conv.spatial_pad) or conv.temporal_pad:
            raise NotImplementedError(f"{path}.conv1: expected a 3x3 stride-2 conv with no padding of its own")

        def forward(hidden_states):
            padded = F.pad(hidden_states, (0, 1, 0, 0, 0, 0))  # columns: whole on every rank
            conv_out = conv_rows(padded, conv, state, 0, 1, "zeros")
            pool_out = F.avg_pool3d(padded, kernel_size=(1, 2, 2), stride=(1, 2, 2))
            del padded
            hidden_states = conv_out + pool_out
            if module.temporal_downsample:
                hidden_states = torch.cat([hidden_states[:, :, :1, ...], hidden_states], dim=2)
                hidden_states = module.conv2(hidden_states) + F.avg_pool3d(hidden_states, kernel_size=(2, 1, 1), stride=(2, 1, 1))
            return module.conv3(hidden_states)

        return Applied(replace_forward(module, path, lambda prior: forward), claims=(conv,))
