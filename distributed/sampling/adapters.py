"""Patch-parallel adapters for a UNet: one class per layer type, matched by torch layer type and duck typing.

Each rank runs the UNet on a band of latent rows. Three kinds of layer need what lies outside the band:

* :class:`HaloConv2d` (any ``torch.nn.Conv2d`` whose kernel reaches across rows): the neighbours' boundary rows,
  exchanged point-to-point (synchronous steps, ``full_sync``) or taken from the stale memory (``displaced``: the
  neighbours' rows of the previous step, refreshed by an asynchronous all-gather; ``no_sync``: the rows of the last
  synchronous step). The first conv receives the full latent (every rank holds it) and cuts its band plus halo
  locally, at no communication cost.
* :class:`SelfAttentionKV` (any module with ``to_q``/``to_k``/``to_v``/``to_out``, called without a context):
  the other ranks' keys and values. Hooks on ``to_k``/``to_v`` replace the local K/V by the full-image K/V
  (gathered, or stale peers + fresh local), so the module's own attention code, whatever it is, becomes local-Q
  attention over the whole image. Works for diffusers' ``Attention`` (``encoder_hidden_states=None``) and
  ComfyUI's ``CrossAttention`` (``context=None``) alike.
* :class:`GroupNormStats` (any ``torch.nn.GroupNorm``): the global statistics. Synchronous: one all-gather of
  each rank's (mean, M2) per group, merged exactly with Chan's formula in fp32 (one collective, no
  E[x^2] - E[x]^2 cancellation, biased variance like ``nn.GroupNorm``).

Design decisions:

* **Match layer types, never model classes.** ComfyUI's ops subclass ``torch.nn.Conv2d``/``GroupNorm`` and its
  attention has the same ``to_k``/``to_v`` attributes, so one set of adapters covers both UNets without importing
  ComfyUI. Self- vs cross-attention is decided per call (no context argument = self-attention).
* **The module's own forward still runs** (ComfyUI's weight casting and LoRA patches keep working): convs get an
  instance-level ``forward`` that pads rows and calls the original with row padding 0; attention gets output hooks
  on ``to_k``/``to_v``. Only GroupNorm recomputes the normalisation (it has to: the statistics change), using the
  module's own weight and bias by reference. ``remove()`` restores everything; no ``.data`` is copied.
* **Which mode a layer runs is decided by the shared :class:`PatchState`** (set per step by the handle from the
  logical step index), so all ranks take the same branch and issue the same collectives in the same order.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_gather_padded, exchange_halo
from ..context import ParallelContext
from .comm_manager import CommManager, Traffic
from .config import GroupNormMode, LayerMode, PatchConfig

__all__ = ["PatchState", "HaloConv2d", "SelfAttentionKV", "GroupNormStats", "is_attention_module", "split_rows"]

logger = logging.getLogger(__name__)


def split_rows(height: int, world_size: int, align: int) -> Tuple[int, ...]:
    """Row band heights for ``world_size`` ranks over ``height`` latent rows, each a multiple of ``align``.

    Uneven by at most ``align`` rows (the first ``units % world_size`` ranks get one unit more). Raises
    ``ValueError`` naming the fix when the height cannot give every rank a band.
    """
    if height % align:
        raise ValueError(
            f"latent height {height} must be a multiple of {align} (the UNet downsamples rows by {align}); "
            f"use an image height that is a multiple of {align * 8} pixels"
        )
    units = height // align
    if units < world_size:
        raise ValueError(
            f"latent height {height} gives {units} row units of {align} for {world_size} ranks; every rank needs one: "
            f"use fewer ranks (<= {units}) or a taller image"
        )
    base, extra = divmod(units, world_size)
    return tuple((base + (1 if r < extra else 0)) * align for r in range(world_size))


class PatchState:
    """What the adapters of one parallelized UNet share; owned by its handle (no globals).

    Attributes set per latent shape: ``rows`` (band heights), ``bounds`` (row offsets), ``height``/``width``,
    ``cm`` (the :class:`CommManager`). Set per step by the handle: ``active``, ``sync``, ``step``.
    """

    def __init__(self, ctx: ParallelContext, config: PatchConfig, align: int):
        self.ctx = ctx
        self.config = config
        self.align = align
        self.traffic = Traffic()
        self.rows: Optional[Tuple[int, ...]] = None
        self.bounds: Optional[Tuple[int, ...]] = None
        self.height = self.width = None
        self.cm: Optional[CommManager] = None
        self.active = False
        self.sync = True
        self.step = -1

    def set_latent(self, height: int, width: int, cm: Optional[CommManager] = None) -> None:
        """Set the band table for a latent size; a new (empty) comm manager unless ``cm`` (a stream's) is given."""
        rows = split_rows(height, self.ctx.world_size, self.align)
        self.rows = rows
        self.bounds = tuple(sum(rows[:r]) for r in range(len(rows) + 1))
        self.height, self.width = height, width
        self.cm = cm if cm is not None else CommManager(self.ctx, rows, self.traffic, self.config.comm_checkpoint)

    @property
    def exchanging(self) -> bool:
        """Whether the adapters do anything this call (several ranks, inside a step)."""
        return self.active and self.ctx.world_size > 1

    @property
    def layers_sync(self) -> bool:
        return self.sync or self.config.layer_mode is LayerMode.FULL_SYNC

    def scaled(self, local_extent: int) -> List[int]:
        """Every rank's extent of a dimension proportional to the band, from this rank's ``local_extent``."""
        me = self.ctx.rank
        return [local_extent * r // self.rows[me] for r in self.rows]


class _Adapter:
    def __init__(self, module: nn.Module, key: str, state: PatchState):
        self.module = module
        self.key = key
        self.state = state

    def remove(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------- conv


class HaloConv2d(_Adapter):
    """Row-halo convolution for a ``torch.nn.Conv2d`` (or subclass) on a row band.

    Refuses (``NotImplementedError`` naming the attribute) string padding, non-zero padding modes and row dilation.
    """

    def __init__(self, module: nn.Conv2d, key: str, state: PatchState, is_input: bool):
        super().__init__(module, key, state)
        if isinstance(module.padding, str):
            raise NotImplementedError(f"{key}: padding={module.padding!r} (string padding) is not supported; use int padding")
        if module.padding_mode != "zeros":
            raise NotImplementedError(f"{key}: padding_mode={module.padding_mode!r} is not supported; only 'zeros'")
        if module.dilation[0] != 1:
            raise NotImplementedError(f"{key}: dilation={module.dilation} is not supported along rows")
        k, p, s = module.kernel_size[0], module.padding[0], module.stride[0]
        self.is_input = is_input
        self.before = p
        self.after = max(0, k - p - s)
        self.keep = max(self.before, self.after)  # boundary rows each rank keeps in the stale memory
        self._orig_padding = module.padding
        module.padding = (0, module.padding[1])
        module.forward = self._forward  # instance attribute: the class's forward stays untouched

    def remove(self) -> None:
        self.module.padding = self._orig_padding
        del self.module.forward

    def _call(self, x: torch.Tensor, top: int, bottom: int) -> torch.Tensor:
        if top or bottom:
            x = F.pad(x, (0, 0, top, bottom))
        return type(self.module).forward(self.module, x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self.state
        if not st.active:
            p = self._orig_padding[0]
            return self._call(x, p, p)
        if self.is_input and x.shape[-2] == st.height and st.rows[st.ctx.rank] != st.height:
            # the full latent: cut this rank's band plus halo locally (every rank holds the whole latent)
            s, e = st.bounds[st.ctx.rank], st.bounds[st.ctx.rank + 1]
            lo, hi = max(0, s - self.before), min(st.height, e + self.after)
            return self._call(x[..., lo:hi, :], self.before - (s - lo), self.after - (hi - e))
        if st.ctx.world_size == 1:
            return self._call(x, self.before, self.after)
        before, after = self._halo(x)
        parts = [t for t in (before, x, after) if t is not None]
        top = 0 if before is not None else self.before
        bottom = 0 if after is not None else self.after
        return self._call(torch.cat(parts, dim=-2) if len(parts) > 1 else x, top, bottom)

    def _halo(self, x: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        st, ctx = self.state, self.state.ctx
        r, n = ctx.rank, ctx.world_size
        mode = st.config.layer_mode
        keep = self.keep
        if st.layers_sync:
            table = [(0 if q == 0 else self.before, 0 if q == n - 1 else self.after) for q in range(n)]
            halo = exchange_halo(x, ctx, dim=x.dim() - 2, halos=table)
            row_bytes = x[..., :1, :].numel() * x.element_size()
            sent = (table[r - 1][1] if r > 0 else 0) + (table[r + 1][0] if r < n - 1 else 0)
            st.traffic.add("halo", sent * row_bytes, collectives=1)
            if mode is not LayerMode.FULL_SYNC:
                shape = list(x.shape)
                shape[-2] = 2 * keep
                sid = st.cm.register(self.key, "halo", shape, x, None, streamed=mode is LayerMode.DISPLACED)
                if halo.before is not None:
                    st.cm.view(sid, r - 1)[..., 2 * keep - self.before :, :].copy_(halo.before)
                if halo.after is not None:
                    st.cm.view(sid, r + 1)[..., : self.after, :].copy_(halo.after)
            return halo.before, halo.after
        sid = st.cm.register(self.key, "halo", (), x, None, streamed=False)  # lookup: registered on a sync step
        before = st.cm.view(sid, r - 1)[..., 2 * keep - self.before :, :] if r > 0 and self.before else None
        after = st.cm.view(sid, r + 1)[..., : self.after, :] if r < n - 1 and self.after else None
        if before is not None:
            before = before.clone()
        if after is not None:
            after = after.clone()
        if mode is LayerMode.DISPLACED:
            st.cm.enqueue(sid, torch.cat([x[..., :keep, :], x[..., x.shape[-2] - keep :, :]], dim=-2))
        return before, after


# ----------------------------------------------------------------------------------------------- attention


def is_attention_module(module: nn.Module) -> bool:
    """Duck typing shared by diffusers' ``Attention`` and ComfyUI's ``CrossAttention``."""
    return all(isinstance(getattr(module, a, None), nn.Module) for a in ("to_q", "to_k", "to_v", "to_out"))


_CONTEXT_KWARGS = ("encoder_hidden_states", "context")


class SelfAttentionKV(_Adapter):
    """Self-attention over the whole image from a row band: K/V of the other ranks, gathered or stale.

    Output hooks on ``to_k``/``to_v`` replace the band's K/V ``(B, L_band, D)`` by the image's ``(B, L, D)`` (rank
    order = row order). They act only while the wrapped module runs without a context (self-attention).
    """

    def __init__(self, module: nn.Module, key: str, state: PatchState):
        super().__init__(module, key, state)
        self._armed = False
        module.forward = self._forward
        self._hooks = [
            module.to_k.register_forward_hook(lambda m, i, o: self._full(o, "k")),
            module.to_v.register_forward_hook(lambda m, i, o: self._full(o, "v")),
        ]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        del self.module.forward

    def _forward(self, *args, **kwargs):
        context = args[1] if len(args) > 1 else None
        for name in _CONTEXT_KWARGS:
            if kwargs.get(name) is not None:
                context = kwargs[name]
        is_self = context is None and kwargs.get("value") is None
        self._armed = is_self and self.state.exchanging
        try:
            return type(self.module).forward(self.module, *args, **kwargs)
        finally:
            self._armed = False

    def _full(self, local: torch.Tensor, which: str) -> Optional[torch.Tensor]:
        if not self._armed:
            return None
        if local.dim() != 3:
            # backstop, not the guard: both attention families project (B, L, C) token tensors
            raise NotImplementedError(f"{self.key}.to_{which}: expected (batch, tokens, dim), got {tuple(local.shape)}")
        st, ctx = self.state, self.state.ctx
        key = f"{self.key}.{which}"
        sizes = st.scaled(local.shape[1])
        mode = st.config.layer_mode
        if st.layers_sync:
            full = all_gather_padded(local, ctx, dim=1, sizes=sizes)
            st.traffic.add("kv", local.numel() * local.element_size() * (ctx.world_size - 1), collectives=1)
            if mode is not LayerMode.FULL_SYNC:
                sid = st.cm.register(key, "kv", local.shape, local, 1, streamed=mode is LayerMode.DISPLACED)
                for r, part in enumerate(full.split(sizes, dim=1)):
                    if r != ctx.rank:
                        st.cm.view(sid, r).copy_(part)
            return full
        sid = st.cm.register(key, "kv", local.shape, local, 1, streamed=False)  # lookup
        parts = [local if r == ctx.rank else st.cm.view(sid, r) for r in range(ctx.world_size)]
        full = torch.cat(parts, dim=1)
        if mode is LayerMode.DISPLACED:
            st.cm.enqueue(sid, local)
        return full


# ----------------------------------------------------------------------------------------------- GroupNorm


def _merge_chan(stats: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge per-rank (mean, M2) ``stats[N, B, G, 2]`` with element counts ``counts[N]`` into (mean, biased var)."""
    w = counts.view(-1, 1, 1)
    total = counts.sum()
    mean = (stats[..., 0] * w).sum(0) / total
    m2 = stats[..., 1].sum(0) + (w * (stats[..., 0] - mean.unsqueeze(0)) ** 2).sum(0)
    return mean, m2 / total


class GroupNormStats(_Adapter):
    """GroupNorm with statistics over the whole image (sync), stale, corrected-async or separate (local).

    ``stale``: the peers' (mean, M2) of the previous step merged with this rank's fresh ones. ``corrected_async``
    (DistriFusion): the previous step's global moments E[x], E[x^2] corrected by this rank's (fresh - stale) local
    moments; where the variance comes out negative, the local fresh variance is used. In exact arithmetic the two
    agree; they differ in rounding and in that guard.
    """

    def __init__(self, module: nn.GroupNorm, key: str, state: PatchState):
        super().__init__(module, key, state)
        self._counts: dict = {}
        module.forward = self._forward

    def remove(self) -> None:
        del self.module.forward

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self.state
        m = self.module
        if not st.exchanging:
            return type(m).forward(m, x)
        mode = GroupNormMode.SYNC if st.sync else st.config.groupnorm
        if mode is GroupNormMode.SEPARATE:
            return type(m).forward(m, x)
        ctx = st.ctx
        b, c = x.shape[:2]
        g = m.num_groups
        xf = x.float().reshape(b, g, -1)
        n_local = xf.shape[-1]
        mean = xf.mean(-1)
        m2 = (xf - mean.unsqueeze(-1)).pow(2).sum(-1)
        fresh = torch.stack([mean, m2], -1)  # (B, G, 2) fp32
        ckey = (n_local, st.rows, x.device)
        counts = self._counts.get(ckey)
        if counts is None:  # built once per shape: a host-to-device copy every call would be a sync point
            counts = self._counts[ckey] = torch.tensor(st.scaled(n_local), dtype=torch.float32, device=x.device)
        streamed = st.config.groupnorm in (GroupNormMode.STALE, GroupNormMode.CORRECTED_ASYNC)
        me = ctx.rank
        if mode is GroupNormMode.SYNC:
            gathered = all_gather_padded(fresh.unsqueeze(0), ctx, dim=0, sizes=[1] * ctx.world_size)
            st.traffic.add("groupnorm", fresh.numel() * 4 * (ctx.world_size - 1), collectives=1)
            if streamed and not st.config.layer_mode is LayerMode.FULL_SYNC:
                sid = st.cm.register(self.key, "groupnorm", fresh.shape, fresh, None, streamed=True)
                for r in range(ctx.world_size):
                    st.cm.view(sid, r).copy_(gathered[r])
            gmean, gvar = _merge_chan(gathered, counts)
        else:
            sid = st.cm.register(self.key, "groupnorm", fresh.shape, fresh, None, streamed=True)  # lookup
            stale = torch.stack([st.cm.view(sid, r) for r in range(ctx.world_size)])
            if mode is GroupNormMode.STALE:
                parts = stale.clone()
                parts[me] = fresh
                gmean, gvar = _merge_chan(parts, counts)
            else:
                w = (counts / counts.sum()).view(-1, 1, 1)
                e1 = stale[..., 0]
                e2 = stale[..., 1] / counts.view(-1, 1, 1) + e1**2
                f1, f2 = mean, m2 / n_local + mean**2
                g1 = (w * e1).sum(0) + w[me] * (f1 - e1[me])
                g2 = (w * e2).sum(0) + w[me] * (f2 - e2[me])
                gvar = g2 - g1**2
                gmean = g1
                gvar = torch.where(gvar < 0, m2 / n_local, gvar)
            st.cm.enqueue(sid, fresh)
        y = (xf - gmean.unsqueeze(-1)) * torch.rsqrt(gvar.unsqueeze(-1) + m.eps)
        y = y.reshape(x.shape).to(x.dtype)
        if m.affine:
            shape = (1, c) + (1,) * (x.dim() - 2)
            y = y * m.weight.to(y.dtype).view(shape) + m.bias.to(y.dtype).view(shape)
        return y
