"""Sequence parallelism for diffusers' DiT classes: ``parallelize_dit``, its handle, and the output exchanges.

The family table (data: where each class's image tokens, text tokens, positional embedding, attentions and output
projection are) is :mod:`.dit_families`; the modelled traffic of a step is :mod:`.dit_traffic`. Both are
re-exported here. The styles are the ones of ``parallel/sequence.py``; :func:`parallelize_dit` applies them with
``parallel.plan.apply_plan`` and its handle removes them (every forward, hook and attribute comes back as it was).

Design decisions:

* **Data, not code per family.** A family is a :class:`DiTFamily` row: globs over module paths -> styles, the
  root inputs that are per token (Wan 2.2's and LTX-Video's per-token timesteps), how to read the token grid from
  the call, and the configurations that are refused with what would be needed. Cross-attention modules (Wan's and
  LTX-Video's ``attn2``) are not listed: their queries are the band's tokens and their keys are the replicated
  text, so they run unchanged.
* **diffusers' ``_cp_plan`` agrees, and is not executed.** diffusers 0.42 marks the same split points on these
  classes (``ContextParallelInput`` on the embedder/RoPE, ``ContextParallelOutput`` on ``proj_out``);
  :func:`cp_plan_points` reads them as data and the tests check every family's gather point against them, but
  the execution (shards by latent rows, text replicated, attention exchange) is PatchRay's, through ``comm``.
* **The grid is read from the call, on every rank alike** (the latent's shape, ``img_shapes``, ``img_ids`` or the
  ``num_frames/height/width`` arguments), so every rank derives the same shard table without a collective.
* **Text is sharded too** (joint-attention families: FLUX.1, Qwen-Image, HunyuanVideo; ``shard_text``, the
  default in the exact modes): each rank owns a contiguous slice of the text tokens (:func:`~..parallel.tokens.text_split`), cut where
  the text stream is embedded, so every per-token op of the text stream runs on 1/N of it too; the attentions
  exchange text and image K/V as one sharded set. The text length, the validity of a text padding mask (laid over
  every rank's keys by the attentions) and whether a call must keep its text whole (fewer text tokens than ranks
  where the family cannot hold an empty slice) are read from the call on every rank alike. The text stream is discarded by these models before ``proj_out``: only
  image tokens are gathered.
* **Refusals name the class and what would be needed**, and happen at apply time (the model's configuration) or
  at the first call (its inputs), identically on every rank.
* **The low-traffic modes are the UNet's presets** (a :class:`~.config.PatchConfig`, ``config=``): the layer mode
  picks the gathered K/V strategy (``displaced``: the peers' K/V of the previous step, all-gathered asynchronously
  behind the next layers' compute, DistriFusion/PipeFusion-style; ``no_sync``: frozen between synchronous steps;
  ``exchange_bits``: the displaced refresh as low-bit residuals with error feedback, CompactFusion-style), and
  ``output="otil"`` completes the output tokens with OTIL's top-k block exchange instead of the all-gather. The
  warm-up and refresh steps are the config's synchronous steps (exact); a synchronous step followed by another one
  (every warm-up step but the last) leaves the stale memory alone and runs the cheapest exact attention for the link
  (``mode="auto"``: Ulysses where the heads divide and it moves fewer bytes, from 3 ranks), and only the last one
  gathers K/V into the memory. A DiT rank cuts its input tokens from its
  own band of the latent, so the remote regions of its latent copy (OTIL's stale blocks) never enter its next
  step; :meth:`DiTHandle.finalize_tokens` / :meth:`DiTHandle.finalize_rows` gather each rank's own band at the end.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..comm import all_gather_padded
from ..context import ParallelContext
from ..parallel.exchange import EXACT, PeerExchange
from ..parallel.plan import Applied, apply_plan, undo_all
from ..parallel.sequence import SeqMode, SequenceState, gather_tokens, shard_tokens
from .comm_manager import CommManager, Traffic
from .config import LayerMode, OutputMode, PatchConfig
from .dit_families import DIT_FAMILIES, DiTFamily, check_plan_matches, cp_plan_points, dit_plan, family_of
from .dit_traffic import FULL_SIZE_SHAPES, DiTShape, step_cost, token_share, token_shards
from .otil import OtilExchange, _num_blocks

__all__ = [
    "DiTFamily",
    "DIT_FAMILIES",
    "family_of",
    "dit_plan",
    "parallelize_dit",
    "DiTHandle",
    "dit_exchange",
    "text_tokens",
    "TokenOtil",
    "finalize_rows",
    "refills",
    "cp_plan_points",
    "DiTShape",
    "FULL_SIZE_SHAPES",
    "step_cost",
    "token_share",
    "token_shards",
]


class DiTHandle:
    """What :func:`parallelize_dit` returns: the shared state, the step bracket, and ``remove()``.

    ``state`` is the :class:`SequenceState` (shard table of the last call, traffic, stale memory). For the
    stale/displaced/compressed K/V strategies and OTIL's output exchange bracket every model call with
    :meth:`begin_step`/:meth:`end_step` (the step index decides which steps are synchronous); exact modes need no
    bracket.
    """

    def __init__(self, model: nn.Module, family: DiTFamily, state: SequenceState, applied: List[Applied],
                 config: Optional[PatchConfig] = None):
        self.model = model
        self.family = family
        self.state = state
        self.config = config
        self.adapters = [a for a in applied if a.undo is not None]
        self._removed = False
        if config is not None and config.output is OutputMode.OTIL and state.ctx.world_size > 1:
            state.output_exchange = TokenOtil(state, config)

    @property
    def traffic(self) -> Traffic:
        return self.state.traffic

    def begin_step(self, step: int, sync: Optional[bool] = None, stream: Any = None) -> None:
        """Start logical step ``step`` of ``stream``; ``sync`` defaults to the config's schedule (warm-up, refresh).

        A synchronous step followed by another one by the schedule (every warm-up step but the last) runs its
        attention exact by the cheapest exact mode for the link and leaves the stale memory alone; the last
        warm-up step and the refresh steps refill it (:func:`refills`)."""
        if sync is None:
            sync = self.config.is_sync_step(step) if self.config is not None else True
        self.state.select_stream(stream)
        self.state.begin_step(step, sync, refills(self.config, step))

    def end_step(self) -> None:
        self.state.end_step()

    # ---------------------------------------------------------------- the exact final latent

    def finalize_tokens(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The exact final packed latent (tokens in global order along ``dim``, FLUX/Qwen-Image pipelines): each
        rank's own tokens, gathered (one all-gather). Identity on one rank."""
        st = self.state
        if st.ctx.world_size == 1:
            return x
        shards = st.require_shards()
        return gather_tokens(shard_tokens(x, shards, st.ctx.rank, dim=dim).contiguous(), shards, st.ctx, dim=dim)

    def finalize_rows(self, latent: torch.Tensor, row_dim: int = -2) -> torch.Tensor:
        """The exact final latent grid (``[..., H, W]``; Wan, HunyuanVideo, LTX-Video): each rank's own rows (its
        token rows times the patch height), gathered. Identity on one rank."""
        return finalize_rows(self.state, latent, row_dim)

    def remove(self) -> None:
        """Restore the model (idempotent)."""
        if self._removed:
            return
        self.state.finish()
        self.state.output_exchange = None
        undo_all(self.adapters)
        self._removed = True


class TokenOtil:
    """OTIL's top-k block exchange of a DiT's output tokens: ``SequenceState.output_exchange`` for a preset with
    ``output="otil"``. Exact all-gather (and a memory reset) on synchronous steps; otherwise each rank sends the
    ``k`` blocks of its band of the token grid that changed most (``block_size / 2`` tokens a side: a token is 2x2
    latent pixels in every covered family), one OTIL memory per stream and grid."""

    def __init__(self, state: SequenceState, config: PatchConfig):
        self.state, self.config = state, config
        self._ex: Dict[Any, OtilExchange] = {}

    def __call__(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        st, cfg = self.state, self.config
        shards, ctx = st.require_shards(), st.ctx
        if dim != 1 or t.dim() != 3:
            raise NotImplementedError(f"OTIL output exchange needs [batch, tokens, features] tokens (got {tuple(t.shape)}, dim {dim})")
        b, _, f = t.shape
        fr, rows, cols = shards.frames, shards.rows, shards.cols
        key = (st.stream, shards, b, f, t.dtype)
        ex = self._ex.get(key)
        if ex is None:
            bs = max(1, cfg.block_size // 2)
            ks = [cfg.k_for(_num_blocks(h, cols, bs)) for h in shards.row_sizes]
            ex = self._ex[key] = OtilExchange(ctx, shards.row_sizes, b, fr * f, cols, t.dtype, t.device, bs, ks,
                                              cfg.compress_bits, st.traffic)
        if st.sync:
            full = gather_tokens(t, shards, ctx, dim=1)
            st.traffic.add("output", t.numel() * t.element_size() * (ctx.world_size - 1), collectives=1)
            ex.sync(full.view(b, fr, rows, cols, f).permute(0, 1, 4, 2, 3).reshape(b, fr * f, rows, cols))
            return full
        mine = shards.row_sizes[ctx.rank]
        band = t.view(b, fr, mine, cols, f).permute(0, 1, 4, 2, 3).reshape(b, fr * f, mine, cols)
        grid = ex.step(band)
        return grid.view(b, fr, f, rows, cols).permute(0, 1, 3, 4, 2).reshape(b, fr * rows * cols, f)


def refills(config: Optional[PatchConfig], step: int) -> bool:
    """Whether a synchronous logical step ``step`` must leave the stale memory filled: the next step is asynchronous by
    ``config``'s schedule (the last warm-up step, a refresh step), or there is no schedule to tell (``None``)."""
    return config is None or not config.is_sync_step(step + 1)


def finalize_rows(state: SequenceState, latent: torch.Tensor, row_dim: int = -2) -> torch.Tensor:
    """The exact final latent grid (``[..., H, W]``): each rank's own rows (its token rows times the patch height,
    from ``state``'s shard table), gathered in one all-gather. Identity on one rank."""
    st = state
    if st.ctx.world_size == 1:
        return latent
    shards = st.require_shards()
    extent = latent.shape[row_dim]
    ph = -(-extent // shards.rows)  # the patch height; a host that pads the latent to whole patches (ComfyUI) has
    if (shards.rows - 1) * ph >= extent:  # a last token row that is partly padding, cut off here
        raise ValueError(f"latent of {extent} rows does not match the {shards.rows} token rows")
    bounds = [min(extent, b * ph) for b in shards.row_bounds]
    rows = [b - a for a, b in zip(bounds, bounds[1:])]
    mine = latent.narrow(row_dim, bounds[st.ctx.rank], rows[st.ctx.rank]).contiguous()
    return all_gather_padded(mine, st.ctx, dim=row_dim % latent.dim(), sizes=rows)


def _root_hook(model: nn.Module, family: DiTFamily, state: SequenceState, shard_text: bool) -> Applied:
    signature = inspect.signature(model.forward)

    def hook(mod, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        call = dict(bound.arguments)
        why = family.refuse(model, call)
        if why:
            raise NotImplementedError(f"{type(model).__name__}: sequence parallelism does not support {why}")
        state.begin_call()
        text, valid = text_tokens(family, model, call, state.ctx.world_size, shard_text)
        state.set_grid(*family.grid(model, call), text=text, text_side=family.text_side)
        state.set_text_valid(valid if text else None)
        changed = False
        if text and family.prepare is not None:
            prepared = family.prepare(call, state.shards, state.ctx.rank)
            if prepared is not None:
                call, changed = prepared, True
        for name, (ndim, dim) in family.per_token.items():
            value = call.get(name)
            if isinstance(value, torch.Tensor) and value.dim() == ndim and state.ctx.world_size > 1:
                call[name] = shard_tokens(value, state.shards, state.ctx.rank, dim=dim)
                changed = True
        if not changed:
            return None
        bound.arguments.update(call)
        return tuple(bound.args), dict(bound.kwargs)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return Applied(handle.remove)


def text_tokens(family: DiTFamily, model: nn.Module, call: Dict[str, Any], world_size: int,
                shard_text: bool = True) -> Tuple[int, Optional[torch.Tensor]]:
    """The text tokens a call shards (0: none, or kept whole on every rank) and the ``[B, T]`` validity of its text
    padding mask (``None``: every token attended to), from what every rank holds alike."""
    if not shard_text or family.text is None or world_size == 1:
        return 0, None
    total, keep_whole, valid = family.text(model, call)
    if keep_whole or total == 0 or (total < world_size and not family.empty_text_ok):
        return 0, None
    return total, valid


def parallelize_dit(
    model: nn.Module,
    ctx: ParallelContext,
    *,
    mode: str = "auto",
    kv: PeerExchange = EXACT,
    link: Optional[str] = None,
    traffic: Optional[Traffic] = None,
    config: Optional[PatchConfig] = None,
    shard_text: Optional[bool] = None,
    share_modulation: bool = True,
) -> DiTHandle:
    """Install sequence parallelism on one of diffusers' DiT classes (see :data:`DIT_FAMILIES`).

    Args:
        model: ``FluxTransformer2DModel``, ``QwenImageTransformer2DModel``, ``WanTransformer3DModel``,
            ``HunyuanVideoTransformer3DModel`` or ``LTXVideoTransformer3DModel`` (or a subclass).
        ctx: the sequence group (every rank computes the same batch; each its band of token rows).
        mode: attention mode: ``"gathered"``, ``"ulysses"`` or ``"auto"`` (see ``parallel/sequence.py``).
        kv: the gathered mode's K/V strategy (``EXACT``; ``STALE``/``DISPLACED`` need the step bracket).
        link: link profile for ``auto``.
        traffic: byte accounting to add to (a new one by default).
        config: a sampling preset (:func:`~.config.preset`: ``displaced``, ``otil``, ``balanced``, ``compressed``,
            ...): sets the K/V strategy from its layer mode (overriding ``kv``) and, with ``output="otil"``, OTIL's
            exchange of the output tokens; bracket each call with ``handle.begin_step(step)``/``end_step()``.
            GroupNorm fields do not apply (DiTs have none). ``None``: ``kv`` as given.
        shard_text: joint-attention families (FLUX.1, Qwen-Image, HunyuanVideo) shard their text tokens too (each
            rank a contiguous slice; exact); False keeps the text whole on every rank. ``None`` (default): True for
            the exact modes (no ``config``, or ``full_sync`` with the gathered output), False for the stale presets:
            with the text sharded the remote text K/V are stale too, which raised the final-latent error by about 4%
            (1-8%) over the text kept whole on tiny FLUX.1 and Qwen-Image (results/cpu-warmup), while it cuts a rank's
            per-token work to its share (FLUX.1 1024x1024: 2,304 instead of 2,560 of 4,608 tokens at N = 2).
            ``True`` with a stale preset: the text K/V are part of the sharded set, exchanged with the image K/V;
            each stream (``begin_step(stream=)``) keeps its own shard table and stale memory, so a cond and an
            uncond prompt of different lengths may be evaluated in turn.

        share_modulation: the blocks' adaLN modulation layers (FLUX.1, Qwen-Image, HunyuanVideo), which all read
            the one per-call embedding, are computed once across the ranks (each rank ``1/N`` of every layer's
            outputs, one all-gather per call; exact); False: every rank computes them whole (for comparisons).

    Returns:
        :class:`DiTHandle`. The model is then called as usual, on every rank with the same full inputs; its output
        is the full output on every rank. ``handle.remove()`` restores the model.

    Raises:
        NotImplementedError: an uncovered class or configuration (names it and what would be needed).
        RuntimeError: the model already carries PatchRay adapters.

    Example:
        >>> handle = parallelize_dit(transformer, ctx, mode="auto")   # doctest: +SKIP
        >>> noise_pred = transformer(**inputs).sample                  # full output, every rank
        >>> handle.remove()                                             # doctest: +SKIP
    """
    family = family_of(model)
    why = family.refuse(model, None)
    if why:
        raise NotImplementedError(f"{type(model).__name__}: sequence parallelism does not support {why}")
    if config is not None:
        kv = dit_exchange(config, mode)
    if shard_text is None:
        shard_text = config is None or (config.layer_mode is LayerMode.FULL_SYNC and config.output is OutputMode.GATHER)
    traffic = traffic if traffic is not None else Traffic()
    checkpoint = config.comm_checkpoint if config is not None else 60
    state = SequenceState(ctx, traffic, memory=lambda c, rows, t: CommManager(c, rows, t, checkpoint))
    applied: List[Applied] = []
    if ctx.world_size > 1:
        plan = dit_plan(family, mode=mode, kv=kv, link=link, modulation=share_modulation)
        check_plan_matches(model, family, plan)
        applied = apply_plan([("", model)], plan, state, strict=False)
        try:
            applied.append(_root_hook(model, family, state, shard_text))
        except BaseException:
            undo_all(applied)
            raise
    return DiTHandle(model, family, state, applied, config)


def dit_exchange(config: PatchConfig, mode: str = "auto") -> PeerExchange:
    """The gathered K/V strategy of a sampling preset for a DiT (refuses Ulysses with a stale strategy)."""
    from .denoiser import layer_exchange

    if not isinstance(config, PatchConfig):
        raise TypeError(f"config must be a PatchConfig (got {type(config).__name__}); use sampling.config.preset(name)")
    kv = layer_exchange(config)
    if str(mode) in ("ulysses", SeqMode.ULYSSES) and config.layer_mode is not LayerMode.FULL_SYNC:
        raise ValueError(
            f"sequence attention 'ulysses' exchanges this step's queries, keys and values; the {config.layer_mode.value} "
            f"layer mode keeps earlier K/V in a gathered memory: pick attention 'gathered' or 'auto' for it"
        )
    return kv


