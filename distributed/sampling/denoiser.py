"""Patch-parallel sampling: parallelize a UNet, and wrap any denoiser so the caller's sampler loop keeps working.

``parallelize_unet(unet, ctx, config)`` applies the UNet plan (:func:`unet_plan`: data, like the VAE families'
row plans, over the adapters of ``distributed/parallel``) and returns a handle;
:class:`PatchParallelDenoiser` wraps a denoiser callable ``model(x, t, **cond)`` that runs that UNet. Each call is
one logical step: the UNet computes this rank's row band (its first conv cuts the band out of the full latent), the
band is completed into the full output (one all-gather, or OTIL's top-k blocks plus stale memory), and the caller's
sampler, scheduler and CFG combination run unchanged on the full tensor. ``finalize(latent)`` gathers every rank's
own band of the final latent: the exact result every rank would have computed for its band.

Design decisions:

* **The caller owns the loop.** The wrapper never sees timesteps as a schedule, only as the model's argument, so
  Euler, DDIM, DPM-Solver, a ComfyUI sampler or a diffusers scheduler all work. Synchronous steps are chosen by
  the logical call index (:meth:`PatchConfig.is_sync_step`), never by a counter the refresh itself resets.
* **split_batch** (DistriFusion's CFG split): with an even world size and a caller that batches
  ``[uncond, cond]``, ranks ``[0, N/2)`` compute the first half and ``[N/2, N)`` the second, each half
  patch-parallel over N/2 ranks. With OTIL each rank would otherwise hold the other half's output frozen at the
  last synchronous step (a CFG bug of a naive OTIL split); ``cfg_repair`` swaps the fresh band with the rank holding the same
  band of the other half, one all-gather of a band over that pair per step. With ``output="gather"`` the whole
  half is exchanged (DistriFusion's behaviour), so there is nothing to repair.
* **The UNet plan is data.** Layer types map to ``parallel`` styles (halo convolution, GroupNorm, gathered-K/V
  attention); the config's modes become the styles' strategies (layer mode -> peer exchange, GroupNorm mode ->
  statistics mode). Host-application subclasses (ComfyUI's ops) match through their torch base classes.
* **Process groups have an owner.** A CFG split needs two subgroups; the denoiser that makes them holds them
  (:class:`SplitGroups`) and releases them in :meth:`PatchParallelDenoiser.remove`. There is no module-level
  cache of groups.
* **Collective-safe**: every branch depends on the config, the world size and tensor shapes every rank shares.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional

import torch
import torch.nn as nn

from ..comm import all_gather_padded
from ..context import ParallelContext
from ..parallel.attention import GatheredAttention
from ..bands import band_heights
from ..parallel.conv import HaloConv
from ..parallel.exchange import DISPLACED, EXACT, STALE, PeerExchange, StepState, compressed
from ..parallel.groupnorm import CorrectedStats, SeparateStats, ShardedGroupNorm, StaleStats, SyncStats
from ..parallel.plan import Applied, Style, apply_plan, undo_all
from .comm_manager import CommManager, Traffic
from .config import GroupNormMode, LayerMode, OutputMode, PatchConfig
from .otil import OtilExchange, choose_k, measure_link_bandwidth
from .split import RankGroups

__all__ = ["unet_plan", "parallelize_unet", "layer_exchange", "UNetPatchHandle", "PatchParallelDenoiser", "SplitLayout", "SplitGroups"]

logger = logging.getLogger(__name__)


class UNetPatchHandle:
    """What :func:`parallelize_unet` returns: the shared state, the adapters, and ``remove()``.

    Stale memories are kept per *stream*: a caller that evaluates cond and uncond in separate calls (ComfyUI
    does when memory is short) passes a stream key per call so each keeps its own halos, K/V and statistics.
    """

    def __init__(self, unet: nn.Module, state: StepState, config: PatchConfig, applied: List[Applied]):
        self.unet = unet
        self.state = state
        self.config = config
        #: the undo records of the adapted modules (layers the plan left row-local are not listed)
        self.adapters = [a for a in applied if a.undo is not None]
        self._removed = False
        self._streams: dict = {}  # stream -> {"hw": (H, W), "cm": CommManager, "steps": int}
        self._current: Optional[dict] = None

    @property
    def traffic(self) -> Traffic:
        return self.state.traffic

    def _set_latent(self, height: int, width: int, cm: Optional[CommManager] = None) -> None:
        """The band table for a latent size; a new (empty) stale memory unless ``cm`` (a stream's) is given."""
        if cm is None:
            rows = band_heights(height, self.state.ctx.world_size, self.state.align, weights=self.state.ctx.band_weights)
            cm = CommManager(self.state.ctx, rows, self.state.traffic, self.config.comm_checkpoint)
        self.state.set_bands(height, width, cm)

    def prepare(self, height: int, width: int, stream: Any = None) -> bool:
        """Select ``stream`` at latent size (height, width); True (fresh, empty memory) when new or resized."""
        entry = self._streams.get(stream)
        if entry is not None and entry["hw"] == (height, width):
            self._set_latent(height, width, cm=entry["cm"])
            self._current = entry
            return False
        if entry is not None:
            entry["cm"].wait()
        self._set_latent(height, width)
        self._current = self._streams[stream] = {"hw": (height, width), "cm": self.state.cm, "steps": 0}
        return True

    _ALL = object()

    def drop_streams(self, stream: Any = _ALL) -> None:
        """Forget ``stream``'s memory, or every stream's (a new sampling run)."""
        keys = list(self._streams) if stream is UNetPatchHandle._ALL else [stream]
        for key in keys:
            entry = self._streams.pop(key, None)
            if entry is not None:
                entry["cm"].wait()
                if entry is self._current:
                    self._current = None
                    self.state.cm = None

    def begin_step(self, step: int, sync: bool) -> None:
        st = self.state
        if st.cm is None or self._current is None:
            raise RuntimeError("call prepare(height, width) before the first step")
        if self._current["steps"] == 0 and not sync and st.ctx.world_size > 1 and self.config.layer_mode is not LayerMode.FULL_SYNC:
            # backstop, not the guard: PatchConfig requires warmup_steps >= 1 for stale modes
            raise RuntimeError("the first step after prepare() must be synchronous: stale memories are empty")
        st.cm.wait()
        st.step, st.sync, st.active = step, sync, True

    def end_step(self) -> None:
        st = self.state
        st.active = False
        if not st.cm.laid_out:
            st.cm.build_layout()
        else:
            st.cm.flush()
        self._current["steps"] += 1

    def remove(self) -> None:
        """Undo :func:`parallelize_unet` (idempotent)."""
        if self._removed:
            return
        for entry in self._streams.values():
            entry["cm"].wait()
        undo_all(self.adapters)
        self._removed = True


def _row_align(convs) -> int:
    align = 1
    for _, m in convs:
        align *= m.stride[0]
    return align


_EXCHANGES = {LayerMode.FULL_SYNC: EXACT, LayerMode.NO_SYNC: STALE, LayerMode.DISPLACED: DISPLACED}


def layer_exchange(config: PatchConfig) -> PeerExchange:
    """The halo and K/V strategy of ``config``: its layer mode's, compressed when ``exchange_bits`` is set."""
    if config.exchange_bits:
        return compressed(config.exchange_bits)
    return _EXCHANGES[config.layer_mode]
_STATISTICS = {
    GroupNormMode.SYNC: SyncStats(),
    GroupNormMode.STALE: StaleStats(),
    GroupNormMode.CORRECTED_ASYNC: CorrectedStats(),
    GroupNormMode.SEPARATE: SeparateStats(),
}


def unet_plan(input_conv: str, config: PatchConfig) -> Dict[str, Style]:
    """The UNet's plan: ``glob -> Style`` over module paths and layer types (see ``parallel/plan.py``).

    Args:
        input_conv: path of the conv that receives the full latent (it cuts the band plus halo locally).
        config: the modes: ``layer_mode`` picks the peer exchange of halos and K/V, ``groupnorm`` the statistics.

    Every ``Conv2d`` whose kernel reaches across rows gets a halo; every ``GroupNorm`` whole-image statistics;
    every ``*Attention`` (diffusers' ``Attention``, ComfyUI's ``CrossAttention``) gathered K/V on self-attention
    calls. Everything else in a UNet is row- or token-local and runs unchanged.
    """
    exchange = layer_exchange(config)
    return {
        input_conv: HaloConv(exchange=exchange, cut_input=True),
        "Conv2d": HaloConv(exchange=exchange),
        "GroupNorm": ShardedGroupNorm(stats=_STATISTICS[config.groupnorm]),
        "*Attention": GatheredAttention(kv=exchange),
    }


def parallelize_unet(unet: nn.Module, ctx: ParallelContext, config: PatchConfig, *, input_conv: Optional[str] = None) -> UNetPatchHandle:
    """Install row-band patch parallelism on ``unet`` (diffusers' UNet2DConditionModel or ComfyUI's UNetModel).

    Args:
        unet: the model. Layers are matched by :func:`unet_plan` through their torch base classes
            (``nn.Conv2d``, ``nn.GroupNorm``), so ComfyUI's subclasses are covered, and attention by class name.
        ctx: the patch group (all ranks computing the same batch).
        config: the :class:`PatchConfig`.
        input_conv: name of the conv that receives the full latent (default: the first ``nn.Conv2d`` registered,
            ``conv_in`` in diffusers, ``input_blocks.0.0`` in ComfyUI).

    Returns:
        :class:`UNetPatchHandle`; call ``prepare(H, W)`` then ``begin_step``/``end_step`` around each call, or let
        :class:`PatchParallelDenoiser` do it. ``handle.remove()`` restores the model.

    Raises:
        RuntimeError: the UNet already carries PatchRay adapters (remove that handle first).

    Example:
        >>> handle = parallelize_unet(unet, ctx, preset("displaced"))   # doctest: +SKIP
        >>> handle.remove()                                               # doctest: +SKIP
    """
    if not isinstance(config, PatchConfig):
        raise TypeError(f"config must be a PatchConfig (got {type(config).__name__}); use sampling.config.preset(name)")
    convs = [(n, m) for n, m in unet.named_modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise NotImplementedError(f"{type(unet).__name__} has no torch.nn.Conv2d; not a 2D UNet")
    first = input_conv if input_conv is not None else convs[0][0]
    if first not in dict(convs):
        raise ValueError(f"input_conv={input_conv!r} is not an nn.Conv2d of {type(unet).__name__}")
    state = StepState(ctx, align=_row_align([c for c in convs if c[1].stride[0] > 1]), traffic=Traffic())
    applied: List[Applied] = []
    if ctx.world_size > 1:
        applied = apply_plan([("", unet)], unet_plan(first, config), state, strict=False)
    return UNetPatchHandle(unet, state, config, applied)


# ------------------------------------------------------------------------------------------------- denoiser


@dataclasses.dataclass
class _Stream:
    """One stream's sampling state: its logical step, input shape, OTIL exchange, other-CFG-half memory."""

    shape: tuple
    step: int = 0
    otil: Optional[OtilExchange] = None
    other: Optional[torch.Tensor] = None


class SplitLayout(NamedTuple):
    """Where this rank sits when the CFG batch is split: ``half`` (0 = first batch half) and the two contexts."""

    half: int
    patch: ParallelContext  # the ranks computing the same half
    pair: Optional[ParallelContext]  # the two ranks holding the same band of opposite halves


class SplitGroups:
    """The two subgroups of a CFG split, owned by the object that made them (a :class:`PatchParallelDenoiser`).

    The library's :class:`~.split.RankGroups` with two groups: ranks ``[0, N/2)`` compute the first batch half and
    ``[N/2, N)`` the second (the patch groups, its ``inner``); ranks ``p`` and ``p + N/2`` hold the same band of
    opposite halves (the pair groups, its ``across``). :meth:`close` releases them (not destroyed: see
    ``split.py``); the owner calls it when it is removed.
    """

    def __init__(self, ctx: ParallelContext):
        self._groups = RankGroups(ctx, 2)
        g = self._groups.layout
        self.layout: Optional[SplitLayout] = SplitLayout(g.group, g.inner, g.across)

    def close(self) -> None:
        """Release the groups (idempotent)."""
        self._groups.close()
        self.layout = None


def _as_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the denoiser returned {type(out).__name__}; expected a tensor (or .sample / a tuple)")


def _take_half(obj: Any, full_batch: int, half: int) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 1 and obj.shape[0] == full_batch:
            return obj.chunk(2, dim=0)[half]
        return obj
    if isinstance(obj, dict):
        return {k: _take_half(v, full_batch, half) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_take_half(v, full_batch, half) for v in obj)
    return obj


class PatchParallelDenoiser:
    """Wrap a denoiser ``model(x, t, **cond)`` that runs ``unet`` so each rank computes one row band.

    Args:
        model: the denoiser callable; gets the full latent ``x`` (the CFG-batched one if the caller batches CFG) and
            returns the noise prediction (tensor, ``.sample`` or a tuple).
        ctx: the context of all ranks.
        config: the :class:`PatchConfig`.
        unet: the module to parallelize (default: ``model`` itself when it is an ``nn.Module``).
        cfg_in_batch: whether the caller batches ``[uncond, cond]`` along dim 0 (required by ``split_batch``).

    Call it like the model; it returns the full output on every rank (remote regions approximate in OTIL mode).
    At the end, ``finalize(latent)`` returns the exact final latent on every rank; ``remove()`` restores the UNet.

    Example:
        >>> den = PatchParallelDenoiser(lambda x, t, **c: unet(x, t, **c).sample, ctx, preset("otil"), unet=unet)
        >>> for t in timesteps:                                   # the caller's own sampler loop
        ...     eps = den(torch.cat([x, x]), t, encoder_hidden_states=ctx_emb)
        ...     x = scheduler_step(x, eps, t)
        >>> x = den.finalize(x)
    """

    def __init__(
        self,
        model: Callable[..., Any],
        ctx: ParallelContext,
        config: PatchConfig,
        *,
        unet: Optional[nn.Module] = None,
        cfg_in_batch: bool = True,
        input_conv: Optional[str] = None,
    ):
        if unet is None:
            if not isinstance(model, nn.Module):
                raise TypeError("pass unet= (the nn.Module the denoiser runs) when model is not an nn.Module")
            unet = model
        self.model = model
        self.ctx = ctx
        self.config = config
        split = config.split_batch and cfg_in_batch and ctx.world_size >= 2 and ctx.world_size % 2 == 0
        if config.split_batch and not split and ctx.world_size > 1 and ctx.rank == 0:
            why = "the world size is odd" if ctx.world_size % 2 else "the caller does not batch CFG (cfg_in_batch=False)"
            logger.warning("split_batch is off for this run because %s; set split_batch=False to silence this", why)
        self._groups: Optional[SplitGroups] = SplitGroups(ctx) if split else None
        self.split: Optional[SplitLayout] = self._groups.layout if split else None
        self.patch_ctx = self.split.patch if split else ctx
        try:
            self.handle = parallelize_unet(unet, self.patch_ctx, config, input_conv=input_conv)
        except BaseException:
            if self._groups is not None:
                self._groups.close()
            raise
        self.traffic = self.handle.traffic
        self._streams: dict = {}  # stream key -> _Stream
        self._cur: Optional[_Stream] = None
        self._bandwidth: Optional[float] = None

    # --------------------------------------------------------------------------------------------

    @property
    def bounds(self):
        return self.handle.state.bounds

    @property
    def rows(self):
        return self.handle.state.rows

    @property
    def step(self) -> int:
        """The next logical step index of the default stream."""
        s = self._streams.get(None)
        return s.step if s is not None else 0

    def reset(self) -> None:
        """Start a new sampling run: every stream's next call is logical step 0 (synchronous), memories rebuilt."""
        self._streams.clear()
        self._cur = None
        self.handle.drop_streams()

    def remove(self) -> None:
        """Restore the UNet and release the process groups this denoiser made (idempotent)."""
        self.handle.remove()
        if self._groups is not None:
            self._groups.close()

    def __call__(self, x: torch.Tensor, t: Any, *, patch_stream: Hashable = None, patch_step: Optional[int] = None, **cond) -> torch.Tensor:
        """One logical step of stream ``patch_stream`` (default: one stream; pass e.g. "cond"/"uncond" when the
        caller evaluates them in separate calls). ``patch_step`` overrides the stream's own call count; passing
        ``patch_step=0`` to a stream that already ran starts a new run of it (fresh memories). Without it, call
        :meth:`reset` before each new sampling run of the same shape."""
        if x.dim() != 4:
            raise ValueError(f"x must be a (batch, channels, height, width) latent (got shape {tuple(x.shape)})")
        if self.split is not None and x.shape[0] % 2:
            raise ValueError(f"split_batch needs an even batch ([uncond, cond]); got batch {x.shape[0]}")
        st = self._streams.get(patch_stream)
        restart = patch_step is not None and int(patch_step) == 0 and st is not None and st.step > 0
        if st is None or st.shape != tuple(x.shape) or restart:  # a new run of this stream
            if st is not None:
                self.handle.drop_streams(patch_stream)  # a new run of this stream: memories are shaped by the batch
            st = self._streams[patch_stream] = _Stream(shape=tuple(x.shape))
        self._cur = st
        self.handle.prepare(x.shape[-2], x.shape[-1], patch_stream)
        step = st.step if patch_step is None else int(patch_step)
        sync = self.config.is_sync_step(step)
        x_in, t_in, cond_in = x, t, cond
        if self.split is not None:
            x_in = _take_half(x, x.shape[0], self.split.half)
            t_in = _take_half(t, x.shape[0], self.split.half)
            cond_in = _take_half(cond, x.shape[0], self.split.half)
        self.handle.begin_step(step, sync)
        try:
            band = _as_tensor(self.model(x_in, t_in, **cond_in))
        finally:
            self.handle.end_step()
        own = self._complete(band, sync)
        out = self._join_halves(band, own, sync) if self.split is not None else own
        st.step = step + 1
        return out

    def _complete(self, band: torch.Tensor, sync: bool) -> torch.Tensor:
        """The patch group's full output of its batch, from each rank's band."""
        pctx = self.patch_ctx
        if pctx.world_size == 1:
            return band
        rows = list(self.rows)
        if sync or self.config.output is OutputMode.GATHER:
            full = all_gather_padded(band, pctx, dim=2, sizes=rows)
            self.traffic.add("output", band.numel() * band.element_size() * (pctx.world_size - 1), collectives=1)
            if self.config.output is OutputMode.OTIL:
                self._exchange(band).sync(full)
            return full
        return self._exchange(band).step(band)

    def _exchange(self, band: torch.Tensor) -> OtilExchange:
        if self._cur.otil is None:
            cfg = self.config
            b, c, _, w = band.shape
            from .otil import _num_blocks

            nbs = [_num_blocks(h, w, cfg.block_size) for h in self.rows]
            if cfg.adaptive_k:
                if self._bandwidth is None:
                    self._bandwidth = cfg.link_bandwidth_gbps or measure_link_bandwidth(self.patch_ctx, band.device)
                block_bytes = b * c * cfg.block_size**2 * band.element_size() + 4
                ks = [choose_k(nb, block_bytes, self.patch_ctx.world_size - 1, self._bandwidth, cfg.comm_budget_ms) for nb in nbs]
            else:
                ks = [cfg.k_for(nb) for nb in nbs]
            self._cur.otil = OtilExchange(
                self.patch_ctx, self.rows, b, c, w, band.dtype, band.device, cfg.block_size, ks, cfg.compress_bits, self.traffic
            )
        return self._cur.otil

    def _join_halves(self, band: torch.Tensor, own: torch.Tensor, sync: bool) -> torch.Tensor:
        """Both CFG halves on every rank (split_batch)."""
        pair = self.split.pair
        b = own.shape[0]
        if sync or self.config.output is OutputMode.GATHER:
            both = all_gather_padded(own, pair, dim=0, sizes=[b, b])
            self.traffic.add("cfg", own.numel() * own.element_size(), collectives=1)
            self._cur.other = both.chunk(2, dim=0)[1 - self.split.half].clone()
        elif self.config.cfg_repair_half:
            both = all_gather_padded(own, pair, dim=0, sizes=[b, b])
            self.traffic.add("cfg", own.numel() * own.element_size(), collectives=1)
            self._cur.other = both.chunk(2, dim=0)[1 - self.split.half].clone()
        elif self.config.cfg_repair:
            s, e = self.bounds[self.patch_ctx.rank], self.bounds[self.patch_ctx.rank + 1]
            both = all_gather_padded(band, pair, dim=0, sizes=[b, b])
            self.traffic.add("cfg", band.numel() * band.element_size(), collectives=1)
            self._cur.other[:, :, s:e] = both.chunk(2, dim=0)[1 - self.split.half]
        # else: no repair, kept to reproduce the bug: the other half stays as of the last sync step
        halves = [own, self._cur.other] if self.split.half == 0 else [self._cur.other, own]
        return torch.cat(halves, dim=0)

    def finalize(self, latent: torch.Tensor) -> torch.Tensor:
        """The exact final latent on every rank: each rank's own band, gathered (one all-gather)."""
        pctx = self.patch_ctx
        if pctx.world_size == 1:
            return latent
        if self.bounds is None or latent.shape[-2] != self.bounds[-1]:
            raise ValueError(
                f"finalize expects a latent of the sampled height {self.bounds[-1] if self.bounds else None}, "
                f"got shape {tuple(latent.shape)}"
            )
        s, e = self.bounds[pctx.rank], self.bounds[pctx.rank + 1]
        return all_gather_padded(latent[:, :, s:e].contiguous(), pctx, dim=2, sizes=list(self.rows))
