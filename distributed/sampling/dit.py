"""Sequence parallelism for diffusers' DiT classes: one family table (data) and ``parallelize_dit``.

Each family row says, for one diffusers transformer class, where the token sequence is cut to the rank's band
(the patch embedding's output), where the positional embedding is (the RoPE module's output, sliced by the same
index), which attention modules are self/joint attention (and on which side their replicated text tokens sit),
and where the tokens are gathered back (the output projection, where a token is narrowest). The styles are the
ones of ``parallel/sequence.py``; :func:`parallelize_dit` applies them with ``parallel.plan.apply_plan`` and its
handle removes them (every forward, hook and attribute comes back as it was).

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
* **Refusals name the class and what would be needed**, and happen at apply time (the model's configuration) or
  at the first call (its inputs), identically on every rank.
* **The low-traffic modes are the UNet's presets** (a :class:`~.config.PatchConfig`, ``config=``): the layer mode
  picks the gathered K/V strategy (``displaced``: the peers' K/V of the previous step, all-gathered asynchronously
  behind the next layers' compute, DistriFusion/PipeFusion-style; ``no_sync``: frozen between synchronous steps;
  ``exchange_bits``: the displaced refresh as low-bit residuals with error feedback, CompactFusion-style), and
  ``output="otil"`` completes the output tokens with OTIL's top-k block exchange instead of the all-gather. The
  warm-up and refresh steps are the config's synchronous steps (exact). A DiT rank cuts its input tokens from its
  own band of the latent, so the remote regions of its latent copy (OTIL's stale blocks) never enter its next
  step; :meth:`DiTHandle.finalize_tokens` / :meth:`DiTHandle.finalize_rows` gather each rank's own band at the end.
"""

from __future__ import annotations

import fnmatch
import inspect
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from ..comm import all_gather_padded
from ..context import ParallelContext
from ..parallel.exchange import EXACT, CompressedExchange, PeerExchange
from ..parallel.plan import Applied, Style, apply_plan, undo_all
from ..parallel.sequence import (
    AttentionCost,
    GatherTokens,
    SeqMode,
    TokenShards,
    attention_cost,
    choose_mode,
    SequenceAttentionStyle,
    SequenceState,
    ShardGridRows,
    ShardTokens,
    gather_tokens,
    shard_tokens,
)
from .comm_manager import CommManager, Traffic, packed_bytes
from .config import LayerMode, OutputMode, PatchConfig
from .otil import OtilExchange, _num_blocks

__all__ = [
    "DiTFamily",
    "DIT_FAMILIES",
    "family_of",
    "dit_plan",
    "parallelize_dit",
    "DiTHandle",
    "dit_exchange",
    "TokenOtil",
    "finalize_rows",
    "cp_plan_points",
    "DiTShape",
    "FULL_SIZE_SHAPES",
    "step_cost",
]


class DiTFamily(NamedTuple):
    """One diffusers DiT class and how it is sequence-parallelized.

    Args:
        name: short family name (README, errors).
        cls: the diffusers class name.
        layers: ``glob -> (kind, options)``: ``"shard"`` (:class:`ShardTokens`), ``"shard_rows"``
            (:class:`ShardGridRows`), ``"attention"`` (:class:`SequenceAttentionStyle`; ``text`` side), ``"gather"``
            (:class:`GatherTokens`).
        grid: ``grid(model, call)`` -> ``(frames, rows, cols)`` token grid, from the bound forward arguments.
        per_token: root arguments that carry one value per image token when they have ``ndim`` dims:
            ``name -> (ndim, dim)``; they are sharded like the tokens.
        refuse: ``refuse(model, call)`` -> a reason (str) or ``None``; ``call`` is ``None`` at apply time.
    """

    name: str
    cls: str
    layers: Dict[str, Tuple[str, dict]]
    grid: Callable[[nn.Module, Dict[str, Any]], Tuple[int, int, int]]
    per_token: Dict[str, Tuple[int, int]]
    refuse: Callable[[nn.Module, Optional[Dict[str, Any]]], Optional[str]]


def _patched_grid(model, call, t_key, s_key):
    x = call["hidden_states"]
    cfg = model.config
    pt = cfg[t_key] if t_key else 1
    p = cfg[s_key]
    if isinstance(p, (tuple, list)):  # Wan: patch_size = (t, h, w)
        pt, ph, pw = p
    else:
        ph = pw = p
    _, _, t, h, w = x.shape
    return t // pt, h // ph, w // pw


def _flux_grid(model, call):
    ids = call["img_ids"]
    ids = ids[0] if ids.dim() == 3 else ids
    rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    return 1, rows, cols


def _flux_refuse(model, call):
    if call is None:
        return None
    ids = call["img_ids"]
    ids = ids[0] if ids.dim() == 3 else ids
    rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    if bool((ids[:, 0] != 0).any()) or rows * cols != ids.shape[0] or rows * cols != call["hidden_states"].shape[1]:
        return ("image tokens that are not one row-major grid (FLUX.1 Kontext reference images, custom img_ids); "
                "needs a shard table over several grids")
    for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
        if call.get(name) is not None:
            return f"ControlNet residuals ({name}); needs them sharded by the same token index"
    return None


def _qwen_grid(model, call):
    shapes = call["img_shapes"]
    return tuple(int(v) for v in shapes[0][0])


def _qwen_refuse(model, call):
    if getattr(model.config, "zero_cond_t", False) or getattr(model, "zero_cond_t", False):
        return "zero_cond_t (Qwen-Image-Edit 2511 style per-token modulation); needs modulate_index sharded"
    if call is None:
        return None
    shapes = call.get("img_shapes")
    if not shapes or any(len(s) != 1 or tuple(s[0]) != tuple(shapes[0][0]) for s in shapes):
        return "several image grids in one sequence (Qwen-Image-Edit reference images); needs a shard table over several grids"
    return None


def _wan_refuse(model, call):
    return None


def _hunyuan_refuse(model, call):
    if getattr(model.config, "image_condition_type", None) == "token_replace":
        return "image_condition_type='token_replace' (HunyuanVideo I2V): its first-frame tokens get another modulation; needs that split sharded"
    return None


def _ltx_grid(model, call):
    return int(call["num_frames"]), int(call["height"]), int(call["width"])


def _ltx_refuse(model, call):
    if call is not None and call.get("video_coords") is not None:
        return "explicit video_coords; needs the coordinates sharded by the same token index"
    return None


#: the families, by diffusers class name
DIT_FAMILIES: Dict[str, DiTFamily] = {
    f.cls: f
    for f in (
        DiTFamily(
            "flux",
            "FluxTransformer2DModel",
            {
                "x_embedder": ("shard", {"dim": 1}),
                "pos_embed": ("shard", {"dim": 0, "text": "before"}),  # (cos, sin) over [text; image] ids
                "transformer_blocks.*.attn": ("attention", {"text": "before"}),
                "single_transformer_blocks.*.attn": ("attention", {"text": "before"}),
                "proj_out": ("gather", {"dim": 1}),
            },
            _flux_grid,
            {},
            _flux_refuse,
        ),
        DiTFamily(
            "qwen-image",
            "QwenImageTransformer2DModel",
            {
                "img_in": ("shard", {"dim": 1}),
                "pos_embed": ("shard", {"dim": 0, "items": (0,)}),  # (image freqs, text freqs): image part only
                "transformer_blocks.*.attn": ("attention", {"text": "before"}),
                "proj_out": ("gather", {"dim": 1}),
            },
            _qwen_grid,
            {},
            _qwen_refuse,
        ),
        DiTFamily(
            "wan",
            "WanTransformer3DModel",
            {
                "rope": ("shard", {"dim": 1}),  # (cos, sin) [1, L, 1, D]
                "patch_embedding": ("shard_rows", {"row_dim": 3}),  # [B, C, T, H, W] before flattening
                "blocks.*.attn1": ("attention", {"text": None}),
                "proj_out": ("gather", {"dim": 1}),
            },
            lambda m, c: _patched_grid(m, c, None, "patch_size"),
            {"timestep": (2, 1)},  # Wan 2.2 TI2V: one timestep per token
            _wan_refuse,
        ),
        DiTFamily(
            "hunyuan-video",
            "HunyuanVideoTransformer3DModel",
            {
                "x_embedder": ("shard", {"dim": 1}),
                "rope": ("shard", {"dim": 0}),  # (cos, sin) [L, D]
                "transformer_blocks.*.attn": ("attention", {"text": "after"}),
                "single_transformer_blocks.*.attn": ("attention", {"text": "after"}),
                "proj_out": ("gather", {"dim": 1}),
            },
            lambda m, c: _patched_grid(m, c, "patch_size_t", "patch_size"),
            {},
            _hunyuan_refuse,
        ),
        DiTFamily(
            "ltx-video",
            "LTXVideoTransformer3DModel",
            {
                "proj_in": ("shard", {"dim": 1}),
                "rope": ("shard", {"dim": 1}),  # (cos, sin) [B, L, D]
                "transformer_blocks.*.attn1": ("attention", {"text": None}),
                "proj_out": ("gather", {"dim": 1}),
            },
            _ltx_grid,
            {"timestep": (2, 1)},  # per-token timesteps (conditioning frames)
            _ltx_refuse,
        ),
    )
}


def family_of(model: nn.Module) -> DiTFamily:
    """The family row of ``model``'s class (or of a base class).

    Raises:
        NotImplementedError: the class is not covered; names it, the covered classes and what would be needed.
    """
    for klass in type(model).__mro__:
        fam = DIT_FAMILIES.get(klass.__name__)
        if fam is not None:
            return fam
    covered = ", ".join(sorted(DIT_FAMILIES))
    raise NotImplementedError(
        f"sequence parallelism does not cover {type(model).__name__}; covered: {covered}. A new class needs a "
        f"family row in distributed/sampling/dit.py: where its image tokens are embedded (to cut the band), its "
        f"positional embedding module, its self/joint attention modules (text before or after the image tokens) and "
        f"its output projection"
    )


def dit_plan(family: DiTFamily, *, mode: str = "auto", kv: PeerExchange = EXACT, link: Optional[str] = None) -> Dict[str, Style]:
    """The family's plan (``glob -> Style``) with the attention mode and K/V strategy filled in."""
    plan: Dict[str, Style] = {}
    for glob, (kind, opts) in family.layers.items():
        if kind == "shard":
            plan[glob] = ShardTokens(**opts)
        elif kind == "shard_rows":
            plan[glob] = ShardGridRows(**opts)
        elif kind == "gather":
            plan[glob] = GatherTokens(**opts)
        elif kind == "attention":
            plan[glob] = SequenceAttentionStyle(mode=mode, kv=kv, link=link, **opts)
        else:  # backstop, not the guard: the table is ours
            raise ValueError(f"unknown layer kind {kind!r} in family {family.name}")
    return plan


def cp_plan_points(model: nn.Module) -> Dict[str, List[str]]:
    """diffusers' own ``_cp_plan`` of ``model`` read as data: ``{"split": [module paths], "gather": [paths]}``."""
    plan = getattr(type(model), "_cp_plan", None) or {}
    out = {"split": [], "gather": []}
    for path, spec in plan.items():
        if type(spec).__name__ == "ContextParallelOutput":
            out["gather"].append(path)
        else:
            out["split"].append(path)
    return out


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
        """Start logical step ``step`` of ``stream``; ``sync`` defaults to the config's schedule (warm-up, refresh)."""
        if sync is None:
            sync = self.config.is_sync_step(step) if self.config is not None else True
        self.state.select_stream(stream)
        self.state.begin_step(step, sync)

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


def _root_hook(model: nn.Module, family: DiTFamily, state: SequenceState) -> Applied:
    signature = inspect.signature(model.forward)

    def hook(mod, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        call = dict(bound.arguments)
        why = family.refuse(model, call)
        if why:
            raise NotImplementedError(f"{type(model).__name__}: sequence parallelism does not support {why}")
        state.set_grid(*family.grid(model, call))
        changed = False
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


def parallelize_dit(
    model: nn.Module,
    ctx: ParallelContext,
    *,
    mode: str = "auto",
    kv: PeerExchange = EXACT,
    link: Optional[str] = None,
    traffic: Optional[Traffic] = None,
    config: Optional[PatchConfig] = None,
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
    traffic = traffic if traffic is not None else Traffic()
    checkpoint = config.comm_checkpoint if config is not None else 60
    state = SequenceState(ctx, traffic, memory=lambda c, rows, t: CommManager(c, rows, t, checkpoint))
    applied: List[Applied] = []
    if ctx.world_size > 1:
        plan = dit_plan(family, mode=mode, kv=kv, link=link)
        _check_plan_matches(model, family, plan)
        applied = apply_plan([("", model)], plan, state, strict=False)
        try:
            applied.append(_root_hook(model, family, state))
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


def _check_plan_matches(model: nn.Module, family: DiTFamily, plan: Dict[str, Style]) -> None:
    """Every glob of the family must name at least one module (a renamed module would silently run unsharded)."""
    paths = [n for n, _ in model.named_modules() if n]
    for glob in plan:
        if not any(fnmatch.fnmatchcase(p, glob) for p in paths):
            raise NotImplementedError(
                f"{type(model).__name__}: no module matches {glob!r} of the {family.name} plan; this diffusers version "
                f"names its modules differently: update the family row in distributed/sampling/dit.py"
            )


# --------------------------------------------------------------------------------------------------
# the modelled cost of one sampling step (for the benchmark and the README; no model needed)


class DiTShape(NamedTuple):
    """What the traffic of a sequence-parallel DiT step depends on.

    Args:
        attention_layers: self/joint attention calls per forward (double + single stream blocks).
        heads, head_dim: of those attentions.
        frames, rows, cols: the token grid after patchify.
        text: replicated tokens in the joint sequences (0 when text enters by cross-attention only).
        out_features: features per token at the output projection (gathered once per forward).
    """

    attention_layers: int
    heads: int
    head_dim: int
    frames: int
    rows: int
    cols: int
    text: int
    out_features: int


#: the full-size architectures of the README's figures (the configs of the public checkpoints)
FULL_SIZE_SHAPES: Dict[str, DiTShape] = {
    # FLUX.1 dev/schnell: 19 double + 38 single blocks, 24 heads x 128; 1024x1024 -> latent 128x128 -> 64x64 tokens
    # (2x2 patches); 512 T5 tokens; proj_out 64 features per token
    "flux1_1024": DiTShape(57, 24, 128, 1, 64, 64, 512, 64),
    # Wan 2.1 14B: 40 blocks, 40 heads x 128; 480x832x81 -> latent 21x60x104 -> 21x30x52 tokens (1x2x2 patches);
    # text by cross-attention; proj_out 1*2*2*16 = 64 features
    "wan21_14b_480x832x81": DiTShape(40, 40, 128, 21, 30, 52, 0, 64),
    # Qwen-Image: 60 blocks, 24 heads x 128; 1328x1328 -> latent 166x166 -> 83x83 tokens; ~256 text tokens;
    # proj_out 2*2*16 = 64 features
    "qwen_image_1328": DiTShape(60, 24, 128, 1, 83, 83, 256, 64),
}


def step_cost(shape: DiTShape, world_size: int, mode: str = "auto", *, itemsize: int = 2, batch: int = 1,
              link: Optional[str] = None, kv: PeerExchange = EXACT) -> Dict[str, Any]:
    """Modelled traffic of one model evaluation (one step of one CFG branch) for one rank (the largest band).

    Args:
        shape: :class:`DiTShape` (see :data:`FULL_SIZE_SHAPES`).
        world_size: ranks of the sequence group.
        mode: ``gathered``, ``ulysses`` or ``auto`` (resolved by :func:`~..parallel.sequence.choose_mode` on
            ``link``).
        itemsize: bytes per element of the activations (2: bf16/fp16).
        kv: the K/V strategy; a :class:`~..parallel.exchange.CompressedExchange` counts its packed residuals
            (displaced and stale strategies move the exact bytes, asynchronously or on synchronous steps only).
        batch: latents per call (CFG batched in one call: 2).

    Returns:
        ``{"mode", "wire_bytes", "messages", "counted"}``: bytes the rank sends per step, collective calls, and
        the bytes comm's accounting would count per operation (``bench/linkmodel.wire_bytes`` turns those into
        ``wire_bytes`` again). Add :func:`~.split.split_cost` for CFG-/batch-parallel exchanges.
    """
    shards = TokenShards.split(shape.frames, shape.rows, shape.cols, world_size)
    if world_size == 1:
        return {"mode": "none", "wire_bytes": 0, "messages": 0, "counted": {}}
    resolved = SeqMode(mode)
    if resolved is SeqMode.AUTO:
        resolved = choose_mode(shards.counts, shape.heads, shape.head_dim, itemsize, batch=batch, replicated=shape.text,
                               kv=kv, link=link)
    one: AttentionCost = attention_cost(resolved, shards.counts, shape.heads, shape.head_dim, itemsize, batch=batch,
                                        replicated=shape.text)
    if isinstance(kv, CompressedExchange) and resolved is SeqMode.GATHERED:
        # each rank sends its packed residual codes of K and V (padded to the largest band) to N-1 peers
        piece = packed_bytes(2 * max(shards.counts) * batch * shape.heads * shape.head_dim, kv.bits)
        one = AttentionCost(piece * (world_size - 1), 1, {"all_gather": piece * (world_size + 1)})
    counted = {op: shape.attention_layers * b for op, b in one.counted.items()}
    out_piece = batch * max(shards.counts) * shape.out_features * itemsize
    counted["all_gather"] = counted.get("all_gather", 0) + out_piece * (world_size + 1)
    return {
        "mode": resolved.value,
        "wire_bytes": shape.attention_layers * one.wire_bytes + out_piece * (world_size - 1),
        "messages": shape.attention_layers * one.messages + 1,
        "counted": counted,
    }
