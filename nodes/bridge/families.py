"""ComfyUI's diffusion-model classes: one table, one row per family, keyed by ComfyUI's class name.

Every per-class fact PatchRay acts on is a field of a row here, and nowhere else: how the latent becomes tokens, where
the text or reference tokens sit, where the positional embedding (RoPE) is made and where the tokens are gathered back
(sequence parallelism), which modules are the blocks (weight sharding), which call inputs it refuses and why, and the
extra token streams the class carries (VACE hints, audio and motion tokens, camera adapters). The lookups read it:
:mod:`.dit_models` (sequence), :mod:`.shard_models` (weight sharding), the node descriptions and the runtime check.
The diffusers counterparts have their own table in the library (``distributed/sampling/dit_families.py``), which
knows no ComfyUI; both are made of the library's Styles (``distributed/parallel/seq_styles.py``): a row's sites are
turned into Styles in one function (:func:`sequence_plan`), never by branching on strings.

Sequence (token) parallelism gives each rank a band of latent rows (all frames) as tokens; everything in a DiT
block is token-local except attention, so the model is exact when (a) each rank keeps only its tokens from where
they are made, (b) its positional embedding is the one of its own positions, (c) every self/joint attention sees
the keys and values of all tokens, cross-attention (to text or CLIP tokens every rank holds whole) runs locally, and
(d) the tokens are put back in order before the model unpatchifies them. A row says where each of those four places
is in ComfyUI's module tree, as data (module paths and class names, resolved on the ranks); the rank side
(:mod:`.dit_rank`) applies it through the Styles, module hooks and ComfyUI's
``transformer_options["optimized_attention_override"]``, without editing the model.

Adding a family is one row here, plus a hook in :mod:`.dit_hooks` only if its layout is new
(``docs/adding-a-model.md`` walks through one). A class without a sequence layout is refused by name, before
anything is shipped, with its row's ``refusal`` (or, for a class without a row, what a row would need); the CFG- and
batch-parallel modes do not look inside the model and serve every class.

This module imports no ComfyUI: the table, its lookups and the refusals are tested in CI
(``tests/nodes/test_families.py`` resolves every row's sites on a class built without ComfyUI).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

from .dit_hooks import hunyuan_hooks, lumina_hooks, ltxv_hooks, wan_vace_hooks

__all__ = ["Attends", "Text", "PREFIX", "SUFFIX", "NONE", "Site", "ModelFamily", "FAMILIES", "family_for",
           "sequence_plan", "sites_of"]


class Attends(str, enum.Enum):
    """What an attention module sees: the rank side routes each kind to the library's sequence attention."""

    SELF = "self"  # image tokens only: all ranks' keys and values
    JOINT = "joint"  # image and text tokens in one sequence: all ranks' keys and values
    CROSS = "cross"  # keys and values from text or CLIP tokens every rank holds whole: runs locally


class Text(str, enum.Enum):
    """Where the text tokens sit in a joint-attention sequence."""

    PREFIX = "prefix"
    SUFFIX = "suffix"
    NONE = "none"

    @property
    def side(self) -> Optional[str]:
        """The library's name for it (``ShardTokens(text=...)``): ``"before"``, ``"after"`` or ``None``."""
        return {"prefix": "before", "suffix": "after"}.get(self.value)


PREFIX, SUFFIX, NONE = Text.PREFIX, Text.SUFFIX, Text.NONE


class Site(NamedTuple):
    """A tensor in the module tree: ``module`` path, ``"input"`` (positional argument ``arg``) or ``"output"``."""

    module: str
    where: str = "output"
    arg: int = 0


class ModelFamily(NamedTuple):
    """One family of ComfyUI 0.3.64 diffusion-model classes: what every parallel mode needs to know of it.

    Args:
        family: the name users know (in messages and the README's model table).
        classes: ComfyUI diffusion-model class names (``type(model.diffusion_model).__name__``) this row serves.
        counterpart: the diffusers class of the same architecture (its row in the library's table,
            ``distributed/sampling/dit_families.py``): CI checks the two rows agree (modes, text side) and resolves
            the library's row on it; ``""``: none.
        blocks: ``fnmatch`` globs of the modules that are one weight-sharding unit each (FSDP2), in forward order;
            ``()``: the class cannot be sharded by blocks.
        refusal: for a class without a sequence layout (``tokens`` is ``None``, ``row_bands`` False): why, in the
            user's terms (the message adds the modes that work).
        streams: extra inputs of the model call beyond the latent and the text (keyword -> what they are and how the
            row treats them: sharded with the video tokens, kept whole, or refused by ``call_refusals``).
        row_bands: sequence parallelism by row bands of the convolutions (ComfyUI's UNet: PatchRay's patch-parallel
            presets) instead of token shards.
        patch: ``fn(dm) -> (pt, ph, pw)``: the patch size the model pads the latent to and folds into one token.
        tokens: where the image tokens ``[B, L, D]`` first exist (after patchify and embedding): sharded there;
            ``None``: no sequence layout.
        rope: where the rotary table ``[B, 1, L_total, ...]`` is made (sliced on dim 2 to this rank's positions);
            ``None`` when no module makes it (LTX-Video computes it in a function): then ``hooks`` cuts it.
        gather: where the last per-token tensor ``[B, L_local, C]`` comes out: gathered back to all tokens in order.
        attends: module class name -> :class:`Attends`. Every attention call must happen inside one of these modules
            (the rank side refuses others).
        text: where the text tokens sit in a joint sequence (:class:`Text`).
        heads: attribute path of the diffusion model holding the number of attention heads.
        call_refusals: keyword of the model call -> why the row cannot shard a call that carries it (not ``None``).
        cond_refusals: CONDITIONING key -> the same reason, checked on the driver before anything is shipped.
        hooks: ``fn(seq) -> [handles]`` for what the sites cannot say (per-token timesteps, a RoPE passed as a block
            argument, attentions told apart by module path, a second token stream): :mod:`.dit_hooks`, installed with
            the sites on the rank (``seq`` is the rank's :class:`~.dit_rank.DitSequence`); each handle has ``remove()``.
        text_tokens: where the text stream ``[B, T, D]`` of a joint-attention family is ready (after any text-only
            processing, e.g. HunyuanVideo's token refiner): cut there to this rank's slice of the text, so the text
            stream's per-token work is split too (``None``: no text in the self-attention, or kept whole).
        text_whole: keyword of the model call -> why a call carrying it keeps its text whole on every rank (exact,
            the text is just not split): a text mask the model lays over the whole text, extra text tokens joined
            after the text site.
        modulation: globs of the blocks' adaLN modulation ``Linear`` layers, which all read the one per-call
            embedding: each rank computes ``1/N`` of their outputs, one all-gather per call
            (``distributed/parallel/seq_modulation.py``); ``()``: none.
        grid_conds: CONDITIONING keys whose tensors lie on the latent's grid (``[..., H, W]``, a stream's frames and
            masks): the runtime exactness check crops them with the latent (``ksampler_rank.verify_sequence``).
        entry: the ComfyUI wrapper point (``comfy.patcher_extension.WrappersMP``) the rank's sequence wrapper sits
            on: ``DIFFUSION_MODEL`` (around the class's ``_forward``), or ``APPLY_MODEL`` (around
            ``BaseModel.apply_model``) for a class whose forward calls no DIFFUSION_MODEL wrapper (SD3's MMDiT).
    """

    family: str
    classes: Tuple[str, ...]
    counterpart: str = ""
    blocks: Tuple[str, ...] = ()
    refusal: str = ""
    streams: Mapping[str, str] = {}
    row_bands: bool = False
    patch: Optional[Callable[[Any], Tuple[int, int, int]]] = None
    tokens: Optional[Site] = None
    rope: Optional[Site] = None
    gather: Optional[Site] = None
    attends: Mapping[str, Attends] = {}
    text: Text = Text.NONE
    heads: str = "num_heads"
    call_refusals: Mapping[str, str] = {}
    cond_refusals: Mapping[str, str] = {}
    hooks: Optional[Callable[[Any], list]] = None
    text_tokens: Optional[Site] = None
    text_whole: Mapping[str, str] = {}
    modulation: Tuple[str, ...] = ()
    grid_conds: Tuple[str, ...] = ()
    entry: str = "DIFFUSION_MODEL"

    @property
    def sequence(self) -> bool:
        """Whether the row has a token layout (sequence parallelism by token shards)."""
        return self.tokens is not None


def sites_of(row: ModelFamily) -> Tuple[Site, ...]:
    """The row's sites that must name a module of the class (tokens, RoPE, gather, text)."""
    return tuple(s for s in (row.tokens, row.rope, row.gather, row.text_tokens) if s is not None)


def sequence_plan(row: ModelFamily, linear_rows: Optional[Callable] = None) -> Dict[str, Any]:
    """The row's sites as the library's plan (``module path or glob -> Style``), applied by ``parallel.plan.apply_plan``
    on the rank. A token site on a module's input (``Site(where="input")``) is not a module output and is cut by the
    rank's pre-hook instead; the attentions are routed by :class:`Attends` scope, not by a Style.

    Args:
        row: a row with a sequence layout.
        linear_rows: how the host's linear layers give rows of their weight (``seq_modulation.RowsFn``) for the
            shared modulation; ``None``: torch's own ``Linear`` only.
    """
    from ...distributed.parallel.seq_modulation import ShareModulation
    from ...distributed.parallel.seq_styles import GatherTokens, ShardTokens

    if not row.sequence:  # backstop, not the guard: the driver refuses a row without a layout
        raise ValueError(f"{row.family}: no sequence layout")
    plan: Dict[str, Any] = {row.gather.module: GatherTokens(dim=1, text=row.text.side)}
    if row.rope is not None:
        plan[row.rope.module] = ShardTokens(dim=2, text=row.text.side)
    if row.tokens.where == "output":
        plan[row.tokens.module] = ShardTokens(dim=1)
    if row.text_tokens is not None:
        plan[row.text_tokens.module] = ShardTokens(dim=1, part="text")  # left whole unless the table shards text
    for glob in row.modulation:
        plan[glob] = ShareModulation(rows=linear_rows)
    return plan


# --------------------------------------------------------------------------------------------------- patch sizes


def _square_patch(dm) -> Tuple[int, int, int]:
    p = int(dm.patch_size)
    return (1, p, p)


def _wan_patch(dm) -> Tuple[int, int, int]:
    pt, ph, pw = (int(p) for p in dm.patch_size)
    return (pt, ph, pw)


def _hunyuan_patch(dm) -> Tuple[int, int, int]:
    p = [int(v) for v in dm.patch_size]
    if len(p) == 2:  # HunyuanImage 2.1: image latents [B, C, H, W]
        return (1, p[0], p[1])
    return (p[0], p[1], p[2])


def _ltxv_patch(dm) -> Tuple[int, int, int]:
    pt, ph, pw = (int(v) for v in dm.patchifier.patch_size)
    return (pt, ph, pw)


# --------------------------------------------------------------------------------------------------- rows

_CONTROL = "ControlNet residuals (full-sequence tensors added inside the blocks)"
_FLUX_REF = "reference latents (FLUX Kontext): their tokens join the image sequence and would need a band of their own"
_FLUX_MASK = "an attention mask (it indexes the whole joint sequence; the ranks hold bands of it)"
_WAN_REF = "a reference latent (Wan Fun reference): its tokens are prepended to the video's"
_QWEN_REF = "reference latents (Qwen-Image Edit): their tokens join the image sequence and would need a band of their own"
_HY_REF = "a reference latent (HunyuanVideo custom / HunyuanImage refiner reference): its tokens are prepended to the video's"

_FLUX_BLOCKS = ("double_blocks.*", "single_blocks.*")
#: FLUX.1's (and HunyuanVideo's) per-block modulation layers: image and text of each double-stream block, one per
#: single-stream block
_FLUX_MODULATION = ("double_blocks.*.img_mod.lin", "double_blocks.*.txt_mod.lin", "single_blocks.*.modulation.lin")
_WAN_ATTENDS = {"WanSelfAttention": Attends.SELF, "WanT2VCrossAttention": Attends.CROSS,
                "WanI2VCrossAttention": Attends.CROSS}

# FLUX.1 and Chroma share ComfyUI's double/single-stream blocks, embedders and final layer: one layout, two rows
_FLUX = ModelFamily(
    family="FLUX.1 (dev, schnell)",
    classes=("Flux",),
    counterpart="FluxTransformer2DModel",
    blocks=_FLUX_BLOCKS,
    streams={"ref_latents": "FLUX Kontext reference images (refused: " + _FLUX_REF + ")"},
    patch=_square_patch,
    tokens=Site("img_in"),
    rope=Site("pe_embedder"),
    gather=Site("final_layer"),
    attends={"DoubleStreamBlock": Attends.JOINT, "SingleStreamBlock": Attends.JOINT},
    text=PREFIX,
    call_refusals={"ref_latents": _FLUX_REF, "attention_mask": _FLUX_MASK, "control": _CONTROL},
    cond_refusals={"reference_latents": _FLUX_REF, "attention_mask": _FLUX_MASK},
    text_tokens=Site("txt_in"),
    modulation=_FLUX_MODULATION,
)

_WAN = ModelFamily(
    family="Wan 2.1 / 2.2 (14B, 1.3B, 5B; text-to-video, image-to-video)",
    classes=("WanModel",),
    counterpart="WanTransformer3DModel",
    blocks=("blocks.*",),
    streams={"clip_fea": "CLIP image features (image-to-video): cross-attention keys, whole on every rank",
             "reference_latent": "Wan Fun reference (refused: " + _WAN_REF + ")"},
    patch=_wan_patch,
    # the patch embedding is a strided Conv3d whose output is flattened in the model's forward: the tokens first
    # exist as the first block's input
    tokens=Site("blocks.0", "input", 0),
    rope=Site("rope_embedder"),
    gather=Site("head"),
    attends=_WAN_ATTENDS,
    text=NONE,
    call_refusals={"reference_latent": _WAN_REF, "control": _CONTROL},
    cond_refusals={"reference_latents": _WAN_REF},
)

FAMILIES: Tuple[ModelFamily, ...] = (
    _FLUX,
    # Chroma's blocks take precomputed modulations (its approximator), no per-block layer; it ignores reference
    # latents (no stream), which FLUX's refusals still refuse
    _FLUX._replace(family="Chroma", classes=("Chroma",), counterpart="", modulation=(), streams={}),
    _WAN,
    # Wan VACE: Wan's layout, and the hint stream banded with the video tokens
    _WAN._replace(
        family="Wan VACE",
        classes=("VaceWanModel",),
        counterpart="",
        # VaceWanModel is text-to-video only (no image cross-attention)
        attends={"WanSelfAttention": Attends.SELF, "WanT2VCrossAttention": Attends.CROSS},
        streams=dict(_WAN.streams, vace_context="the VACE context: a second token stream on the video's grid whose "
                     "vace_blocks add hints to the video tokens: banded like them (wan_vace_hooks)"),
        hooks=wan_vace_hooks,
        grid_conds=("vace_frames", "vace_mask"),
    ),
    ModelFamily(
        family="Qwen-Image",
        classes=("QwenImageTransformer2DModel",),
        counterpart="QwenImageTransformer2DModel",
        blocks=("transformer_blocks.*",),
        streams={"ref_latents": "Qwen-Image Edit reference images (refused: " + _QWEN_REF + ")"},
        patch=_square_patch,
        tokens=Site("img_in"),
        rope=Site("pe_embedder"),
        gather=Site("proj_out"),
        attends={"Attention": Attends.JOINT},
        text=PREFIX,
        heads="transformer_blocks.0.num_attention_heads",
        call_refusals={"ref_latents": _QWEN_REF, "control": _CONTROL},
        cond_refusals={"reference_latents": _QWEN_REF},
        # the text stream after txt_norm and txt_in (ComfyUI's blocks do not lay the text mask over attention)
        text_tokens=Site("txt_in"),
        modulation=("transformer_blocks.*.img_mod.1", "transformer_blocks.*.txt_mod.1"),
    ),
    ModelFamily(
        family="HunyuanVideo (1.0 t2v, i2v; HunyuanImage 2.1)",
        classes=("HunyuanVideo",),
        counterpart="HunyuanVideoTransformer3DModel",
        blocks=_FLUX_BLOCKS,
        streams={"txt_byt5": "ByT5 glyph tokens (HunyuanImage 2.1): joined to the text, which then stays whole",
                 "ref_latent": "a reference latent (refused: " + _HY_REF + ")"},
        patch=_hunyuan_patch,
        tokens=Site("img_in"),
        rope=Site("pe_embedder"),
        gather=Site("final_layer"),
        # the token refiner's self-attention is over the text alone, whole on every rank: it runs locally
        attends={"DoubleStreamBlock": Attends.JOINT, "SingleStreamBlock": Attends.JOINT,
                 "TokenRefinerBlock": Attends.CROSS},
        text=SUFFIX,
        call_refusals={"ref_latent": _HY_REF, "control": _CONTROL},
        cond_refusals={"ref_latent": _HY_REF},
        hooks=hunyuan_hooks,
        # the text stream after the token refiner (which runs over the whole text, with its mask)
        text_tokens=Site("txt_in"),
        text_whole={
            "attention_mask": "the text mask is laid over the whole text's key columns in the model's forward",
            "txt_byt5": "ByT5 glyph tokens (HunyuanImage 2.1) join the text after the token refiner",
        },
        modulation=_FLUX_MODULATION,
    ),
    ModelFamily(
        family="SD3 / SD3.5",
        classes=("OpenAISignatureMMDITWrapper",),
        blocks=("joint_blocks.*",),
        patch=_square_patch,
        # the absolute position embedding is added to the patch embedding's output in the forward: the tokens first
        # exist, positions included, as the first joint block's image input (its second positional argument)
        tokens=Site("joint_blocks.0", "input", 1),
        rope=None,  # absolute positions, added before the token site: nothing to cut
        gather=Site("final_layer"),
        # a joint block's joint attention (text first), and SD3.5 Medium's image-only attention (attn2) in the same
        # block: both over all ranks' image keys; the text is kept whole on every rank (no text site)
        attends={"JointBlock": Attends.JOINT},
        text=PREFIX,
        heads="joint_blocks.0.x_block.attn.num_heads",
        call_refusals={"control": _CONTROL},
        # the class's forward (ComfyUI 0.3.64) calls no DIFFUSION_MODEL wrappers
        entry="APPLY_MODEL",
    ),
    ModelFamily(
        family="Lumina 2",
        classes=("NextDiT",),
        blocks=("context_refiner.*", "noise_refiner.*", "layers.*"),
        patch=_square_patch,
        # the text and image refiners run whole on every rank (text-only, image-only); the main layers get one joint
        # sequence, text first: its image tokens are cut at the first layer's input, the text kept whole
        tokens=Site("layers.0", "input", 0),
        rope=None,  # made for the joint sequence in patchify_and_embed and passed to each layer: lumina_hooks cuts it
        gather=Site("final_layer"),  # the text first and whole, then every rank's image tokens
        attends={},  # the refiners and the main layers share a class: lumina_hooks scopes them by path
        text=PREFIX,
        heads="n_heads",
        call_refusals={"attention_mask": "a text padding mask (each prompt of the batch has its own text length in "
                       "the joint sequence)"},
        hooks=lumina_hooks,
    ),
    ModelFamily(
        family="LTX-Video",
        classes=("LTXVModel",),
        counterpart="LTXVideoTransformer3DModel",
        blocks=("transformer_blocks.*",),
        patch=_ltxv_patch,
        tokens=Site("patchify_proj"),
        rope=None,  # computed by precompute_freqs_cis and passed to each block: ltxv_hooks cuts it there
        gather=Site("proj_out"),
        attends={},  # attn1 (self) and attn2 (cross) share a class: ltxv_hooks scopes them by path
        text=NONE,
        heads="transformer_blocks.0.attn1.heads",
        hooks=ltxv_hooks,
    ),
    # ---- classes with blocks for sharding and no sequence layout yet
    ModelFamily(
        family="Wan Fun Camera",
        classes=("CameraWanModel",),
        blocks=("blocks.*",),
        streams={"camera_conditions": "a camera adapter over the whole grid, added to the tokens"},
        refusal="Wan Fun Camera: a camera adapter adds a full-grid tensor to the tokens",
    ),
    # ---- classes PatchRay knows and does not shard by sequence or blocks yet
    ModelFamily(
        family="Wan 2.2 S2V",
        classes=("WanModel_S2V",),
        streams={"audio_embed": "audio tokens", "motion_latents": "motion tokens joined to the video sequence"},
        refusal="Wan 2.2 S2V: audio and motion tokens join the video sequence",
    ),
    ModelFamily(
        family="Wan HuMo",
        classes=("HumoWanModel",),
        streams={"audio_embed": "audio tokens with an attention of their own"},
        refusal="Wan HuMo: audio tokens and their own attention",
    ),
    ModelFamily(
        family="Wan 2.2 Animate",
        classes=("AnimateWanModel",),
        streams={"pose_latents": "pose adapter over the whole grid", "face_pixel_values": "face adapter"},
        refusal="Wan 2.2 Animate: face and pose adapters over the whole grid",
    ),
    ModelFamily(
        family="Chroma Radiance",
        classes=("ChromaRadiance",),
        refusal="Chroma Radiance: pixel-space NeRF blocks after the transformer",
    ),
    ModelFamily(
        family="SD 1.x / 2.x / SDXL UNet",
        classes=("UNetModel",),
        counterpart="UNet2DConditionModel",
        # the layers inside each TimestepEmbedSequential: ComfyUI's UNet iterates a block's layers and calls each one
        # (``forward_timestep_embed``), never the block's own forward, so a unit's gather hook must sit on the layers
        blocks=("input_blocks.*.*", "middle_block.*", "output_blocks.*.*"),
        row_bands=True,
        refusal="a UNet: sequence parallelism is for DiTs; UNets are sharded by row bands of their convolutions",
    ),
)


def family_for(class_name: str) -> Optional[ModelFamily]:
    """The row serving ComfyUI diffusion-model class ``class_name`` (with or without a sequence layout), or ``None``."""
    for row in FAMILIES:
        if class_name in row.classes:
            return row
    return None
