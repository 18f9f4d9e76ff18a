"""``python -m patchray.distributed.bench.dit_bench``: full-size DiT denoisers, sequence- and CFG-parallel (JSON + PNG).

For each preset (a diffusers DiT class at the configuration of a released checkpoint, random weights) and each rank
count N it measures PatchRay's exact modes on N rank processes sharing one device (gloo):

* ``none`` (N = 1): the stock model, one rank;
* ``gathered`` / ``ulysses``: sequence parallelism (``sampling.dit.parallelize_dit``) over all N ranks;
* ``cfg``: cond and uncond on two rank groups (``sampling.split.cfg_parallel``), each group sequence-parallel
  (gathered) over N / 2 ranks when N > 2 ("cfg x sequence").

Per case: the bytes per step (comm's accounting of one logged call: counted bytes per operation, and the bytes each
rank puts on its link), the per-rank peak device memory, each rank's compute per call **measured alone** (the ranks
take turns between collectives, ``measure.take_turns``; CUDA events), and the **modelled** latency per step for every
link profile of ``topology.links`` (per stage the slowest rank's compute + per collective the slowest rank's
``latency + bytes / bandwidth``, doubled via host: ``linkmodel.model_alone``), with the speed-up over one rank's full
step (N = 1, measured alone). An exactness check compares one call's output with N = 1's (relative L2).

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
* **One process launch for every preset and N.** ``--ranks W`` rank processes start once; each preset is built on
  as many ranks as its full copies fit on the device (per-process memory fraction ``0.97 / ranks``), the cases
  with N < W run on the first N ranks (subgroups) while the others wait, and the model is freed before the next
  preset. Rank 0 writes the JSON after every case (a run cut short still leaves its data), and a deadline
  (``--deadline-s``) skips the remaining cases, decided on rank 0 and shared, so every rank takes the same branch.
* **Everything modelled is labelled so** (``modelled: true``, the chart's titles): N ranks on one GPU measure
  compute and memory, not multi-GPU latency.

Usage::

    python -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --out results/h200/dit/dit_h200.json
    python -m patchray.distributed.bench.dit_bench --size tiny --ranks 2 --out /tmp/dit.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["DiTPreset", "PRESETS", "MODES", "GOALS", "build_random", "make_inputs", "plan_cases", "dit_shape", "run_dit_bench",
           "estimate", "token_share", "BASELINE_CALL_MS", "format_estimate",
           "write_chart", "format_table", "main"]

#: the exact modes (``cfg`` with N > 2 is CFG x sequence, gathered inside each group)
MODES = ("gathered", "ulysses", "cfg")

#: the speed-up goals the report is read against (modelled; per step)
GOALS = {"nvlink": {2: 1.9, 4: 3.6}, "pcie4_x16_no_p2p_cfg": {2: 1.9}}

#: link profiles the table and chart show (the JSON holds every profile)
SHOWN_PROFILES = ("nvlink", "pcie4_x16_no_p2p")

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


def build_random(preset: DiTPreset, size: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The preset's model with random weights, on ``device`` (see the module docstring).

    Example:
        >>> m = build_random(PRESETS["wan21_14b_480x832x81"], "tiny", torch.device("cpu"), torch.float32)  # doctest: +SKIP
    """
    import diffusers

    cls = getattr(diffusers, preset.cls)
    config = preset.full if size == "full" else preset.tiny
    with torch.device("meta"):
        model = cls(**config)
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()  # its advice to keep some modules in fp32 is followed below
    try:
        model = model.to(dtype)
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype != torch.float32 else []
    for path in _fp32_paths(model, keep):
        model.get_submodule(path).to(torch.float32)
    meta_dtypes = {k: v.dtype for k, v in _constructor_tensors(model).items()}
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed) if device.type != "meta" else None  # meta: a dry run
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(generator=g)
            if p.dim() == 1 and "norm" in name and not name.endswith("bias"):
                p.mul_(0.2).add_(1.0)  # norm scales: around 1, not constant
            else:
                fan_in = p[0].numel() if p.dim() > 1 else 16
                p.mul_(0.8 / math.sqrt(fan_in))
    # constructor-computed tensors (RoPE tables) from a one-block CPU build, parameters never initialised
    with _skip_init():
        reference = cls(**_one_block(config))
    ref = _constructor_tensors(reference)
    for name, dt in meta_dtypes.items():
        source = ref.get(name)
        if source is None:  # a block beyond the first: the same constructor, block 0's tensors
            parts = name.split(".")
            idx = next((i for i, s in enumerate(parts) if s.isdigit()), None)
            if idx is not None:
                source = ref.get(".".join(parts[:idx] + ["0"] + parts[idx + 1:]))
        if source is None:
            raise RuntimeError(f"{preset.cls}: no reference for the constructor tensor {name!r}")
        target_dtype = dt if source.is_floating_point() else source.dtype
        _set_tensor(model, name, source.to(device=device, dtype=target_dtype))
    del reference
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


def plan_cases(preset: DiTPreset, size: str, ns: Sequence[int], modes: Sequence[str] = MODES) -> List[Case]:
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

    c = preset.full if size == "full" else preset.tiny
    frames, rows, cols = preset.grid_full if size == "full" else preset.grid_tiny
    text = preset.text_full if size == "full" else preset.text_tiny
    if preset.cls == "FluxTransformer2DModel":
        return DiTShape(c["num_layers"] + c["num_single_layers"], c["num_attention_heads"], c["attention_head_dim"],
                        frames, rows, cols, text, c["patch_size"] ** 2 * (c.get("out_channels") or c["in_channels"]))
    if preset.cls == "WanTransformer3DModel":
        return DiTShape(c["num_layers"], c["num_attention_heads"], c["attention_head_dim"], frames, rows, cols, 0,
                        math.prod(c["patch_size"]) * c["out_channels"])
    return DiTShape(c["num_layers"], c["num_attention_heads"], c["attention_head_dim"], frames, rows, cols, text,
                    c["patch_size"] ** 2 * c["out_channels"])


def _cost_model_wire(preset: DiTPreset, size: str, case: Case, itemsize: int, cfg_inner: str = "gathered") -> int:
    """Bytes a rank sends per call by the runtime's cost model (``sampling.dit.step_cost``, ``split.split_cost``)."""
    from ..sampling.dit import step_cost
    from ..sampling.split import split_cost

    shape = dit_shape(preset, size)
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


# ------------------------------------------------------------------------------------------------ rank side


def _subcontext(world, members: List[int]):
    from .. import comm
    from ..context import ParallelContext

    if len(members) == 1:
        return ParallelContext.single(world.device)
    if len(members) == world.world_size:
        return world
    group = comm.new_group(members) if world.rank in members else None
    if group is None:
        return None
    return ParallelContext(group=group, rank=members.index(world.rank), world_size=len(members),
                           global_ranks=tuple(members), device=world.device, backend=world.backend)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _gloo_cuda_all_to_all(ctx):
    """Ulysses on CUDA ranks under gloo: hand CUDA tensors to gloo's own all-to-all (it copies through pinned host
    memory inside the call) instead of comm's default host staging around the call, whose copies would be billed
    to the rank's compute by the turn-taking clock. Yields the transport's name (recorded)."""
    from .. import comm
    from ..parallel import sequence as seq

    if not (ctx.device.type == "cuda" and ctx.backend == "gloo"):
        yield "default"
        return
    original = seq.all_to_all_equal
    state = {"direct": True}

    def direct(send, c):
        if state["direct"]:
            try:
                return comm.all_to_all_equal(send, c, stage_on_host=False)
            except (RuntimeError, NotImplementedError):  # raised before any transfer, the same on every rank
                state["direct"] = False
        return original(send, c)

    seq.all_to_all_equal = direct
    try:
        yield state
    finally:
        seq.all_to_all_equal = original


def _measure_case(ctx, layout, model, inputs, case: Case, warmup: int, iters: int, keep_output: bool,
                  cfg_inner: str = "gathered") -> Tuple[dict, Optional[torch.Tensor]]:
    """Run ``warmup + iters`` calls with the ranks taking turns; the first call is also the logged one.

    Returns this rank's measurements and, with ``keep_output``, the first call's output (fp32, on the host).
    """
    from ..comm import barrier, log_comm
    from ..sampling.dit import parallelize_dit
    from ..sampling.split import cfg_parallel
    from .measure import _read_peak, _reset_peak, take_turns

    device = ctx.device
    handle = None
    if case.mode in ("gathered", "ulysses"):
        handle = parallelize_dit(model, ctx, mode=case.mode)
        attention = case.mode

        def call():
            return model(**inputs[0])[0]
    elif case.mode == "cfg":
        inner = layout.inner
        attention = cfg_inner if inner.world_size > 1 else "none"
        if inner.world_size > 1:
            handle = parallelize_dit(model, inner, mode=cfg_inner)

        def call():
            return torch.stack(cfg_parallel(lambda c: model(**c)[0], inputs, layout))
    else:
        attention = "none"

        def call():
            return model(**inputs[0])[0]

    out: Dict[str, Any] = {"rank": ctx.rank, "attention": attention, "runs": [], "counted": None, "calls": None}
    output = None
    transport = (_gloo_cuda_all_to_all(ctx) if attention == "ulysses" else contextlib.nullcontext("default"))
    try:
        a2a = transport.__enter__()
        _reset_peak(device)
        with torch.no_grad():
            for i in range(warmup + iters):
                barrier(ctx)
                _sync(device)
                logging = log_comm() if i == 0 else contextlib.nullcontext(None)
                with logging as log, take_turns(ctx) as turns:
                    y = call()
                if i == 0:
                    out["counted"] = dict(log.bytes) if log is not None else {}
                    out["calls"] = int(log.total_calls) if log is not None else 0
                    out["finite"] = bool(torch.isfinite(y).all())
                    if keep_output:
                        output = y.detach().float().cpu()
                del y
                out["runs"].append(turns.to_dict())
        peak = _read_peak(device)
        out["peak_bytes"], out["peak_metric"] = peak["bytes"], peak["metric"]
        if isinstance(a2a, dict):
            out["all_to_all_transport"] = "gloo CUDA all-to-all" if a2a["direct"] else "host-staged (copies billed to compute)"
    finally:
        transport.__exit__(None, None, None)
        if handle is not None:
            handle.remove()
    return out, output


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


#: bf16 exactness bound for one call's output (relative L2); see ``docs/dit.md`` / results README for the reasoning
BF16_TOLERANCE = 5e-2
FP32_TOLERANCE = 1e-5


def _summarise(preset: DiTPreset, case: Case, per_rank: List[dict], warmup: int, ref_call_ms: Optional[float],
               size: str, itemsize: int) -> dict:
    from .linkmodel import LINK_PROFILES, summarise_alone

    calls = _calls_per_step(preset, case)
    timed = [r["runs"][warmup:] for r in per_rank]
    alone = summarise_alone(timed, case.n)
    counted: Dict[str, int] = {}
    for r in per_rank:
        for op, b in (r["counted"] or {}).items():
            counted[op] = max(counted.get(op, 0), int(b))
    first = [r["runs"][0] for r in per_rank]
    wire_call = max(sum(run["wire_bytes"]) for run in first)
    colls_call = max(len(run["wire_bytes"]) for run in first)
    link = {name: (v * calls if v is not None else None) for name, v in alone["link_model"].items()}
    ref_step = ref_call_ms * _reference_calls(preset, case) if ref_call_ms else None
    rec = {
        "preset": preset.name, "model": preset.title, "case": case.label, "n": case.n, "mode": case.mode,
        "attention": per_rank[0]["attention"], "status": "ok",
        "cfg_groups": 2 if case.mode == "cfg" else 1,
        "sequence_ranks": case.n // 2 if case.mode == "cfg" else case.n,
        "calls_per_step": calls,
        "step_definition": ("one call per step: each CFG group evaluates its branch, outputs exchanged once"
                            if case.mode == "cfg" else
                            ("two calls per step (cond, uncond), each the same kernels on the same shapes"
                             if calls == 2 else "one call per step (guidance-distilled)")),
        "compute_ms_per_call_alone": alone["compute_ms"],
        "compute_ms_per_call_alone_iterations": alone["compute_ms_iterations"],
        "compute_ms_per_call_by_rank": alone["compute_ms_by_rank"],
        "cpu_ms_per_call_alone": alone["cpu_compute_ms"],
        "compute_ms_per_step_alone": alone["compute_ms"] * calls if alone["compute_ms"] is not None else None,
        "stages_per_call": alone["stages"],
        "collectives_per_step": colls_call * calls,
        "counted_bytes_per_step": {op: b * calls for op, b in counted.items()},
        "wire_bytes_per_step": wire_call * calls,
        "comm_ms_measured_gloo_one_gpu": alone["comm_ms_measured"],
        "modelled": True,
        "modelled_step_ms": link,
        "reference_step_ms": ref_step,
        "speedup_modelled": {name: (round(ref_step / v, 3) if ref_step and v else None) for name, v in link.items()},
        "peak_gib_by_rank": [round(r["peak_bytes"] / _GIB, 3) if r.get("peak_bytes") else None for r in per_rank],
        "peak_metric": per_rank[0].get("peak_metric"),
        "finite": all(r.get("finite", False) for r in per_rank),
        "all_to_all_transport": per_rank[0].get("all_to_all_transport"),
        "iterations": {"warmup": warmup, "timed": len(timed[0])},
    }
    if case.n > 1:
        rec["cost_model_wire_bytes_per_step"] = calls * _cost_model_wire(preset, size, case, itemsize,
                                                                         per_rank[0]["attention"] if case.mode == "cfg" and case.n > 2 else "gathered")
    rec["link_profiles"] = {name: LINK_PROFILES[name]._asdict() for name in SHOWN_PROFILES}
    return rec


def _skipped(preset: DiTPreset, case: Case, status: str, why: str) -> dict:
    return {"preset": preset.name, "model": preset.title, "case": case.label, "n": case.n, "mode": case.mode,
            "status": status, "error": why, "modelled": True}


def _write_doc(path: Optional[str], doc: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=float)
    os.replace(tmp, path)


def _log(ctx, start: float, msg: str) -> None:
    if ctx.rank == 0:
        print(f"[dit_bench {time.time() - start:7.1f}s] {msg}", flush=True)


def _bench_rank(ctx, plan: dict) -> Optional[dict]:
    """Every preset and case on this rank (``ctx``: all W rank processes); rank 0 returns the records."""
    from ..comm import all_gather_object
    from ..sampling.split import RankGroups

    start = time.time()
    device = ctx.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan["dtype"]]
    itemsize = torch.tensor([], dtype=dtype).element_size()
    world = ctx.world_size
    ns = [n for n in plan["ns"] if n <= world]
    watchdog = float(plan.get("watchdog_s") or 0)
    if watchdog > 0:  # a rank that stops moving prints where it is (every rank, to stderr), then keeps waiting
        faulthandler.dump_traceback_later(watchdog, repeat=True, file=sys.stderr)
    # one group per member set: two groups of the same members get the same hashed name under local
    # synchronisation, so the sequence group of the first N/2 ranks is CFG x sequence's first inner group
    contexts: Dict[int, Any] = {}
    layouts = {}
    made: Dict[Tuple[int, ...], Any] = {}
    for n in sorted(ns, reverse=True):
        members = tuple(range(n))
        contexts[n] = made.get(members) or _subcontext(ctx, list(members))
        if n > 1 and n % 2 == 0 and "cfg" in plan["modes"] and contexts[n] is not None:
            layouts[n] = RankGroups(contexts[n], 2).layout
            inner = layouts[n].inner
            if inner.world_size > 1:
                made[tuple(inner.global_ranks)] = inner
    _log(ctx, start, f"groups ready for N in {ns}")
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    doc = dict(plan["doc"], records=[])
    for name in plan["presets"]:
        preset = PRESETS[name]
        warmup = plan["warmup"] if plan["warmup"] is not None else preset.warmup
        iters = plan["iters"] if plan["iters"] is not None else preset.iters
        weights = _weights_bytes(preset, plan["size"], itemsize)
        fit = max([n for n in ns if n <= ranks_that_fit(weights, total, world)] or [1])
        cases = plan_cases(preset, plan["size"], ns, plan["modes"])
        model = inputs = None
        _log(ctx, start, f"{name}: building on {fit} ranks")
        try:
            if ctx.rank < fit:
                if device.type == "cuda":
                    torch.cuda.set_per_process_memory_fraction(min(1.0, 0.97 / fit), device)
                model = build_random(preset, plan["size"], device, dtype, seed=0)
                inputs = make_inputs(preset, plan["size"], device, dtype, seed=1)
            built_err = None
        except Exception as exc:  # recorded; every rank still meets at the collective below
            built_err = f"{type(exc).__name__}: {exc}"
            model = inputs = None
        errs = all_gather_object(built_err, ctx)
        _log(ctx, start, f"{name}: {weights / _GIB:.1f} GiB of weights, built on {fit} of {world} ranks"
                         + (f"; build failed: {[e for e in errs if e]}" if any(errs) else ""))
        ref_call_ms = None
        ref_out: List[Optional[torch.Tensor]] = [None, None]
        for case in cases:
            if case.n > fit or any(errs):
                why = (f"does not fit: {case.n} full copies of {weights / _GIB:.1f} GiB + {_HEADROOM / _GIB:.0f} GiB "
                       f"head-room each exceed 97% of the device's {((total or 0) / _GIB):.0f} GiB; needs weight "
                       f"sharding (FSDP2)") if not any(errs) else f"build failed: {[e for e in errs if e][0]}"
                if ctx.rank == 0:
                    doc["records"].append(_skipped(preset, case, "not_run", why))
                    _write_doc(plan.get("out"), doc)
                continue
            go = all_gather_object(time.time() - start < plan["deadline_s"], ctx)[0]
            if not go:
                if ctx.rank == 0:
                    doc["records"].append(_skipped(preset, case, "skipped", f"deadline ({plan['deadline_s']} s) reached"))
                    _write_doc(plan.get("out"), doc)
                continue
            local, output, err = None, None, None
            if ctx.rank < case.n:
                try:
                    local, output = _measure_case(contexts[case.n], layouts.get(case.n), model, inputs, case, warmup,
                                                  iters, keep_output=ctx.rank == 0, cfg_inner=plan["cfg_inner"])
                    if case.mode == "none" and ctx.rank == 0 and (preset.cfg or "cfg" in plan["modes"]):
                        with torch.no_grad():  # the uncond branch of the reference, for the CFG rows' check
                            ref_out[1] = model(**inputs[1])[0].float().cpu()
                except Exception as exc:
                    err = f"{type(exc).__name__}: {exc}"
                    local = {"error": err, "traceback": traceback.format_exc()[-3000:]}
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            gathered = all_gather_object(local, ctx)[: case.n]
            if ctx.rank != 0:
                continue
            failed = [g for g in gathered if g is None or g.get("error")]
            if failed:
                rec = _skipped(preset, case, "error", (failed[0] or {}).get("error", "no result"))
                rec["traceback"] = (failed[0] or {}).get("traceback")
            else:
                rec = _summarise(preset, case, gathered, warmup, ref_call_ms, plan["size"], itemsize)
                if case.mode == "none":
                    ref_call_ms = rec["compute_ms_per_call_alone"]
                    ref_out[0] = output
                    rec["reference_step_ms"] = ref_call_ms * _reference_calls(preset, case)
                    rec["speedup_modelled"] = {k: round(rec["reference_step_ms"] / v, 3) for k, v in rec["modelled_step_ms"].items()}
                elif output is not None and ref_out[0] is not None:
                    tol = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
                    if case.mode == "cfg":
                        rels = [_rel_l2(output[0], ref_out[0])] + ([_rel_l2(output[1], ref_out[1])] if ref_out[1] is not None else [])
                    else:
                        rels = [_rel_l2(output, ref_out[0])]
                    rel = max(rels)
                    rec["exactness"] = {"rel_l2_vs_n1": rel, "rel_l2_by_branch": rels, "tolerance": tol,
                                        "ok": bool(rel <= tol and rec["finite"]), "dtype": plan["dtype"]}
            doc["records"].append(rec)
            _write_doc(plan.get("out"), doc)
            _log(ctx, start, f"{name} {case.label}: " + (
                f"compute/call {rec['compute_ms_per_call_alone']:.1f} ms alone, wire {rec['wire_bytes_per_step'] / 1e6:.1f} MB/step, "
                f"modelled speed-up nvlink {rec['speedup_modelled'].get('nvlink')} pcie-no-p2p "
                f"{rec['speedup_modelled'].get('pcie4_x16_no_p2p')}, rel {rec.get('exactness', {}).get('rel_l2_vs_n1')}, "
                f"peak GiB {rec['peak_gib_by_rank']}" if rec["status"] == "ok" else f"{rec['status']}: {rec['error']}"))
        del model, inputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        all_gather_object(None, ctx)  # every rank freed its copy before the next preset is built
    if watchdog > 0:
        faulthandler.cancel_dump_traceback_later()
    return doc if ctx.rank == 0 else None


# ------------------------------------------------------------------------------------------------ estimate (no device)

#: one rank's full call (batch 1, bf16) on an H200: FLUX.1 measured alone by this benchmark (results/h200/dit);
#: Wan 2.1 14B and Qwen-Image from plain single-GPU diffusers runs of the same configurations on an H200 (2026-11-29;
#: Wan later measured alone by this benchmark at 3,289 ms, results/h200/dit/dit_wan.json)
BASELINE_CALL_MS = {"flux1_1024": 172.3, "wan21_14b_480x832x81": 3230.0, "qwen_image_1328": 347.0}


def token_share(preset: DiTPreset, n: int, size: str = "full") -> float:
    """The busiest rank's share of a call's tokens: its band of image token rows plus the replicated text tokens."""
    shape = dit_shape(preset, size)
    band = -(-shape.rows // n)
    return (shape.frames * band * shape.cols + shape.text) / (shape.frames * shape.rows * shape.cols + shape.text)


def estimate(presets: Sequence[str], ns: Sequence[int] = (1, 2, 4), modes: Sequence[str] = MODES, *,
             cfg_inner: str = "gathered", itemsize: int = 2, call_ms: Optional[Dict[str, float]] = None) -> dict:
    """Step latency ESTIMATED without a device: ``calls x (share x one rank's call + link time of the call's bytes)``.

    The compute is one rank's measured full call (:data:`BASELINE_CALL_MS`) times the busiest rank's token share
    (:func:`token_share`; every linear layer and every query of attention scales with it, keys stay full), which
    assumes per-rank compute proportional to its tokens: it ignores launch overhead and the lower efficiency of
    smaller matrices, so it is an upper bound of the speed-up. The bytes are the runtime's cost model
    (``sampling.dit.step_cost``, ``split.split_cost``), which the measured runs match exactly.
    """
    from ..sampling.dit import step_cost
    from ..sampling.split import split_cost
    from ..topology.links import LINK_PROFILES, model_latency_ms

    call_ms = dict(BASELINE_CALL_MS, **(call_ms or {}))
    rows = []
    for name in presets:
        preset = PRESETS[name]
        base = call_ms[name]
        shape = dit_shape(preset, "full")
        for case in plan_cases(preset, "full", ns, modes):
            calls = _calls_per_step(preset, case)
            ref = base * _reference_calls(preset, case)
            if case.mode == "cfg":
                m = case.n // 2
                inner = step_cost(shape, m, cfg_inner, itemsize=itemsize) if m > 1 else {"wire_bytes": 0, "messages": 0}
                ex = split_cost((shape.frames * shape.rows * shape.cols * shape.out_features,), itemsize, 2, 2)
                compute, wire, msgs = token_share(preset, m) * base, inner["wire_bytes"] + ex["wire_bytes"], inner["messages"] + ex["messages"]
            elif case.mode == "none":
                compute, wire, msgs = base, 0, 0
            else:
                cost = step_cost(shape, case.n, case.mode, itemsize=itemsize)
                compute, wire, msgs = token_share(preset, case.n) * base, cost["wire_bytes"], cost["messages"]
            step = {p: round(calls * model_latency_ms(compute, wire, msgs, p), 1) for p in LINK_PROFILES}
            rows.append({"preset": name, "model": preset.title, "case": case.label, "n": case.n, "mode": case.mode,
                         "calls_per_step": calls, "compute_ms_per_call": round(compute, 1),
                         "wire_bytes_per_step": calls * wire, "reference_step_ms": ref, "estimated_step_ms": step,
                         "speedup_estimated": {p: round(ref / v, 3) for p, v in step.items()}, "estimate": True})
    return {"benchmark": "dit-bench-estimate", "estimate": True, "cfg_inner": cfg_inner, "call_ms": call_ms,
            "method": estimate.__doc__.split("\n\n")[0] + " " + " ".join(estimate.__doc__.split("\n\n")[1].split()),
            "rows": rows}


def format_estimate(doc: dict) -> str:
    lines = [f"{'preset':22s} {'case':18s} {'compute/call ms':>15s} {'GB/step':>8s} {'nvlink ms':>10s} {'x':>6s} "
             f"{'pcie-noP2P ms':>13s} {'x':>6s}  (ESTIMATED: share x one rank's call + link model)"]
    for r in doc["rows"]:
        e, s = r["estimated_step_ms"], r["speedup_estimated"]
        lines.append(f"{r['preset']:22s} {r['case']:18s} {r['compute_ms_per_call']:15.1f} {r['wire_bytes_per_step'] / 1e9:8.2f} "
                     f"{e['nvlink']:10.1f} {s['nvlink']:6.2f} {e['pcie4_x16_no_p2p']:13.1f} {s['pcie4_x16_no_p2p']:6.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ driver, report


def run_dit_bench(presets: Sequence[str], *, ranks: int = 4, ns: Sequence[int] = (1, 2, 4), modes: Sequence[str] = MODES,
                  size: str = "full", device: str = "cuda", dtype: Optional[str] = None, warmup: Optional[int] = None,
                  iters: Optional[int] = None, deadline_s: float = 1e9, out: Optional[str] = None,
                  timeout_s: float = 900.0, watchdog_s: float = 0.0, cfg_inner: str = "gathered") -> dict:
    """Run the benchmark on ``ranks`` spawned rank processes (gloo) and return the report (see the module docstring).

    Raises:
        ValueError: an unknown preset or mode, a rank count below 1, or ``ns`` above ``ranks`` (before any rank starts).
    """
    from ..spawn import run_ranks

    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown preset {unknown[0]!r}; choose from {sorted(PRESETS)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode {bad[0]!r}; choose from {list(MODES)}")
    if ranks < 1 or any(n < 1 or n > ranks for n in ns):
        raise ValueError(f"every N in --ns must be between 1 and --ranks ({ranks}); got {list(ns)}")
    if cfg_inner not in ("gathered", "ulysses"):
        raise ValueError(f"cfg_inner must be 'gathered' or 'ulysses' (got {cfg_inner!r})")
    if size not in ("full", "tiny"):
        raise ValueError(f"size must be 'full' or 'tiny' (got {size!r})")
    kind = "cuda" if device == "cuda" else "cpu"
    dtype = dtype or ("bf16" if kind == "cuda" else "fp32")
    doc = {
        "benchmark": "dit-bench",
        "schema": 1,
        "size": size,
        "dtype": dtype,
        "device": kind,
        "ranks_on_one_device": ranks,
        "backend": "gloo",
        "presets": list(presets),
        "ns": list(ns),
        "modes": list(modes),
        "cfg_inner": cfg_inner,
        "modelled": ["records[].modelled_step_ms", "records[].speedup_modelled"],
        "method": ("N rank processes share one device (gloo). compute: each rank's compute per call measured alone "
                   "(ranks take turns between collectives; CUDA events on GPU), per stage the slowest rank. modelled "
                   "step latency = calls_per_step x (sum over stages of the slowest rank's compute + per collective "
                   "the slowest rank's latency + wire_bytes / bandwidth, doubled when staged through host). "
                   "speed-up = N=1 reference step (measured alone) / modelled step. Peak memory: "
                   "torch.cuda.max_memory_allocated per rank process, weights included."),
        "exactness_note": ("relative L2 of one call's output vs N=1's on the same inputs. bf16 tolerance "
                           f"{BF16_TOLERANCE:g}: bands change only the row count of every GEMM (kernel tiling) and the "
                           "order of the softmax sum over keys, each a rounding of unit 2^-8 = 3.9e-3 per operation; "
                           "uncorrelated over 40-60 residual blocks they stay below ~sqrt(L) x 3.9e-3 = 2.5e-2 to 3e-2, "
                           "while a structural error (wrong band, missing K/V, misplaced RoPE) is of the order of "
                           f"the output itself (> 0.3). fp32 tolerance {FP32_TOLERANCE:g}."),
        "goals": {"nvlink": "speed-up >= 1.9 at 2 ranks, >= 3.6 at 4 (FLUX.1, Wan 2.1)",
                  "pcie4_x16_no_p2p": "CFG-parallel >= 1.9 at 2 ranks"},
    }
    plan = dict(presets=list(presets), ns=sorted(set(ns)), modes=list(modes), size=size, dtype=dtype, warmup=warmup,
                iters=iters, deadline_s=deadline_s, out=out, doc=doc, watchdog_s=watchdog_s, cfg_inner=cfg_inner)
    started = time.time()
    results = run_ranks(_bench_rank, ranks, plan, device=kind, backend="gloo", timeout_s=timeout_s)
    print(f"[dit_bench] ranks done after {time.time() - started:.1f} s", flush=True)
    report = results[0]
    report["wall_s"] = round(time.time() - started, 1)
    try:
        from . import provenance

        report["provenance"] = provenance.collect(torch.device(kind))
    except Exception as exc:  # provenance is informative only
        report["provenance"] = {"error": f"{type(exc).__name__}: {exc}"}
    _write_doc(out, report)
    return report


def format_table(report: dict) -> str:
    """One line per record: compute alone, bytes, modelled step and speed-up (NVLink, PCIe 4.0 x16 no P2P), memory."""
    lines = [f"{'preset':22s} {'case':18s} {'compute/step ms':>15s} {'GB/step':>8s} "
             f"{'nvlink ms':>10s} {'x':>6s} {'pcie-noP2P ms':>13s} {'x':>6s} {'peak GiB':>9s} {'rel L2':>9s}  (modelled)"]
    for r in report.get("records", []):
        if r.get("status") != "ok":
            lines.append(f"{r['preset']:22s} {r['case']:18s} {r['status']}: {r.get('error', '')[:90]}")
            continue
        m, s = r["modelled_step_ms"], r["speedup_modelled"]
        rel = (r.get("exactness") or {}).get("rel_l2_vs_n1")
        lines.append(
            f"{r['preset']:22s} {r['case']:18s} {r['compute_ms_per_step_alone']:15.1f} {r['wire_bytes_per_step'] / 1e9:8.2f} "
            f"{m['nvlink']:10.1f} {s['nvlink']:6.2f} {m['pcie4_x16_no_p2p']:13.1f} {s['pcie4_x16_no_p2p']:6.2f} "
            f"{max(p for p in r['peak_gib_by_rank'] if p is not None) if any(r['peak_gib_by_rank']) else float('nan'):9.2f} "
            f"{rel if rel is not None else float('nan'):9.2e}")
    return "\n".join(lines)


def write_chart(report: dict, path: str) -> str:
    """Per preset: modelled speed-up per case (NVLink, PCIe 4.0 x16 no P2P) with the goals, and bytes per step.

    An :func:`estimate` document is drawn the same way, every title saying ESTIMATED.
    """
    if report.get("estimate"):
        label = "ESTIMATED"
        report = {"records": [dict(r, status="ok", speedup_modelled=r["speedup_estimated"]) for r in report["rows"]],
                  "suptitle": "PatchRay DiT modes: step latency ESTIMATED (one rank's measured call x the busiest rank's "
                              "token share + the cost model's bytes over the link); not a per-rank measurement"}
    else:
        label = "MODELLED"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_preset: Dict[str, List[dict]] = {}
    for r in report.get("records", []):
        by_preset.setdefault(r["preset"], []).append(r)
    # a preset none of whose cases ran is named in the title, not drawn as a row of empty bars
    unmeasured = [name for name, recs in by_preset.items() if not any(r.get("status") == "ok" for r in recs)]
    by_preset = {name: recs for name, recs in by_preset.items() if name not in unmeasured}
    if not by_preset:
        raise ValueError("no measured records to chart")
    rows = len(by_preset)
    fig, axes = plt.subplots(rows, 2, figsize=(15, 3.2 * rows + 1.0), squeeze=False)
    colors = {"nvlink": "#2b6cb0", "pcie4_x16_no_p2p": "#dd6b20"}
    for row, (name, recs) in enumerate(by_preset.items()):
        ax, bx = axes[row]
        labels = [r["case"] for r in recs]
        xs = list(range(len(recs)))
        width = 0.38
        for j, prof in enumerate(SHOWN_PROFILES):
            vals = [(r.get("speedup_modelled") or {}).get(prof) if r.get("status") == "ok" else None for r in recs]
            for x, v, r in zip(xs, vals, recs):
                pos = x + (j - 0.5) * width
                if v is None:
                    ax.bar(pos, 0.3, width, color="none", edgecolor="#b22222", hatch="//")
                    if j == 0:
                        ax.text(x, 0.35, r.get("status", "n/a"), ha="center", fontsize=7, color="#b22222", rotation=90)
                else:
                    ax.bar(pos, v, width, color=colors[prof], label=prof if x == 0 else None)
                    ax.text(pos, v + 0.05, f"{v:.2f}", ha="center", fontsize=7)
        for n, goal in GOALS["nvlink"].items():
            ax.axhline(goal, color=colors["nvlink"], ls=":", lw=0.8)
            ax.text(len(recs) - 0.5, goal, f"NVLink goal {goal} (N={n})", fontsize=7, va="bottom", ha="right")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(f"speed-up per step ({label})")
        ax.set_title(f"{recs[0].get('model', name)}: {label} speed-up over one rank's step", fontsize=9)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in SHOWN_PROFILES]
        ax.legend(handles, ["NVLink (H200)", "PCIe 4.0 x16, no P2P"], fontsize=7, loc="upper left")
        gb = [r.get("wire_bytes_per_step", 0) / 1e9 if r.get("status") == "ok" else 0 for r in recs]
        bx.bar(xs, gb, color="#4a5568")
        for x, v in zip(xs, gb):
            bx.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        bx.set_xticks(xs)
        bx.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        bx.set_ylabel("GB a rank sends per step")
        bx.set_title("bytes per step (comm accounting, busiest rank)", fontsize=9)
    title = report.get("suptitle") or ("PatchRay DiT modes: compute measured alone on one device, link latency "
                                       f"MODELLED ({report.get('dtype')}, {report.get('size')} size, "
                                       f"{report.get('ranks_on_one_device')} ranks on one device)")
    if unmeasured:
        title += f"\nnot run: {', '.join(unmeasured)} (see the JSON's status)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patchray.distributed.bench.dit_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", default=None, help=f"preset(s) (repeatable); default all: {', '.join(PRESETS)}")
    ap.add_argument("--ranks", type=int, default=4, help="rank processes on the one device (the largest N)")
    ap.add_argument("--ns", default="1,2,4", help="rank counts to measure, comma-separated (each <= --ranks)")
    ap.add_argument("--mode", action="append", default=None, help=f"modes (repeatable); default all: {', '.join(MODES)}")
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls per case (default per preset)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default per preset)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip the cases that would start after this many seconds")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on every collective and on the whole run")
    ap.add_argument("--cfg-inner", choices=["gathered", "ulysses"], default="gathered",
                    help="attention mode inside each CFG group when N > 2 (CFG x sequence)")
    ap.add_argument("--estimate", action="store_true",
                    help="no ranks, no device: the step latency ESTIMATED from one rank's measured call (BASELINE_CALL_MS) "
                         "x the busiest rank's token share, plus the cost model's bytes over each link profile")
    ap.add_argument("--watchdog-s", type=float, default=0.0,
                    help="every rank prints its stack to stderr after this many seconds, repeatedly (0: off)")
    ap.add_argument("--out", help="JSON report path (written after every case); the chart goes next to it (.png)")
    ap.add_argument("--chart-from", help="only redraw the chart (and print the table) of an existing JSON report")
    args = ap.parse_args(argv)
    if args.chart_from:
        with open(args.chart_from) as f:
            report = json.load(f)
        png = write_chart(report, os.path.splitext(args.out or args.chart_from)[0] + ".png")
        print(format_estimate(report) if report.get("estimate") else format_table(report))
        print(f"wrote {png}")
        return 0
    presets = [p for item in (args.preset or list(PRESETS)) for p in item.split(",") if p]
    modes = [m for item in (args.mode or list(MODES)) for m in item.split(",") if m]
    ns = [int(x) for x in args.ns.split(",") if x]
    if args.estimate:
        doc = estimate(presets, ns, modes, cfg_inner=args.cfg_inner)
        print(format_estimate(doc))
        if args.out:
            _write_doc(args.out, doc)
            print(f"wrote {args.out} and {write_chart(doc, os.path.splitext(args.out)[0] + '.png')}")
        return 0
    report = run_dit_bench(presets, ranks=args.ranks, ns=ns, modes=modes, size=args.size, device=args.device,
                           dtype=args.dtype, warmup=args.warmup, iters=args.iters, deadline_s=args.deadline_s,
                           out=args.out, timeout_s=args.timeout_s, watchdog_s=args.watchdog_s, cfg_inner=args.cfg_inner)
    print(format_table(report))
    if args.out:
        try:
            png = write_chart(report, os.path.splitext(args.out)[0] + ".png")
            print(f"wrote {args.out} and {png}")
        except ImportError as exc:  # a device image without matplotlib: redraw later with --chart-from
            print(f"wrote {args.out}; no chart ({exc}); redraw with --chart-from {args.out}")
    bad = [r for r in report["records"] if r.get("status") == "error" or not (r.get("exactness") or {}).get("ok", True)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
