"""The rank-side hooks of the family table (:mod:`.families`): what a row's sites cannot say about a layout. A row
names its hooks (``hooks=``); the rank's :class:`~.dit_rank.DitSequence` installs them with the sites and removes
them after the run. A new family needs a hook here only if its layout is new.

What the rows with hooks (and Qwen-Image, whose sites suffice) do differently from FLUX.1 / Wan (ComfyUI 0.3.64):

* **Qwen-Image** (``comfy/ldm/qwen_image/model.py``, ``QwenImageTransformer2DModel``): FLUX-like joint attention
  with the text tokens first; RoPE from ``pe_embedder`` (``[B, 1, L, D/2, 2, 2]``, text positions first). Plain
  sites: tokens after ``img_in``, text after ``txt_in`` (sharded like the image tokens), RoPE after
  ``pe_embedder`` (text before: cut to the rank's text slice and image band), gather after ``proj_out``.
* **HunyuanVideo** (``comfy/ldm/hunyuan_video/model.py``, ``HunyuanVideo``; HunyuanImage 2.1 and its refiner load
  as the same class with a 2-D or 1x1x1 patch): FLUX's double and single blocks with the text tokens LAST
  (``torch.cat((img, txt))``), RoPE of ``cat(img_ids, txt_ids)`` (text after). The text passes a token refiner
  first (self-attention over the text alone, whole on every rank: runs locally, like cross-attention); its output
  is then cut to the rank's text slice. A call with a text mask (laid over the whole text's key columns in the
  forward) or ByT5 glyph tokens (HunyuanImage 2.1, joined after the refiner) keeps its text whole on every rank;
  the mask is then built from the local sequence length (image columns all zero) and the library re-expresses it
  over every rank's keys. Image-to-video "v2 (replace)" modulates the first frame's tokens differently, by token index
  (``modulation_dims``): :func:`hunyuan_hooks` moves that boundary to this rank's first-frame tokens.
* **LTX-Video** (``comfy/ldm/lightricks/model.py``, ``LTXVModel``): 1x1x1 patches (tokens = latent voxels,
  frame-major); self-attention (``attn1``) and cross-attention (``attn2``) are the same class (``CrossAttention``),
  told apart by path; the RoPE ``(cos, sin)`` ``[B, L, D]`` is computed by a function and passed to every block as
  ``pe=``; with a noise mask (image-to-video, keyframes) the timestep is per token (``[B * L]`` into
  ``adaln_single``, then ``[B, L, 6D]`` modulation added to the tokens). :func:`ltxv_hooks` scopes the two
  attentions by path, cuts ``pe`` to this rank's positions at each block, and cuts a per-token timestep where it
  enters ``adaln_single``. Keyframe (guide) latents are frames of the same grid whose coordinates the model
  overwrites before the RoPE is made: sharded like any frame, exact.

This module imports no ComfyUI (the hooks use only torch module hooks and class names): CI tests it.
"""

from __future__ import annotations

from typing import Any, List

__all__ = ["ltxv_hooks", "hunyuan_hooks", "wan_vace_hooks", "lumina_hooks"]


# --------------------------------------------------------------------------------------------------- hooks


def _seq():
    from ...distributed.parallel import sequence

    return sequence


def _scope(seq, module, kind: str, path: str) -> list:
    """Forward pre/post hooks pushing ``(kind, path)`` on the rank's attention-scope stack around ``module``."""
    stack = seq.scopes.stack

    def pre(mod, args):
        stack.append((kind, path))

    def post(mod, args, out):
        stack.pop()

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def _first_tensor(value):
    """The first tensor in ``value`` (a tensor, or nested tuples/lists holding one), or ``None``."""
    if isinstance(value, (tuple, list)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
        return None
    return value if hasattr(value, "shape") else None


class _Cut:
    """Cuts a full-sequence tensor (or tuple of tensors) to this rank's tokens along ``dim``, once per distinct
    source object (every block of a call gets the same ``pe``: cut once, reused)."""

    def __init__(self, seq, dim: int):
        self.seq, self.dim = seq, dim
        self.src = None
        self.out = None

    def __call__(self, value):
        if value is self.src:
            return self.out
        self.out = self._cut(value)
        self.src = value
        return self.out

    def _cut(self, value):
        # newer ComfyUI passes LTX-Video's pe as (rotation tables, split mode): tensors are cut, other leaves
        # (the mode flag) travel as they are
        if isinstance(value, (tuple, list)):
            return type(value)(self._cut(v) for v in value)
        if not hasattr(value, "shape"):
            return value
        return _seq().shard_positions(value, self.seq.state.require_shards(), self.seq.ctx.rank, dim=self.dim)

    def clear(self):
        self.src = self.out = None


def _class_name(module) -> str:
    """``module``'s own class name: with ``sharding`` blocks or blocks+offload, FSDP2 has replaced a sharded block's
    class by its subclass (``FSDPBasicTransformerBlock``), and the hooks must still find the block."""
    from ...distributed import comm

    return comm.base_class(module).__name__


class _Handle:
    def __init__(self, fn):
        self.remove = fn


def ltxv_hooks(seq) -> List[Any]:
    """LTX-Video: attention scopes by path (``attn1`` self, ``attn2`` cross), the block's ``pe`` cut to this rank's
    positions, a per-token timestep cut where it enters ``adaln_single``."""
    dm = seq.dm
    handles: List[Any] = []
    cut_pe = _Cut(seq, dim=1)
    world = seq.ctx.world_size

    def block_pre(mod, args, kwargs):
        pe = kwargs.get("pe")
        if world == 1 or pe is None:
            return None
        total = seq.state.require_shards().total
        first = _first_tensor(pe)
        if first is None:
            return None
        if first.shape[1] != total:
            if first.shape[1] == seq.state.require_shards().counts[seq.ctx.rank]:
                return None  # already this rank's (a block patch passing the cut table on)
            raise ValueError(f"LTX-Video: a positional embedding of {first.shape[1]} tokens for {total} image tokens")
        return args, dict(kwargs, pe=cut_pe(pe))

    def adaln_pre(mod, args, kwargs):
        if world == 1:
            return None
        t = args[0]
        b = int(kwargs.get("batch_size") or 1)
        shards = seq.state.require_shards()
        if t.numel() == b or t.numel() != b * shards.total:
            return None  # one timestep per sample
        local = _seq().shard_tokens(t.reshape(b, shards.total), shards, seq.ctx.rank, dim=1).reshape(-1)
        return (local,) + tuple(args[1:]), kwargs

    for path, module in dm.named_modules():
        name = _class_name(module)
        if name == "BasicTransformerBlock" and hasattr(module, "attn1") and hasattr(module, "attn2"):
            handles += _scope(seq, module.attn1, "self", f"{path}.attn1")
            handles += _scope(seq, module.attn2, "cross", f"{path}.attn2")
            handles.append(module.register_forward_pre_hook(block_pre, with_kwargs=True))
    handles.append(dm.adaln_single.register_forward_pre_hook(adaln_pre, with_kwargs=True))
    handles.append(_Handle(cut_pe.clear))
    return handles


def hunyuan_hooks(seq) -> List[Any]:
    """HunyuanVideo image-to-video "v2 (replace)": the first frame's tokens take a different modulation, chosen by
    token index (``modulation_dims = [(0, frame_tokens, 0), (frame_tokens, None, 1)]`` over the image tokens the
    block holds). This rank holds its band of every frame, frame-major, so its first frame's tokens are its rows of
    frame 0: the boundary moves to ``local rows * cols``."""
    dm = seq.dm
    world = seq.ctx.world_size
    keys = {"DoubleStreamBlock": "modulation_dims_img", "SingleStreamBlock": "modulation_dims", "LastLayer": "modulation_dims"}

    def local_dims(dims):
        if world == 1 or not dims:
            return dims
        shards = seq.state.require_shards()
        full = shards.rows * shards.cols
        mine = shards.counts[seq.ctx.rank] // shards.frames
        out = []
        for start, end, index in dims:
            start = mine if start == full else start
            end = mine if end == full else end
            out.append((start, end, index))
        return out

    handles: List[Any] = []
    for _path, module in dm.named_modules():
        key = keys.get(_class_name(module))
        if key is None:
            continue

        def pre(mod, args, kwargs, key=key):
            dims = kwargs.get(key)
            if not dims:
                return None
            return args, dict(kwargs, **{key: local_dims(dims)})

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def wan_vace_hooks(seq) -> List[Any]:
    """Wan VACE: the hint stream, banded like the video tokens. ``VaceWanModel.forward_orig`` embeds the VACE context
    with a patch embedding of its own (``vace_patch_embedding``: the video's grid, flattened in the forward) and
    passes it, with the video tokens as they were before the first block (``x=x_orig``), to each ``vace_blocks``
    block, whose hint ``c_skip`` is added to the video tokens. Both arrive whole (all tokens): the pre-hook cuts them
    to this rank's band (a stream already cut, a later block's ``c``, passes as it is), so a hint is computed for, and
    added to, this rank's tokens only; the blocks' attentions are the video's (the row's attention classes)."""
    dm = seq.dm
    world = seq.ctx.world_size
    cut_x = _Cut(seq, dim=1)

    def band(t, name, cut=None):
        shards = seq.state.require_shards()
        n = t.shape[1]
        if n == shards.total:
            return cut(t) if cut is not None else _seq().shard_tokens(t, shards, seq.ctx.rank, dim=1)
        if n == shards.counts[seq.ctx.rank]:
            return t  # already this rank's
        raise ValueError(f"Wan VACE: a {name} of {n} tokens for {shards.total} video tokens")

    def pre(mod, args, kwargs):
        if world == 1:
            return None
        c = band(args[0], "VACE hint stream")
        if kwargs.get("x") is not None:  # x_orig: the same whole tensor for every VACE block of a call, cut once
            kwargs = dict(kwargs, x=band(kwargs["x"], "video token input", cut_x))
        return (c,) + tuple(args[1:]), kwargs

    handles: List[Any] = []
    for _path, module in dm.named_modules():
        if _class_name(module) == "VaceWanAttentionBlock":
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    handles.append(_Handle(cut_x.clear))
    return handles


def lumina_hooks(seq) -> List[Any]:
    """Lumina 2 (``comfy/ldm/lumina/model.py``, ``NextDiT``): its text refiner (text only), image refiner (image only)
    and main layers are one class (``JointTransformerBlock``), told apart by path: the refiners run whole on every
    rank (local, like cross-attention), the main layers' joint attention spans every rank's image tokens. The RoPE of
    the joint sequence (text first) is made in ``patchify_and_embed`` and passed to each main layer as its third
    argument: cut there to the whole text and this rank's image band, once per call."""
    dm = seq.dm
    world = seq.ctx.world_size
    handles: List[Any] = []
    cache = {"src": None, "out": None}

    def layer_pre(mod, args):
        if world == 1:
            return None
        x, mask, freqs = args[0], args[1], args[2]
        if mask is not None:  # backstop, not the guard: the row refuses a call with a text padding mask
            raise NotImplementedError("Lumina 2: a text padding mask over the joint sequence")
        if freqs is not cache["src"]:
            shards = seq.state.require_shards()
            text = freqs.shape[1] - shards.total
            if text < 0:
                raise ValueError(f"Lumina 2: a positional embedding of {freqs.shape[1]} tokens for {shards.total} image tokens")
            cache["out"] = _seq().shard_positions(freqs, shards, seq.ctx.rank, dim=1, before=text)
            cache["src"] = freqs
        return (x, mask, cache["out"]) + tuple(args[3:])

    for path, module in dm.named_modules():
        if _class_name(module) != "JointTransformerBlock":
            continue
        main = path.startswith("layers.")
        handles += _scope(seq, module, "joint" if main else "cross", path)
        if main:
            handles.append(module.register_forward_pre_hook(layer_pre))

    def clear():
        cache["src"] = cache["out"] = None

    handles.append(_Handle(clear))
    return handles
