"""Per-call compute of the rig model: PatchRay's per-rank compute measured on one H200, scaled to a shape and a card.

Design decisions (the rule, stated once; docs/rig-model.md repeats it):

* **The basis is measured.** One model call on the H200 (``results/h200/dit/``): FLUX.1-dev at 1024x1024 from each
  rank's profiled kernels (eager: ``issue/kernel_model_eager.json``; compiled blocks and attention:
  ``modulation/call3/kernel_model_after.json``), Wan 2.1 14B at 480x832x81 and Qwen-Image at 1328x1328 from each
  rank's compute measured alone (``dit_wan.json``; ``issue/dit_qwen_issue.json``), at N = 1 and per rank at N = 2
  (and 4). :data:`H200_BASIS` holds the figures; the CI test reads them back from those files.
* **Three parts, three scalings.** The N = 1 call splits into GEMMs, fused attention kernels and the rest (norms,
  element-wise, copies, concatenations, GEMVs: memory-bound). For FLUX.1 the split is the kernel profile's
  (``kernel_parts``: GEMMs by tile, the fused attention kernels by name, the rest memory-bound); Wan and Qwen-Image
  have no profile, so their memory-bound part is FLUX.1's eager memory-bound time per token x width x block times
  theirs (element-wise work grows with the activations it touches), and the rest is split between GEMMs and attention
  in the ratio of their FLOPs at FLUX.1's measured GEMM and attention rates. On another card: the GEMMs scale by the
  ratio of dense tensor throughputs (bf16, or fp8 for ``--weights fp8`` where the card has FP8 tensor cores), the
  attention by the bf16 ratio (attention runs in bf16 whatever the weights), the memory-bound part by the ratio of
  memory bandwidths. Why: a GEMM or a flash-attention kernel of these sizes runs at a near-constant fraction of a
  card's tensor peak, an element-wise kernel at a near-constant fraction of its memory bandwidth; cards differ in
  FLOP per byte (dense bf16 per byte of bandwidth: H200 206, RTX 4090 164, RTX 5090 117, RTX 3090 76), so one FLOP
  ratio would misplace the memory-bound 40 % of an eager FLUX.1 call (15 % compiled).
* **Shape**: at another resolution the GEMM part scales with the linear layers' FLOPs (tokens), the attention part
  with the attention FLOPs (tokens squared), the memory-bound part with the tokens (:func:`call_flops`).
* **Ranks**: a sequence rank computes the busiest rank's token share times the overhead measured at that N on the
  H200 (measured per-rank / (N = 1 x share): smaller GEMMs, non-shrinking work); an N not measured takes the largest
  measured N below it.
* **fp8 weights stored, bf16 GEMMs** (``fp8-storage``; ComfyUI's default for fp8 checkpoints, and ``fp8`` on a card
  without FP8 tensor cores): each call casts every weight (read 1 byte, write 2) before the GEMM reads it: 3 bytes per
  parameter at the card's memory bandwidth, every rank the whole model.
* **The CPU's issue time** bounds an eager call: diffusers' own FLUX.1 / Qwen-Image forward needs 141 / 170 ms of the
  H200 host's CPU per call (``issue_time.json``), whatever the GPU; a call takes the longer of its GPU time and that
  (Wan: FLUX.1's per block times 40 blocks, not measured). Compiled blocks: no issue time was measured; none applied.
"""

from __future__ import annotations

import math
import re
from typing import Dict, NamedTuple, Optional, Tuple

from ..sampling.dit_traffic import DiTShape, modulation_features, token_share
from .rig_cards import REFERENCE_CARD, CardProfile

__all__ = [
    "RigModel", "MODELS", "get_model", "model_shape", "call_flops", "kernel_parts", "H200_BASIS", "basis",
    "h200_call_parts", "card_call_ms", "rank_overhead", "rank_call_ms", "activation_gib", "vae_decode_ms",
    "WEIGHTS", "weight_bytes_per_param", "gemm_tflops", "casts_weights", "cast_ms", "issue_floor_ms", "RULE",
    "describe_rule",
]

GIB = 1024**3


class RigModel(NamedTuple):
    """A diffusion transformer the rig model knows.

    Args:
        key, title: the ``--model`` name and its title.
        basis: the key of :data:`H200_BASIS` whose measurements it uses (Wan 2.2 A14B: each expert is Wan 2.1 14B's
            architecture).
        params, block_params, largest_block_params: parameters of the whole transformer, of its blocks, of its
            largest block (counted on the meta device from the released configs, ``bench/dit_models.PRESETS``).
        layers, heads, head_dim, dim: attention calls per forward, heads, head width, model width.
        text: text tokens in the joint sequence (0: text by cross-attention).
        cross_text: text tokens of the cross-attention (Wan), else 0.
        ffn: FFN width (Wan), else 0 (FLUX.1 / Qwen-Image: 4 x dim inside their 12 dim^2 per token).
        patch_frames: latent frames per token frame (1) and ``temporal``: the VAE's temporal ratio (Wan: 4; 0 for
            images).
        calls_per_step: 1 (FLUX.1-dev is guidance-distilled) or 2 (cond and uncond).
        steps: default steps.
        base: ``(height, width, frames)`` the basis was measured at.
        vae: ``(family, height, width, frames, ms)``: the VAE decode measured on the H200 (baselines-h200.md).
    """

    key: str
    title: str
    basis: str
    params: int
    block_params: int
    largest_block_params: int
    layers: int
    heads: int
    head_dim: int
    dim: int
    text: int
    cross_text: int
    ffn: int
    temporal: int
    calls_per_step: int
    steps: int
    base: Tuple[int, int, int]
    vae: Tuple[str, int, int, int, float]


MODELS: Dict[str, RigModel] = {
    m.key: m
    for m in (
        RigModel("flux1", "FLUX.1-dev transformer (11.9 B)", "flux1", 11901408320, 11837283328, 339831296,
                 57, 24, 128, 3072, 512, 0, 0, 0, 1, 28, (1024, 1024, 1), ("kl", 1024, 1024, 1, 85.0)),
        RigModel("wan21_14b", "Wan 2.1 14B transformer (14.3 B; T2V, I2V counted alike)", "wan21_14b", 14288491584,
                 14055772160, 351394304, 40, 40, 128, 5120, 0, 512, 13824, 4, 2, 50, (480, 832, 81),
                 ("wan", 480, 832, 81, 1821.0)),
        RigModel("wan22_a14b", "Wan 2.2 A14B (two 14.3 B experts, one resident at a time)", "wan21_14b", 14288491584,
                 14055772160, 351394304, 40, 40, 128, 5120, 0, 512, 13824, 4, 2, 40, (480, 832, 81),
                 ("wan", 480, 832, 81, 1821.0)),
        RigModel("qwen_image", "Qwen-Image transformer (20.4 B)", "qwen_image", 20430401088, 20389877760, 339831296,
                 60, 24, 128, 3072, 256, 0, 0, 0, 2, 50, (1328, 1328, 1), ("qwen_image", 1024, 1024, 1, 68.0)),
    )
}


def get_model(key) -> RigModel:
    """A model by key; ``ValueError`` naming the valid keys otherwise."""
    if isinstance(key, RigModel):
        return key
    try:
        return MODELS[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {key!r}; valid models: {', '.join(MODELS)}") from None


def model_shape(model: RigModel, height: int, width: int, frames: int = 1) -> DiTShape:
    """The token grid of one call at ``height x width (x frames)``: latent /8 (VAE), tokens 2x2 (patch), video frames
    ``(frames - 1) / 4 + 1`` (Wan). ``ValueError`` for a size the model cannot take."""
    h, w, f = int(height), int(width), int(frames)
    if h <= 0 or w <= 0 or h % 16 or w % 16:
        raise ValueError(f"height and width must be positive multiples of 16 (got {h}x{w})")
    if model.temporal:
        if f < 1 or (f - 1) % model.temporal:
            raise ValueError(f"{model.title}: frames must be 1 + {model.temporal}k (got {f})")
        t = (f - 1) // model.temporal + 1
    else:
        if f != 1:
            raise ValueError(f"{model.title} makes images: frames must be 1 (got {f})")
        t = 1
    if model.basis == "flux1":
        mod = modulation_features(19, 38, model.dim)
    elif model.basis == "qwen_image":
        mod = modulation_features(60, 0, model.dim)
    else:
        mod = ()
    return DiTShape(model.layers, model.heads, model.head_dim, t, h // 16, w // 16, model.text, 64, mod)


def _tokens(shape: DiTShape) -> int:
    return shape.frames * shape.rows * shape.cols + shape.text


def call_flops(model: RigModel, shape: DiTShape) -> Tuple[float, float]:
    """``(linear, attention)`` FLOPs of one call (2 per multiply-add), the blocks only.

    FLUX.1 and Qwen-Image: every token (image and text) passes 12 dim^2 of linear weights per block (q, k, v, out: 4;
    MLP 4x: 8), the joint attention ``4 S^2 dim`` per layer. Wan: per video token and block 4 dim^2 (self-attention)
    + 2 dim^2 (cross-attention q, out) + 2 dim ffn, the text's cross k, v 2 dim^2 per text token; self-attention
    ``4 S^2 dim``, cross-attention ``4 S T dim`` per block.
    """
    s = _tokens(shape)
    d = model.dim
    if model.ffn:
        video = shape.frames * shape.rows * shape.cols
        linear = 2.0 * model.layers * (video * (6 * d * d + 2 * d * model.ffn) + model.cross_text * 2 * d * d)
        attention = 4.0 * model.layers * d * (video * video + video * model.cross_text)
        return linear, attention
    return 2.0 * model.layers * s * 12 * d * d, 4.0 * model.layers * d * s * s


# ----------------------------------------------------------------------------------------------------------------------
# the measured basis

#: fused attention kernels (``tools/dit_kernel_model.py``'s list)
_FUSED_ATTENTION = ("sdpa", "flash_fwd", "fmha", "efficient_attention", "flash_fprop")
#: a GEMM tile with 8 or 16 columns: a GEMV (the modulation layers' one-row products), memory-bound
_GEMV_TILE = re.compile(r"_\d+x(8|16)_")


def kernel_parts(summary: dict) -> Dict[str, float]:
    """``{gemm, attention, memory}`` ms of one profiled call (a ``kernel_profile`` summary: ``gpu_ms_without_spin``
    and its ``top`` kernels): GEMMs of the ``gemm`` class except GEMV tiles and split-K reductions, the fused attention
    kernels by name, and the rest of the call's kernel time (memory-bound)."""
    gemm = attention = 0.0
    for k in summary["top"]:
        name = k["name"]
        if any(a in name for a in _FUSED_ATTENTION):
            attention += k["ms"]
        elif k["class"] == "gemm" and not _GEMV_TILE.search(name) and "splitKreduce" not in name:
            gemm += k["ms"]
    total = float(summary["gpu_ms_without_spin"])
    return {"gemm": round(gemm, 3), "attention": round(attention, 3), "memory": round(total - gemm - attention, 3)}


#: PatchRay's compute per model call on one H200 (ms), N = 1 and the slowest rank at N ranks; ``parts``: the N = 1
#: call's kernels by :func:`kernel_parts` (FLUX.1 only); ``peak_gib``: per-rank peak allocated (weights included);
#: ``issue_ms``: the CPU's issue time of one call (diffusers' forward, ``issue_time.json``, median of three)
H200_BASIS: Dict[str, Dict[str, dict]] = {
    "flux1": {
        "eager": {
            "n1_ms": 167.1, "ranks_ms": {2: 88.3, 4: 48.2},
            "parts": {"gemm": 76.99, "attention": 23.373, "memory": 66.725},
            "issue_ms": 140.71,
            "sources": ["results/h200/dit/issue/kernel_model_eager.json (kernel_ms_per_call_by_rank, gathered)",
                        "results/h200/dit/issue/prof/flux1_1024_N=1_r0.json (kernels by class)",
                        "results/h200/dit/issue_time.json (block_issue_ms)"],
        },
        "compiled": {
            "n1_ms": 120.6, "ranks_ms": {2: 65.8, 4: 36.7},
            "parts": {"gemm": 77.84, "attention": 24.291, "memory": 18.464},
            "issue_ms": None,
            "sources": ["results/h200/dit/modulation/call3/kernel_model_after.json (kernel_ms_per_call_by_rank, "
                        "overlapped, blocks and attention compiled)",
                        "results/h200/dit/modulation/call3/prof_after/flux1_1024_N=1_r0.json (kernels by class)"],
        },
        "peak_gib": {1: 22.666, 2: 22.493, 4: 22.397},
        "peak_sources": ["results/h200/dit/issue/dit_flux_issue.json (peak_gib_by_rank)"],
    },
    "wan21_14b": {
        "eager": {
            "n1_ms": 3289.4241, "ranks_ms": {2: 1608.4696, 4: 856.0412},
            "parts": None,
            "issue_ms": None,  # not measured: FLUX.1's per block x 40 (see issue_floor_ms)
            "sources": ["results/h200/dit/dit_wan.json (compute_ms_per_call_alone: N=1, seq-ulysses N=2, N=4)"],
        },
        "peak_gib": {1: 30.263, 2: 30.092, 4: 28.54},
        "peak_sources": ["results/h200/dit/dit_wan.json (peak_gib_by_rank)"],
    },
    "qwen_image": {
        "eager": {
            "n1_ms": 312.29415, "ranks_ms": {2: 170.3126},
            "parts": None,
            "issue_ms": 170.07,
            "sources": ["results/h200/dit/issue/dit_qwen_issue.json (gpu_ms_per_call_alone: N=1, seq-gathered N=2; "
                        "the N = 2 figure still holds part of gloo's host staging: an upper bound)",
                        "results/h200/dit/issue_time.json (block_issue_ms)"],
        },
        "peak_gib": {1: 38.704, 2: 38.532},
        "peak_sources": ["results/h200/dit/issue/dit_qwen_issue.json (peak_gib_by_rank)"],
    },
}


def basis(model: RigModel, kernels: str = "eager") -> dict:
    """The measured basis of ``model`` for ``kernels`` (``eager`` or ``compiled``; only FLUX.1 has compiled kernels)."""
    b = H200_BASIS[model.basis]
    if kernels not in b:
        have = [k for k in ("eager", "compiled") if k in b]
        raise ValueError(f"{model.title}: no {kernels!r} kernels were measured on the H200; valid: {', '.join(have)}")
    return b[kernels]


def _base_shape(model: RigModel) -> DiTShape:
    return model_shape(model, *model.base)


def h200_call_parts(model: RigModel, shape: DiTShape, kernels: str = "eager") -> Dict[str, float]:
    """``{gemm, attention, memory}`` ms of one whole call (N = 1) on the H200 at ``shape`` (the module's rule)."""
    b = basis(model, kernels)
    base = _base_shape(model)
    lin0, att0 = call_flops(model, base)
    if b["parts"] is not None:
        parts = dict(b["parts"])
    else:
        flux = MODELS["flux1"]
        fb = H200_BASIS["flux1"]["eager"]["parts"]
        fshape = _base_shape(flux)
        flin, fatt = call_flops(flux, fshape)
        per_unit = fb["memory"] / (_tokens(fshape) * flux.dim * flux.layers)
        mem = per_unit * _tokens(base) * model.dim * model.layers
        t_gemm, t_att = lin0 / (flin / fb["gemm"]), att0 / (fatt / fb["attention"])
        rest = b["n1_ms"] - mem
        parts = {"gemm": rest * t_gemm / (t_gemm + t_att), "attention": rest * t_att / (t_gemm + t_att), "memory": mem}
    lin, att = call_flops(model, shape)
    return {"gemm": parts["gemm"] * lin / lin0, "attention": parts["attention"] * att / att0,
            "memory": parts["memory"] * _tokens(shape) / _tokens(base)}


#: ``--weights``: bytes per parameter and whether the GEMMs run in fp8
WEIGHTS: Dict[str, Tuple[int, bool]] = {"bf16": (2, False), "fp8": (1, True), "fp8-storage": (1, False)}


def weight_bytes_per_param(weights: str) -> int:
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; valid: {', '.join(WEIGHTS)}")
    return WEIGHTS[weights][0]


def gemm_tflops(card: CardProfile, weights: str) -> float:
    """The dense tensor rate the GEMMs run at: fp8 where ``weights`` is ``fp8`` and the card has FP8 tensor cores."""
    return card.fp8_tflops if WEIGHTS[weights][1] and card.fp8_tflops else card.bf16_tflops


def casts_weights(card: CardProfile, weights: str) -> bool:
    """fp8 weights upcast to bf16 before every GEMM (storage only)."""
    return WEIGHTS[weights][0] == 1 and gemm_tflops(card, weights) == card.bf16_tflops


def card_call_ms(parts: Dict[str, float], card: CardProfile, weights: str = "bf16") -> Dict[str, float]:
    """``parts`` (H200 ms) on ``card``: GEMMs x (H200 bf16 / card GEMM rate), attention x (H200 bf16 / card bf16),
    memory-bound x (H200 bandwidth / card bandwidth)."""
    ref = REFERENCE_CARD
    return {"gemm": parts["gemm"] * ref.bf16_tflops / gemm_tflops(card, weights),
            "attention": parts["attention"] * ref.bf16_tflops / card.bf16_tflops,
            "memory": parts["memory"] * ref.bandwidth_gbps / card.bandwidth_gbps}


def cast_ms(model: RigModel, card: CardProfile, weights: str) -> float:
    """The per-call cast of fp8-stored weights to bf16 (3 bytes per parameter at the card's bandwidth), else 0."""
    if not casts_weights(card, weights):
        return 0.0
    return 3.0 * model.params / (card.bandwidth_gbps * 1e9) * 1e3


def rank_overhead(model: RigModel, n: int, kernels: str = "eager") -> Tuple[float, Optional[int]]:
    """``(overhead, measured N)``: the measured per-rank compute at N over N = 1 x the busiest rank's token share
    (text sharded), at the largest measured N <= ``n`` (1.0 at N = 1)."""
    if n <= 1:
        return 1.0, None
    b = basis(model, kernels)
    m = max((k for k in b["ranks_ms"] if k <= n), default=min(b["ranks_ms"]))
    share = token_share(_base_shape(model), m, True)
    return b["ranks_ms"][m] / (b["n1_ms"] * share), m


def rank_call_ms(model: RigModel, shape: DiTShape, card: CardProfile, n: int, weights: str = "bf16",
                 kernels: str = "eager", shard_text: bool = True) -> Dict[str, float]:
    """One sequence rank's GPU time per call on ``card`` (N = 1: the whole call), by part, plus ``total``: the parts x
    the token share x the measured overhead, and the weights' cast (whole on every rank)."""
    parts = card_call_ms(h200_call_parts(model, shape, kernels), card, weights)
    share = token_share(shape, n, shard_text) if n > 1 else 1.0
    over, _ = rank_overhead(model, n, kernels)
    out = {k: v * share * over for k, v in parts.items()}
    out["cast"] = cast_ms(model, card, weights)
    out["total"] = sum(out.values())
    return out


def issue_floor_ms(model: RigModel, kernels: str = "eager") -> Optional[float]:
    """The CPU's time to issue one eager call (H200 host; Wan: FLUX.1's per block x its blocks); ``None`` compiled."""
    b = basis(model, kernels)
    if kernels != "eager":
        return None
    if b["issue_ms"] is not None:
        return b["issue_ms"]
    flux = H200_BASIS["flux1"]["eager"]["issue_ms"]
    return flux / MODELS["flux1"].layers * model.layers


def _rank_tokens(shape: DiTShape, n: int) -> int:
    from ..sampling.dit_traffic import token_shards

    if n <= 1:
        return _tokens(shape)
    shards = token_shards(shape, n, True)
    return max(shards.seq_counts)


def activation_gib(model: RigModel, shape: DiTShape, n: int = 1) -> float:
    """A rank's transient memory above its resident weights: the H200's measured peak minus the weights at the
    largest measured N <= ``n``, scaled by the rank's tokens against that measurement's."""
    peaks = H200_BASIS[model.basis]["peak_gib"]
    m = max((k for k in peaks if k <= max(n, 1)), default=1)
    weights_gib = model.params * 2 / GIB
    measured = peaks[m] - weights_gib
    return max(0.0, measured * _rank_tokens(shape, n) / _rank_tokens(_base_shape(model), m))


def vae_decode_ms(model: RigModel, height: int, width: int, frames: int, card: CardProfile) -> float:
    """The VAE decode on one card: the H200's (baselines-h200.md) x pixels x frames, x the bf16 throughput ratio."""
    _, h0, w0, f0, ms = model.vae
    scale = (height * width * frames) / (h0 * w0 * f0)
    return ms * scale * REFERENCE_CARD.bf16_tflops / card.bf16_tflops


#: the compute-scaling rule in one paragraph (the calibration's JSON and README carry it)
RULE = ("One model call measured on one H200 (PatchRay's per-rank compute: FLUX.1 from each rank's profiled kernels, "
        "Wan 2.1 14B and Qwen-Image from each rank's compute measured alone) is split into GEMMs, fused attention "
        "kernels and the memory-bound rest (FLUX.1: from its kernel profile; Wan and Qwen-Image: FLUX.1's memory-bound "
        "time per token x width x block, the rest split by FLOPs at FLUX.1's measured GEMM and attention rates). On a "
        "card: GEMMs x (H200 dense bf16 989.5 TFLOP/s / the card's dense GEMM rate: bf16, or fp8 with --weights fp8 "
        "where it has FP8 tensor cores), attention x (989.5 / the card's dense bf16), memory-bound x (4,800 GB/s / the "
        "card's bandwidth). Why: GEMMs and flash attention run near a constant fraction of a card's tensor peak, "
        "element-wise kernels near a constant fraction of its bandwidth, and cards differ in FLOP per byte (H200 206, "
        "RTX 4090 164, RTX 3090 76). Resolution: GEMMs scale with the linear FLOPs, attention with the attention FLOPs, "
        "the memory-bound part with the tokens. A sequence rank: x its token share x the per-rank overhead measured "
        "at that N on the H200. fp8 stored but computed in bf16: + 3 bytes per parameter per call at the card's "
        "bandwidth (the cast). Eager calls take at least the CPU's issue time measured on the H200 host (FLUX.1 141 "
        "ms, Qwen-Image 170 ms; Wan FLUX.1's per block x 40).")


def describe_rule() -> str:
    return RULE


def _check() -> None:  # pragma: no cover - a sanity hook for interactive use
    for m in MODELS.values():
        s = _base_shape(m)
        p = h200_call_parts(m, s)
        assert math.isclose(sum(p.values()), basis(m)["n1_ms"], rel_tol=1e-3), (m.key, p)
