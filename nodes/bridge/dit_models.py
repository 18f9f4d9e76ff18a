"""ComfyUI's DiT classes for sequence parallelism: one table, one row per family, keyed by ComfyUI's class name.

Sequence (token) parallelism gives each rank a band of latent rows (all frames) as tokens; everything in a DiT
block is token-local except attention, so the model is exact when (a) each rank keeps only its tokens from where
they are made, (b) its positional embedding (RoPE) is the one of its own positions, (c) every self/joint attention
sees the keys and values of all tokens, cross-attention (to text or CLIP tokens every rank holds whole) runs
locally, and (d) the tokens are put back in order before the model unpatchifies them. A row says, for one family,
where each of those four places is in ComfyUI's module tree — as data (module paths and class names, resolved on
the ranks); the rank side (:mod:`.dit_rank`) applies it through hooks and ComfyUI's
``transformer_options["optimized_attention_override"]``, without editing the model.

Adding a family is one row (plus, at most, a grid function and a per-call check). A class without a row is refused
by name, before anything is shipped, with what a row would need; the CFG- and batch-parallel modes do not look
inside the model and serve every class.

This module imports no ComfyUI: the table, the lookup and the refusals are tested in CI.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

__all__ = ["Site", "DitRow", "ROWS", "KNOWN_UNCOVERED", "find_row", "refusal", "token_grid", "call_refusal", "cond_refusal",
           "text_tokens"]

# where the replicated (text) tokens sit in a joint attention's sequence
PREFIX, SUFFIX, NONE = "prefix", "suffix", "none"


class Site(NamedTuple):
    """A tensor in the module tree: ``module`` path, ``"input"`` (positional argument ``arg``) or ``"output"``."""

    module: str
    where: str = "output"
    arg: int = 0


class DitRow(NamedTuple):
    """One DiT family as ComfyUI 0.3.64 builds it.

    Args:
        family: the name users know (in messages and the README's model table).
        classes: ComfyUI diffusion-model class names (``type(model.diffusion_model).__name__``) this row serves.
        patch: ``fn(dm) -> (pt, ph, pw)``: the patch size the model pads the latent to and folds into one token.
        tokens: where the image tokens ``[B, L, D]`` first exist (after patchify and embedding): sharded there.
        rope: where the rotary table ``[B, 1, L_total, ...]`` is made (sliced on dim 2 to this rank's positions);
            ``None`` when no module makes it (LTX-Video computes it in a function): then ``hooks`` cuts it.
        gather: where the last per-token tensor ``[B, L_local, C]`` comes out: gathered back to all tokens in order.
        attends: module class name -> ``"self"`` (image tokens only), ``"joint"`` (image and text tokens in one
            sequence) or ``"cross"`` (keys/values from text or CLIP tokens, whole on every rank: runs locally).
            Every attention call must happen inside one of these modules (the rank side refuses others).
        text: where the text tokens sit in a joint sequence (``"prefix"``, ``"suffix"``, ``"none"``).
        heads: attribute of the diffusion model holding the number of attention heads.
        call_refusals: keyword of the model call -> why the row cannot shard a call that carries it (not ``None``).
        cond_refusals: CONDITIONING key -> the same reason, checked on the driver before anything is shipped.
        hooks: ``fn(seq) -> [handles]`` for what the sites cannot say (per-token timesteps, a RoPE passed as a block
            argument, attentions told apart by module path): installed with the sites on the rank
            (``seq`` is the rank's :class:`~.dit_rank.DitSequence`); each handle has ``remove()``.
        text_tokens: where the text stream ``[B, T, D]`` of a joint-attention family is ready (after any text-only
            processing, e.g. HunyuanVideo's token refiner): cut there to this rank's slice of the text, so the text
            stream's per-token work is split too (``None``: no text in the self-attention, or kept whole).
        text_whole: keyword of the model call -> why a call carrying it keeps its text whole on every rank (exact,
            the text is just not split): a text mask the model lays over the whole text, extra text tokens joined
            after the text site.
        modulation: globs of the blocks' adaLN modulation ``Linear`` layers, which all read the one per-call
            embedding: each rank computes ``1/N`` of their outputs, one all-gather per call
            (``distributed/parallel/seq_modulation.py``); ``()``: none.
    """

    family: str
    classes: Tuple[str, ...]
    patch: Callable[[Any], Tuple[int, int, int]]
    tokens: Site
    rope: Optional[Site]
    gather: Site
    attends: Mapping[str, str]
    text: str
    heads: str = "num_heads"
    call_refusals: Mapping[str, str] = {}
    cond_refusals: Mapping[str, str] = {}
    hooks: Optional[Callable[[Any], list]] = None
    text_tokens: Optional[Site] = None
    text_whole: Mapping[str, str] = {}
    modulation: Tuple[str, ...] = ()


def _flux_patch(dm) -> Tuple[int, int, int]:
    return (1, int(dm.patch_size), int(dm.patch_size))


def _wan_patch(dm) -> Tuple[int, int, int]:
    pt, ph, pw = (int(p) for p in dm.patch_size)
    return (pt, ph, pw)


_FLUX_REFUSALS = {
    "ref_latents": "reference latents (FLUX Kontext): their tokens join the image sequence and would need a band of their own",
    "attention_mask": "an attention mask (it indexes the whole joint sequence; the ranks hold bands of it)",
    "control": "ControlNet residuals (full-sequence tensors added inside the blocks)",
}
_FLUX_COND = {
    "reference_latents": _FLUX_REFUSALS["ref_latents"],
    "attention_mask": _FLUX_REFUSALS["attention_mask"],
}

#: FLUX.1's (and HunyuanVideo's) per-block modulation layers: image and text of each double-stream block, one per
#: single-stream block
_FLUX_MODULATION = ("double_blocks.*.img_mod.lin", "double_blocks.*.txt_mod.lin", "single_blocks.*.modulation.lin")

# FLUX.1 and Chroma share ComfyUI's double/single-stream blocks, embedders and final layer: one row, two names
_FLUX_ROW = DitRow(
    family="FLUX.1 (dev, schnell)",
    classes=("Flux",),
    patch=_flux_patch,
    tokens=Site("img_in"),
    rope=Site("pe_embedder"),
    gather=Site("final_layer"),
    attends={"DoubleStreamBlock": "joint", "SingleStreamBlock": "joint"},
    text=PREFIX,
    call_refusals=_FLUX_REFUSALS,
    cond_refusals=_FLUX_COND,
    text_tokens=Site("txt_in"),
    modulation=_FLUX_MODULATION,
)

ROWS: Tuple[DitRow, ...] = (
    _FLUX_ROW,
    # Chroma's blocks take precomputed modulations (its approximator), no per-block layer
    _FLUX_ROW._replace(family="Chroma", classes=("Chroma",), modulation=()),
    DitRow(
        family="Wan 2.1 / 2.2 (14B, 1.3B, 5B; text-to-video, image-to-video)",
        classes=("WanModel",),
        patch=_wan_patch,
        # the patch embedding is a strided Conv3d whose output is flattened in the model's forward: the tokens first
        # exist as the first block's input
        tokens=Site("blocks.0", "input", 0),
        rope=Site("rope_embedder"),
        gather=Site("head"),
        attends={"WanSelfAttention": "self", "WanT2VCrossAttention": "cross", "WanI2VCrossAttention": "cross"},
        text=NONE,
        call_refusals={
            "reference_latent": "a reference latent (Wan Fun reference): its tokens are prepended to the video's",
            "control": "ControlNet residuals",
        },
        cond_refusals={"reference_latents": "a reference latent (Wan Fun reference): its tokens are prepended to the video's"},
    ),
)

# classes people load that PatchRay knows and does not shard yet: what a row would need
KNOWN_UNCOVERED: Dict[str, str] = {
    "VaceWanModel": "Wan VACE: its vace_blocks add hints computed from a second token stream (the VACE context), which "
    "would need the same bands and a gather of its own",
    "CameraWanModel": "Wan Fun Camera: a camera adapter adds a full-grid tensor to the tokens",
    "WanModel_S2V": "Wan 2.2 S2V: audio and motion tokens join the video sequence",
    "HumoWanModel": "Wan HuMo: audio tokens and their own attention",
    "AnimateWanModel": "Wan 2.2 Animate: face and pose adapters over the whole grid",
    "ChromaRadiance": "Chroma Radiance: pixel-space NeRF blocks after the transformer",
    "QwenImageTransformer2DModel": "Qwen-Image: a row naming its token, RoPE and final-layer sites",
    "HunyuanVideo": "HunyuanVideo: a row naming its token, RoPE and final-layer sites (text tokens follow the image's)",
    "LTXVModel": "LTX-Video: a row naming its token and positional-embedding sites",
    "UNetModel": "a UNet: sequence parallelism is for DiTs; UNets are sharded by row bands of their convolutions",
}


def find_row(class_name: str) -> Optional[DitRow]:
    """The row serving ComfyUI diffusion-model class ``class_name``, or ``None``."""
    for row in ROWS:
        if class_name in row.classes:
            return row
    return None


def refusal(class_name: str, module: str = "", family: str = "") -> str:
    """Why a class without a row cannot be sharded by sequence, in the user's terms, with what would be needed.
    ``family``: ComfyUI's name of the model (``SD3``, ``PixArtSigma``...), said first when it differs from the class."""
    where = f" ({module})" if module else ""
    owner = f"{family}'s diffusion model " if family and family != class_name else "the diffusion model "
    known = KNOWN_UNCOVERED.get(class_name)
    need = known or (
        "a row in PatchRay's DiT table naming where its image tokens are made, where its positional embedding is, "
        "where the tokens leave the last block, and which of its attentions are self/joint or cross"
    )
    return (
        f"PatchRay: sequence parallelism does not cover {owner}{class_name}{where} "
        f"yet ({need}). parallelism=cfg or batch work with every model; the stock KSampler always does."
    )


def token_grid(row: DitRow, dm, latent_shape: Sequence[int]) -> Tuple[int, int, int]:
    """(frames, rows, cols) of image tokens for a latent ``[B, C, H, W]`` or ``[B, C, T, H, W]`` (padded to the patch,
    as the models pad before patchifying)."""
    pt, ph, pw = row.patch(dm)
    if len(latent_shape) == 4:
        t, (h, w) = 1, latent_shape[-2:]
    elif len(latent_shape) == 5:
        t, h, w = latent_shape[-3:]
    else:
        raise ValueError(f"latent_image: expected [B, C, H, W] or [B, C, T, H, W], got shape {tuple(latent_shape)}")
    return (math.ceil(t / pt), math.ceil(h / ph), math.ceil(w / pw))


def call_refusal(row: DitRow, arguments: Mapping[str, Any]) -> Optional[str]:
    """The reason a model call's arguments cannot be sharded by ``row`` (``None``: they can)."""
    extra = dict(arguments)
    extra.update(arguments.get("kwargs") or {})
    for key, why in row.call_refusals.items():
        if extra.get(key) is not None:
            return f"PatchRay ({row.family}, sequence): {why} is not supported yet; use parallelism=cfg or batch, or sample without PatchRay"
    return None


def text_tokens(row: DitRow, arguments: Mapping[str, Any], world_size: int) -> int:
    """The text tokens a model call shards over ``world_size`` sequence ranks (0: the text stays whole on every rank:
    a row without a text site, a call carrying one of the row's ``text_whole`` keywords, or fewer text tokens than
    ranks, where a rank's empty text slice would break the blocks' reshapes). Read from the call's ``context``
    ``[B, T, C]``, the same on every rank."""
    if row.text_tokens is None or world_size < 2:
        return 0
    extra = dict(arguments)
    extra.update(arguments.get("kwargs") or {})
    if any(extra.get(key) is not None for key in row.text_whole):
        return 0
    context = extra.get("context")
    if context is None or getattr(context, "dim", lambda: 0)() != 3:
        return 0
    total = int(context.shape[1])
    return total if total >= world_size else 0


def cond_refusal(row: DitRow, name: str, conditioning) -> Optional[str]:
    """The reason CONDITIONING ``name`` cannot be sharded by ``row`` (``None``: it can)."""
    for item in conditioning or []:
        extra = item[1] if isinstance(item, (list, tuple)) and len(item) > 1 and isinstance(item[1], dict) else {}
        for key, why in row.cond_refusals.items():
            if extra.get(key) is not None:
                return f"PatchRay ({row.family}, sequence): {why} in {name} is not supported yet; use parallelism=cfg or batch, or sample without PatchRay"
    return None


# Qwen-Image, HunyuanVideo / HunyuanImage 2.1, LTX-Video: rows of their own module (no import cycle: built on call)
from .dit_models_more import more_rows as _more_rows  # noqa: E402

ROWS = ROWS + _more_rows()
for _row in ROWS:
    for _cls in _row.classes:
        KNOWN_UNCOVERED.pop(_cls, None)
