"""The DiT benchmark's models, inputs and cases (``python -m patchray.distributed.bench.dit_bench``).

Presets: a diffusers DiT class at the configuration of a released checkpoint (and a tiny one of the same blocks),
random weights, one batch-1 input per CFG branch; the cases a preset runs at each rank count; the per-case
arithmetic shared by the rank side and the report (calls per step, the runtime cost model's bytes, what fits).

Design decisions:

* **Random weights without a minutes-long start.** The model is built on the meta device (no memory, no init),
  cast to the inference dtype (the class's ``_keep_in_fp32_modules`` kept in fp32, as diffusers'
  ``from_pretrained(torch_dtype=...)`` does), materialised directly on the device (``to_empty``) and every
  parameter drawn there from one seeded generator (weights ``N(0, 1) * 0.8 / sqrt(fan_in)``, norm scales
  ``1 + 0.2 N(0, 1)``: none constant). Tensors a module computes in its constructor (RoPE tables: buffers and plain
  attributes) cannot be made on meta; they are taken from a one-block CPU build of the same configuration whose
  parameter initialisation is skipped (only those tensors are read from it).
* **What a call is, what a step is.** The timed unit is one *call*: what a rank group evaluates per step for one
  CFG branch (N = 1 and sequence modes: one model evaluation of batch 1; ``cfg``: each group evaluates its branch
  and the outputs are exchanged once). A step with classifier-free guidance is two calls in the N = 1 and sequence
  modes (cond and uncond, one after the other: the same kernels on the same shapes) and one call in ``cfg`` mode;
  FLUX.1-dev is guidance-distilled (one call per step), and its ``cfg`` rows are "true CFG" (two evaluations per
  step), whose reference is two N = 1 calls. The reference step is N = 1's calls measured alone; batching cond and
  uncond into one batch-2 call is slower on an H200 for Wan and Qwen-Image (results/h200 baselines), so two
  batch-1 calls are the fairer single-GPU reference.
* **Text tokens: replicated or sharded, from one place.** :data:`TEXT_TOKENS` says whether a joint-attention
  model's text tokens are split across the ranks like the image tokens (``"sharded"``: what the sampler does in
  its exact modes) or replicated on every sequence rank (``"replicated"``: the stale presets); :func:`token_share` (the estimate) reads it,
  and ``--text-tokens`` overrides it per run.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["DiTPreset", "PRESETS", "MODES", "DEFAULT_MODES", "TEXT_TOKENS", "Case", "build_random", "skeleton", "constructor_tensors",
           "constructor_dtypes", "set_constructor_tensors", "init_random_", "make_inputs", "plan_cases",
           "dit_shape", "token_share", "ranks_that_fit"]

#: the exact modes (``cfg`` with N > 2 is CFG x sequence, gathered inside each group)
MODES = ("gathered", "ulysses", "cfg", "overlapped", "ring")
#: the modes a run measures unless told (overlapped and ring move gathered's bytes; their gain is the compute they hide
#: the exchange behind)
DEFAULT_MODES = ("gathered", "ulysses", "cfg")

_GIB = 2**30


class DiTPreset(NamedTuple):
    """One DiT at one input size.

    Args:
        name: preset key (CLI ``--preset``).
        cls: the diffusers class name.
        title: human name (the released checkpoint and the image/video size).
        full: constructor arguments of the released model.
        tiny: reduced configuration of the same blocks (CPU runs, CI).
        grid_full, grid_tiny: ``(frames, token rows, token cols)`` after patchify.
        text_full, text_tiny: text tokens (the encoder's sequence length).
        cfg: whether the model is sampled with classifier-free guidance (two evaluations per step).
        shape_key: key of ``sampling.dit.FULL_SIZE_SHAPES`` (the cost model's cross-check), or ``None``.
        warmup, iters: default warm-up and timed calls per case (turn-taking).
    """

    name: str
    cls: str
    title: str
    full: dict
    tiny: dict
    grid_full: Tuple[int, int, int]
    grid_tiny: Tuple[int, int, int]
    text_full: int
    text_tiny: int
    cfg: bool
    shape_key: Optional[str]
    warmup: int = 2
    iters: int = 3


PRESETS: Dict[str, DiTPreset] = {
    p.name: p
    for p in (
        DiTPreset(
            "flux1_1024", "FluxTransformer2DModel", "FLUX.1-dev transformer (12B), 1024x1024",
            dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56)),
            dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
                 num_attention_heads=4, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True,
                 axes_dims_rope=(2, 2, 4)),
            (1, 64, 64), (1, 7, 3), 512, 5, False, "flux1_1024", 1, 2,
        ),
        DiTPreset(
            "wan21_14b_480x832x81", "WanTransformer3DModel", "Wan 2.1 T2V-14B transformer, 480x832x81",
            dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                 text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
            dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
            (21, 30, 52), (3, 7, 3), 512, 5, True, "wan21_14b_480x832x81", 1, 1,
        ),
        DiTPreset(
            "qwen_image_1328", "QwenImageTransformer2DModel", "Qwen-Image transformer (20B), 1328x1328",
            dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)),
            dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(2, 2, 4)),
            (1, 83, 83), (1, 7, 3), 256, 5, True, "qwen_image_1328", 1, 2,
        ),
    )
}


# ------------------------------------------------------------------------------------------------ models and inputs


@contextlib.contextmanager
def _skip_init():
    """Make ``torch.nn.init``'s in-place initialisers no-ops (a build whose parameters are never read)."""
    import torch.nn.init as init

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def _one_block(config: dict) -> dict:
    out = dict(config)
    for key in ("num_layers", "num_single_layers"):
        if key in out:
            out[key] = 1
    return out


def _constructor_tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Buffers and plain tensor attributes (what a constructor computes), by qualified name."""
    out = {}
    for path, mod in module.named_modules():
        prefix = path + "." if path else ""
        for name, buf in mod._buffers.items():
            if buf is not None:
                out[prefix + name] = buf
        for name, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and not name.startswith("_"):
                out[prefix + name] = value
    return out


def _set_tensor(root: torch.nn.Module, qualified: str, value: torch.Tensor) -> None:
    path, _, name = qualified.rpartition(".")
    mod = root.get_submodule(path) if path else root
    if name in mod._buffers:
        mod._buffers[name] = value
    else:
        setattr(mod, name, value)


def _fp32_paths(model: torch.nn.Module, keep: Sequence[str]) -> List[str]:
    return [p for p, _ in model.named_modules() if p and any(k in p.split(".") for k in keep)]


def skeleton(preset: DiTPreset, size: str, dtype: torch.dtype, keep_fp32: bool = True) -> torch.nn.Module:
    """The preset's model on the meta device, cast to ``dtype`` (with ``keep_fp32``, the class's
    ``_keep_in_fp32_modules`` stay in fp32, as diffusers' ``from_pretrained(torch_dtype=...)`` keeps them; without,
    every tensor is ``dtype``: what FSDP2 needs of a block, one dtype per unit)."""
    import diffusers

    cls = getattr(diffusers, preset.cls)
    with torch.device("meta"):
        model = cls(**(preset.full if size == "full" else preset.tiny))
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()  # its advice to keep some modules in fp32 is followed below
    try:
        model = model.to(dtype)
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype != torch.float32 and keep_fp32 else []
    for path in _fp32_paths(model, keep):
        model.get_submodule(path).to(torch.float32)
    return model


def constructor_tensors(preset: DiTPreset, size: str) -> Dict[str, torch.Tensor]:
    """What the class's constructor computes (RoPE tables: buffers and plain tensor attributes), by qualified name,
    from a one-block CPU build whose parameters are never initialised (block ``i``'s tensors are block 0's)."""
    import diffusers

    with _skip_init():
        reference = getattr(diffusers, preset.cls)(**_one_block(preset.full if size == "full" else preset.tiny))
    return _constructor_tensors(reference)


def set_constructor_tensors(model: torch.nn.Module, names_dtypes: Dict[str, torch.dtype], reference: Dict[str, torch.Tensor],
                            device: torch.device) -> None:
    """Set each of ``names_dtypes`` (a constructor tensor's name -> its dtype in the cast model) from ``reference``
    (:func:`constructor_tensors`) on ``device``."""
    for name, dt in names_dtypes.items():
        source = reference.get(name)
        if source is None:  # a block beyond the first: the same constructor, block 0's tensors
            parts = name.split(".")
            idx = next((i for i, s in enumerate(parts) if s.isdigit()), None)
            if idx is not None:
                source = reference.get(".".join(parts[:idx] + ["0"] + parts[idx + 1:]))
        if source is None:
            raise RuntimeError(f"{type(model).__name__}: no reference for the constructor tensor {name!r}")
        target_dtype = dt if source.is_floating_point() else source.dtype
        _set_tensor(model, name, source.to(device=device, dtype=target_dtype))


def constructor_dtypes(model: torch.nn.Module) -> Dict[str, torch.dtype]:
    """The constructor tensors of ``model`` (on any device) and their dtypes."""
    return {k: v.dtype for k, v in _constructor_tensors(model).items()}


def init_random_(model: torch.nn.Module, device: torch.device, seed: int = 0) -> None:
    """Draw every parameter of ``model`` (allocated on ``device``) in place: weights ``N(0, 1) * 0.8 / sqrt(fan_in)``,
    norm scales ``1 + 0.2 N(0, 1)`` (none constant)."""
    g = torch.Generator(device=device).manual_seed(seed) if device.type != "meta" else None  # meta: a dry run
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(generator=g)
            if p.dim() == 1 and "norm" in name and not name.endswith("bias"):
                p.mul_(0.2).add_(1.0)  # norm scales: around 1, not constant
            else:
                fan_in = p[0].numel() if p.dim() > 1 else 16
                p.mul_(0.8 / math.sqrt(fan_in))


def build_random(preset: DiTPreset, size: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 keep_fp32: bool = True) -> torch.nn.Module:
    """The preset's model with random weights, on ``device`` (see the module docstring; ``keep_fp32``: :func:`skeleton`).

    Example:
        >>> m = build_random(PRESETS["wan21_14b_480x832x81"], "tiny", torch.device("cpu"), torch.float32)  # doctest: +SKIP
    """
    model = skeleton(preset, size, dtype, keep_fp32)
    meta_dtypes = constructor_dtypes(model)
    model = model.to_empty(device=device)
    init_random_(model, device, seed)
    # constructor-computed tensors (RoPE tables) from a one-block CPU build, parameters never initialised
    set_constructor_tensors(model, meta_dtypes, constructor_tensors(preset, size), device)
    return model.eval().requires_grad_(False)


def make_inputs(preset: DiTPreset, size: str, device: torch.device, dtype: torch.dtype, seed: int = 1) -> List[dict]:
    """``[cond, uncond]`` keyword arguments of one batch-1 call each (same latent and timestep, different text)."""
    config = preset.full if size == "full" else preset.tiny
    frames, rows, cols = preset.grid_full if size == "full" else preset.grid_tiny
    text = preset.text_full if size == "full" else preset.text_tiny
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if preset.cls == "FluxTransformer2DModel":
        ids = torch.zeros(rows, cols, 3)
        ids[..., 1] = torch.arange(rows)[:, None]
        ids[..., 2] = torch.arange(cols)[None, :]
        common = dict(hidden_states=r(1, rows * cols, config["in_channels"]), img_ids=ids.reshape(-1, 3).to(device),
                      txt_ids=torch.zeros(text, 3, device=device), timestep=torch.tensor([0.7], device=device, dtype=dtype))
        if config.get("guidance_embeds"):
            common["guidance"] = torch.tensor([3.5], device=device, dtype=dtype)
        conds = [dict(encoder_hidden_states=r(1, text, config["joint_attention_dim"]),
                      pooled_projections=r(1, config["pooled_projection_dim"])) for _ in range(2)]
    elif preset.cls == "WanTransformer3DModel":
        pt, ph, pw = config["patch_size"]
        common = dict(hidden_states=r(1, config["in_channels"], frames * pt, rows * ph, cols * pw),
                      timestep=torch.tensor([700.0], device=device))
        conds = [dict(encoder_hidden_states=r(1, text, config["text_dim"])) for _ in range(2)]
    elif preset.cls == "QwenImageTransformer2DModel":
        # a prompt without padding: the pipeline's mask is all ones, and no mask is passed
        common = dict(hidden_states=r(1, rows * cols, config["in_channels"]), img_shapes=[[(frames, rows, cols)]],
                      timestep=torch.tensor([0.7], device=device, dtype=dtype))
        conds = [dict(encoder_hidden_states=r(1, text, config["joint_attention_dim"])) for _ in range(2)]
    else:  # backstop, not the guard: the table is ours
        raise ValueError(f"no input builder for {preset.cls}")
    return [dict(common, **c, return_dict=False) for c in conds]


# ------------------------------------------------------------------------------------------------ cases


class Case(NamedTuple):
    """One measured configuration: ``mode`` on ``n`` ranks (``none`` for N = 1)."""

    n: int
    mode: str

    @property
    def label(self) -> str:
        if self.mode == "none":
            return "N=1"
        if self.mode == "cfg":
            return f"cfg N={self.n}" if self.n == 2 else f"cfg x seq{self.n // 2} N={self.n}"
        return f"seq-{self.mode} N={self.n}"


def _heads(preset: DiTPreset, size: str) -> int:
    return (preset.full if size == "full" else preset.tiny)["num_attention_heads"]


def plan_cases(preset: DiTPreset, size: str, ns: Sequence[int], modes: Sequence[str] = DEFAULT_MODES) -> List[Case]:
    """The cases of one preset, most informative first: N = 1, then for each N the modes that apply.

    Ulysses needs the heads to divide by N; ``cfg`` needs an even N.
    """
    cases = [Case(1, "none")] if 1 in ns else []
    for n in sorted(x for x in set(ns) if x > 1):
        for mode in modes:
            if mode == "ulysses" and _heads(preset, size) % n:
                continue
            if mode == "cfg" and n % 2:
                continue
            cases.append(Case(n, mode))
    # the cases the goals are read on first (a run cut short by its deadline keeps them): CFG-parallel at 2, the
    # cheaper exact sequence mode at 2 and at 4 (gathered at 2, Ulysses at 4), CFG x sequence, then the others
    first = [Case(2, "cfg"), Case(2, "gathered"), Case(4, "ulysses"), Case(4, "cfg")]
    return sorted(cases, key=lambda c: (c.n > 1, first.index(c) if c in first else len(first), c.n))


def dit_shape(preset: DiTPreset, size: str):
    """The preset's :class:`~patchray.distributed.sampling.dit.DiTShape` (what the traffic cost model needs)."""
    from ..sampling.dit import DiTShape
    from ..sampling.dit_traffic import modulation_features

    c = preset.full if size == "full" else preset.tiny
    frames, rows, cols = preset.grid_full if size == "full" else preset.grid_tiny
    text = preset.text_full if size == "full" else preset.text_tiny
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    if preset.cls == "FluxTransformer2DModel":
        return DiTShape(c["num_layers"] + c["num_single_layers"], c["num_attention_heads"], c["attention_head_dim"],
                        frames, rows, cols, text, c["patch_size"] ** 2 * (c.get("out_channels") or c["in_channels"]),
                        modulation_features(c["num_layers"], c["num_single_layers"], dim))
    if preset.cls == "WanTransformer3DModel":
        return DiTShape(c["num_layers"], c["num_attention_heads"], c["attention_head_dim"], frames, rows, cols, 0,
                        math.prod(c["patch_size"]) * c["out_channels"])
    if preset.cls == "QwenImageTransformer2DModel":  # double-stream blocks only
        return DiTShape(c["num_layers"], c["num_attention_heads"], c["attention_head_dim"], frames, rows, cols, text,
                        c["patch_size"] ** 2 * c["out_channels"], modulation_features(c["num_layers"], 0, dim))
    raise ValueError(f"no traffic shape for {preset.cls}: add its attention layers and modulation layers here")


def _cost_model_wire(preset: DiTPreset, size: str, case: Case, itemsize: int, cfg_inner: str = "gathered",
                     modulation: bool = True) -> int:
    """Bytes a rank sends per call by the runtime's cost model (``sampling.dit.step_cost``, ``split.split_cost``);
    ``modulation`` False: the modulation layers ran whole on every rank (nothing of theirs exchanged)."""
    from ..sampling.dit import step_cost
    from ..sampling.split import split_cost

    shape = dit_shape(preset, size)
    if not modulation:
        shape = shape._replace(modulation=())
    if case.mode == "cfg":
        inner = step_cost(shape, case.n // 2, cfg_inner, itemsize=itemsize)["wire_bytes"] if case.n > 2 else 0
        latent = (shape.frames * shape.rows * shape.cols * shape.out_features,)
        return inner + split_cost(latent, itemsize, 2, 2)["wire_bytes"]
    return step_cost(shape, case.n, case.mode, itemsize=itemsize)["wire_bytes"]


def _calls_per_step(preset: DiTPreset, case: Case) -> int:
    if case.mode == "cfg":
        return 1
    return 2 if preset.cfg else 1


def _reference_calls(preset: DiTPreset, case: Case) -> int:
    return 2 if (preset.cfg or case.mode == "cfg") else 1


def _weights_bytes(preset: DiTPreset, size: str, itemsize: int) -> int:
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, preset.cls)(**(preset.full if size == "full" else preset.tiny))
    return sum(p.numel() for p in model.parameters()) * itemsize


#: activation and runtime head-room per rank on top of the weights, for the fit decision (bytes)
_HEADROOM = 4 * _GIB  # Wan 2.1 14B at 480x832x81, batch 1: 3.4 GiB over its weights (results/h200 baselines)


def ranks_that_fit(weights: int, total: Optional[int], ranks: int) -> int:
    """The most ranks (<= ``ranks``) whose full copies plus head-room fit a device of ``total`` bytes."""
    if total is None:
        return ranks
    n = ranks
    while n > 1 and n * (weights + _HEADROOM) > 0.97 * total:
        n -= 1
    return n


#: how the sequence ranks hold a joint-attention model's text tokens: "replicated" (every rank holds them all: the
#: sampler's behaviour when this was written) or "sharded" (split across the ranks like the image tokens). The one
#: place the estimate's token share reads it from (``--text-tokens`` overrides it per run).
TEXT_TOKENS = "sharded"


def token_share(preset: DiTPreset, n: int, size: str = "full", text_tokens: Optional[str] = None) -> float:
    """The busiest rank's share of a call's tokens: its band of image token rows plus its text tokens (the
    sampler's own :func:`~patchray.distributed.sampling.dit_traffic.token_share`).

    ``text_tokens`` (default :data:`TEXT_TOKENS`): ``"sharded"``, the busiest rank's slice of them (what the sampler
    does for joint-attention models in its exact modes); ``"replicated"``, every text token on every rank (what it
    did before, and still does for the stale presets).
    """
    from ..sampling.dit_traffic import token_share as sampler_share

    mode = text_tokens or TEXT_TOKENS
    if mode not in ("replicated", "sharded"):
        raise ValueError(f"text_tokens must be 'replicated' or 'sharded' (got {mode!r})")
    return sampler_share(dit_shape(preset, size), n, shard_text=mode == "sharded")
