"""The family table of diffusers' DiT classes: one row (data) per transformer class, for sequence parallelism and
weight sharding alike.

A row's ``layers`` are the library's Styles (``parallel/seq_styles.py``), keyed by module glob: the plan itself,
with only the attention mode and K/V strategy filled in per run (:func:`dit_plan`). A row's ``blocks`` are the
modules weight sharding makes one unit each (``parallel/shard.py`` takes them as data: :data:`SHARD_FAMILIES`).
A host application's own classes have their own table in its bridge, made of the same Styles; this one knows no
host. A row says where the image tokens are cut to the rank's band (the patch embedding's output), where the text tokens
are cut to the rank's slice (the text stream's embedding, for joint-attention families), where the positional
embedding is (sliced by the same shard table), which attention modules are self/joint attention (and on which side
their text tokens sit), and where the image tokens are gathered back (the output projection, where a token is
narrowest). ``sampling/dit.py`` applies a row (:func:`dit_plan`) through ``parallel.plan.apply_plan``.

Text sharding (joint attention: FLUX.1, Qwen-Image, HunyuanVideo): ``text(model, call)`` returns the text length
of a call, why its text must stay whole on every rank (if it must), and which text tokens its padding mask keeps:
the root hands that validity to the state, and every joint attention lays it over all ranks' keys (a rank's own
mask covers its own text slice only). The text stream is discarded at the end by all three (only image
tokens reach ``proj_out``), so nothing of the text is ever gathered.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel.exchange import EXACT, PeerExchange
from ..parallel.plan import Style
from ..parallel.seq_modulation import ShareModulation
from ..parallel.sequence import GatherTokens, SequenceAttentionStyle, ShardGridRows, ShardTokens, shard_tokens
from ..parallel.shard import ShardFamily, shard_blocks_of

__all__ = ["DiTFamily", "DIT_FAMILIES", "family_of", "dit_plan", "attention_globs", "cp_plan_points", "check_plan_matches",
           "SHARD_FAMILIES", "UNET_BLOCKS", "shard_blocks_for"]


class DiTFamily(NamedTuple):
    """One diffusers DiT class and how it is sequence-parallelized.

    Args:
        name: short family name (README, errors).
        cls: the diffusers class name.
        layers: ``glob -> Style``: :class:`ShardTokens` (a token or text stream, a positional embedding),
            :class:`ShardGridRows` (a patch embedding's grid before it is flattened), :class:`SequenceAttentionStyle`
            (its ``text`` side; the mode and K/V strategy are filled in by :func:`dit_plan`), :class:`GatherTokens`,
            :class:`~..parallel.seq_modulation.ShareModulation` (the blocks' adaLN ``Linear`` layers, which all read
            the one per-call embedding: computed once across the ranks).
        grid: ``grid(model, call)`` -> ``(frames, rows, cols)`` token grid, from the bound forward arguments.
        per_token: root arguments that carry one value per image token when they have ``ndim`` dims:
            ``name -> (ndim, dim)``; they are sharded like the tokens.
        refuse: ``refuse(model, call)`` -> a reason (str) or ``None``; ``call`` is ``None`` at apply time.
        text: ``text(model, call)`` -> ``(text tokens, why they stay replicated or None, valid)`` for a
            joint-attention family (``valid``: ``[B, T]`` bool of the text tokens a padding mask keeps, ``None``:
            all); ``None``: no text in the self-attention (cross-attention families).
        text_side: where the text sits in the joint sequence (``"before"``/``"after"``).
        empty_text_ok: a rank may hold no text token (``T < N``); when False such a call keeps the text whole.
        prepare: ``prepare(call, shards, rank)`` -> the call's arguments as the model needs them with sharded text
            (Qwen-Image's mask dropped or cut to the rank's slice), or ``None``.
        blocks: ``fnmatch`` globs of the modules that are one weight-sharding unit each, in forward order
            (``parallel/shard.py``; the shallowest match is a unit).
    """

    name: str
    cls: str
    layers: Dict[str, Style]
    grid: Callable[[nn.Module, Dict[str, Any]], Tuple[int, int, int]]
    per_token: Dict[str, Tuple[int, int]]
    refuse: Callable[[nn.Module, Optional[Dict[str, Any]]], Optional[str]]
    text: Optional[Callable[[nn.Module, Dict[str, Any]], Tuple[int, Optional[str]]]] = None
    text_side: str = "before"
    empty_text_ok: bool = True
    prepare: Optional[Callable[[Dict[str, Any]], Optional[Dict[str, Any]]]] = None
    blocks: Tuple[str, ...] = ()


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


def _text_of(key: str, mask_key: Optional[str], prefix: bool = False):
    """``text(model, call)`` for a family whose text stream is the ``key`` argument ``[B, T, C]`` and whose text
    padding mask (if any) is ``mask_key``: returns ``(T, None, valid)``, ``valid`` the ``[B, T]`` bool of the text
    tokens that are attended to (``None``: all). ``prefix``: the model reads the mask as a length (HunyuanVideo masks
    the positions from ``mask.sum()`` on), otherwise position by position (Qwen-Image)."""

    def text(model, call):
        t = call.get(key)
        if t is None:
            return 0, "no text stream in the call", None
        mask = call.get(mask_key) if mask_key else None
        if mask is None or bool(mask.bool().all()):
            return int(t.shape[1]), None, None
        if prefix:
            n = mask.sum(dim=1, dtype=torch.int)
            valid = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) < n.unsqueeze(1)
        else:
            valid = mask.bool()
        return int(t.shape[1]), None, valid

    return text


def _qwen_prepare(call, shards, rank):
    """Qwen-Image checks its mask against the (now sharded) text stream and builds each block's joint mask from it:
    an all-true mask is dropped (it masks nothing), a padding mask is cut to this rank's text slice (the attention
    then lays the whole text's validity over every rank's keys: ``SequenceState.text_valid``)."""
    mask = call.get("encoder_hidden_states_mask")
    if mask is None:
        return None
    if bool(mask.bool().all()):
        return dict(call, encoder_hidden_states_mask=None)
    return dict(call, encoder_hidden_states_mask=shard_tokens(mask, shards, rank, dim=1, part="text"))


#: the families, by diffusers class name
DIT_FAMILIES: Dict[str, DiTFamily] = {
    f.cls: f
    for f in (
        DiTFamily(
            "flux",
            "FluxTransformer2DModel",
            {
                "x_embedder": ShardTokens(dim=1),
                "context_embedder": ShardTokens(dim=1, part="text"),  # the text stream [B, T, D]
                "pos_embed": ShardTokens(dim=0, text="before"),  # (cos, sin) over [text; image] ids
                "transformer_blocks.*.attn": SequenceAttentionStyle(text="before"),
                "single_transformer_blocks.*.attn": SequenceAttentionStyle(text="before"),
                "transformer_blocks.*.norm1.linear": ShareModulation(),
                "transformer_blocks.*.norm1_context.linear": ShareModulation(),
                "single_transformer_blocks.*.norm.linear": ShareModulation(),
                "proj_out": GatherTokens(dim=1),
            },
            _flux_grid,
            {},
            _flux_refuse,
            text=_text_of("encoder_hidden_states", None),
            blocks=("transformer_blocks.*", "single_transformer_blocks.*"),
        ),
        DiTFamily(
            "qwen-image",
            "QwenImageTransformer2DModel",
            {
                "img_in": ShardTokens(dim=1),
                "txt_in": ShardTokens(dim=1, part="text"),  # the text stream after its norm and projection
                # (image freqs, text freqs); the text freqs are made for the whole text, then cut to the slice
                "pos_embed": ShardTokens(dim=0, items=(0,), text_items=(1,), text_length_arg="max_txt_seq_len"),
                "transformer_blocks.*.attn": SequenceAttentionStyle(text="before"),
                "transformer_blocks.*.img_mod.1": ShareModulation(),
                "transformer_blocks.*.txt_mod.1": ShareModulation(),
                "proj_out": GatherTokens(dim=1),
            },
            _qwen_grid,
            {},
            _qwen_refuse,
            text=_text_of("encoder_hidden_states", "encoder_hidden_states_mask"),
            # its text RoPE reshapes the text query with a -1 dimension: undefined for an empty slice
            empty_text_ok=False,
            prepare=_qwen_prepare,
            blocks=("transformer_blocks.*",),
        ),
        DiTFamily(
            "wan",
            "WanTransformer3DModel",
            {
                "rope": ShardTokens(dim=1),  # (cos, sin) [1, L, 1, D]
                "patch_embedding": ShardGridRows(row_dim=3),  # [B, C, T, H, W] before flattening
                "blocks.*.attn1": SequenceAttentionStyle(text=None),
                "proj_out": GatherTokens(dim=1),
            },
            lambda m, c: _patched_grid(m, c, None, "patch_size"),
            {"timestep": (2, 1)},  # Wan 2.2 TI2V: one timestep per token
            _wan_refuse,
            blocks=("blocks.*",),
        ),
        DiTFamily(
            "hunyuan-video",
            "HunyuanVideoTransformer3DModel",
            {
                "x_embedder": ShardTokens(dim=1),
                # the text stream after the token refiner (self-attention over the text alone, run whole)
                "context_embedder": ShardTokens(dim=1, part="text"),
                "rope": ShardTokens(dim=0),  # (cos, sin) [L, D] over the image tokens only
                "transformer_blocks.*.attn": SequenceAttentionStyle(text="after"),
                "single_transformer_blocks.*.attn": SequenceAttentionStyle(text="after"),
                "transformer_blocks.*.norm1.linear": ShareModulation(),
                "transformer_blocks.*.norm1_context.linear": ShareModulation(),
                "single_transformer_blocks.*.norm.linear": ShareModulation(),
                "proj_out": GatherTokens(dim=1),
            },
            lambda m, c: _patched_grid(m, c, "patch_size_t", "patch_size"),
            {},
            _hunyuan_refuse,
            # the token refiner reads the whole mask; the joint attentions' local masks are replaced by the library
            text=_text_of("encoder_hidden_states", "encoder_attention_mask", prefix=True),
            text_side="after",
            # its blocks split [image, text] with ``x[:, :-text_len]``: an empty slice would take every token
            empty_text_ok=False,
            blocks=("context_embedder.token_refiner.refiner_blocks.*", "transformer_blocks.*", "single_transformer_blocks.*"),
        ),
        DiTFamily(
            "ltx-video",
            "LTXVideoTransformer3DModel",
            {
                "proj_in": ShardTokens(dim=1),
                "rope": ShardTokens(dim=1),  # (cos, sin) [B, L, D]
                "transformer_blocks.*.attn1": SequenceAttentionStyle(text=None),
                "proj_out": GatherTokens(dim=1),
            },
            _ltx_grid,
            {"timestep": (2, 1)},  # per-token timesteps (conditioning frames)
            _ltx_refuse,
            blocks=("transformer_blocks.*",),
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
        f"family row in distributed/sampling/dit_families.py: where its image tokens are embedded (to cut the band), its "
        f"positional embedding module, its self/joint attention modules (text before or after the image tokens) and "
        f"its output projection"
    )


def dit_plan(family: DiTFamily, *, mode: str = "auto", kv: PeerExchange = EXACT, link: Optional[str] = None,
             modulation: bool = True) -> Dict[str, Style]:
    """The family's plan (``glob -> Style``) with the attention mode and K/V strategy filled in (``modulation``
    False: the modulation layers are left out, every rank computes them whole)."""
    plan: Dict[str, Style] = {}
    for glob, style in family.layers.items():
        if isinstance(style, ShareModulation) and not modulation:
            continue
        if isinstance(style, SequenceAttentionStyle):
            style = dataclasses.replace(style, mode=mode, kv=kv, link=link)
        plan[glob] = style
    return plan


def attention_globs(family: DiTFamily) -> List[str]:
    """The globs of the family's self/joint attention modules."""
    return [g for g, style in family.layers.items() if isinstance(style, SequenceAttentionStyle)]


#: diffusers' SD UNet: weight sharding only (one unit per UNet block); its sequence parallelism is the row bands of
#: ``sampling/sdxl.py``, not a token layout
UNET_BLOCKS = ShardFamily("sd-unet", ("UNet2DConditionModel",), ("down_blocks.*", "mid_block", "up_blocks.*"))

#: the weight-sharding rows of the diffusers classes: every family's ``blocks``, and the SD UNet's
SHARD_FAMILIES: Tuple[ShardFamily, ...] = tuple(
    ShardFamily(f.name, (f.cls,), f.blocks) for f in DIT_FAMILIES.values() if f.blocks) + (UNET_BLOCKS,)


def shard_blocks_for(model: nn.Module) -> Tuple[str, ...]:
    """The weight-sharding block globs of diffusers model ``model`` (:data:`SHARD_FAMILIES`), for
    ``parallel.shard.shard_model``; ``NotImplementedError`` naming the class when no row has it."""
    return shard_blocks_of(model, SHARD_FAMILIES)


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



def check_plan_matches(model: nn.Module, family: DiTFamily, plan: Dict[str, Style]) -> None:
    """Every glob of the family must name at least one module (a renamed module would silently run unsharded)."""
    paths = [n for n, _ in model.named_modules() if n]
    for glob in plan:
        if not any(fnmatch.fnmatchcase(p, glob) for p in paths):
            raise NotImplementedError(
                f"{type(model).__name__}: no module matches {glob!r} of the {family.name} plan; this diffusers version "
                f"names its modules differently: update the family row in distributed/sampling/dit_families.py"
            )

