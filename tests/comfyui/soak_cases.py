"""The soak harness's prompts: a reproducible random mix of PatchRay graphs with their stock twins, and the faults to inject.

Every mix prompt runs a PatchRay path and the stock path it stands for in one prompt, on the same inputs, and saves
both results (latents with SaveLatent, images as float32 with the test-only PatchRayTestSaveImageTensor), so the
harness can hold each PatchRay result to its stock twin:

* samplers: the stock KSampler or SamplerCustomAdvanced (CFGGuider) on a **PatchRay Parallel Model** MODEL, or the
  older **PatchRay Distributed KSampler** / **(Advanced)**, against the stock KSampler / KSampler (Advanced) / the
  same SamplerCustomAdvanced graph on the unpatched MODEL;
* decoders: the stock VAE Decode (or VAE Decode (Tiled)) on a **PatchRay Parallel VAE**, or the older **PatchRay
  Distributed VAE Decode**, against the stock VAE Decode of the same latent (the stock sampler's);
* three model families, each with its own VAE, so switching family re-ships weights to the ranks: an SD1-class UNet
  checkpoint (``sdxl_vae``), Wan 2.1 (its video VAE) and an SD3-class MMDiT (the 16-channel KL VAE ``ae``); and
  between prompts num_ranks, parallelism, preset and sharding change.

Faults are cases of their own (:data:`FAULT_KINDS`); each is followed by a mix prompt, which must work. This module
only builds data; ``soak.py`` runs it against a server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["Case", "Check", "FAULT_KINDS", "FAMILIES", "schedule"]

#: what the harness injects, each kind at least once per run (``schedule``)
FAULT_KINDS = (
    "interrupt_start",    # ComfyUI's Cancel (POST /interrupt) while a new rank count's ranks start
    "interrupt_ship",     # ... while a model switch ships weights to the ranks
    "interrupt_sample",   # ... while the ranks sample
    "interrupt_decode",   # ... while the ranks decode
    "kill_rank_sample",   # SIGKILL of one rank process while the ranks sample
    "kill_rank_decode",   # ... while they decode
    "kill_rank_idle",     # ... between prompts
    "kill_raylet",        # SIGKILL of the embedded Ray's raylet (while sampling or idle)
    "kill_gcs",           # SIGKILL of the embedded Ray's GCS (while sampling or idle)
    "rank_oom_sample",    # a rank past its memory cap (ClusterConfig.rank_memory_mb) while sampling
    "rank_oom_decode",    # ... while decoding (the decode node retries in row tiles)
    "nan_latent",         # a NaN latent into a PatchRay decode or sampler
    "malformed_type",     # a wrong type through the API (a string widget value, a wire of the wrong type)
    "malformed_range",    # a widget value beyond its limits
    "malformed_shape",    # a latent of another family / channel count
    "malformed_absurd",   # sizes within the widgets' limits that no machine holds
    "free_models",        # ComfyUI's Free model and node cache (POST /free)
    "restart_kill9",      # ComfyUI SIGKILLed and started again
    "restart_term",       # ComfyUI stopped with SIGTERM and started again
)

#: model family -> its files and what its PatchRay split allows
FAMILIES = {
    "unet": {"vae": "sdxl_vae.safetensors", "parallelism": ("sequence", "cfg", "batch"),
             "presets": ("full_sync", "full_sync", "full_sync", "displaced", "otil"), "sharding": ("none", "none", "blocks")},
    "wan": {"vae": "wan_2.1_vae.safetensors", "parallelism": ("sequence", "sequence", "cfg", "batch"),
            "presets": ("full_sync", "full_sync", "full_sync", "displaced", "compressed"), "sharding": ("none", "none", "blocks")},
    "sd3": {"vae": "ae.safetensors", "parallelism": ("cfg", "batch"), "presets": ("full_sync",), "sharding": ("none",)},
}

#: bounds against the stock twin (see ``Check``)
EXACT_LATENT = 1e-5  # fp32, the splits only reorder sums: the suite's bound (tests/comfyui/test_parallel_model_server.py)
APPROX_LATENT = 0.5  # the low-traffic presets' stale steps: a bounded error, far below a broken band's O(1)
IMAGE_LEVEL = 1 / 255  # row decode in fp32: within one 8-bit level of the stock VAE Decode (README)
ENCODE_REL = 1e-3  # row encode in fp32 vs the stock fp32 encode (which itself drifts ~1e-4 with random weights)


@dataclass
class Check:
    """One PatchRay output held to its stock twin: ``what`` is ``latent`` (relative L2 <= bound) or ``image`` (max
    absolute difference <= bound); NaNs must sit where the stock output has them."""

    what: str
    stock: str
    ours: str
    bound: float


@dataclass
class Case:
    """One step of the soak: a prompt (``api``) and/or a server-level action, with what must come of it."""

    index: int
    kind: str  # "mix" or one of FAULT_KINDS
    family: str = "-"
    settings: Dict = field(default_factory=dict)
    api: Dict = field(default_factory=dict)
    checks: List[Check] = field(default_factory=list)
    expect: Tuple[str, ...] = ("success",)  # outcomes that pass: success, error, interrupted, rejected
    words: str = ""  # a regex an error / refusal message must match: it names the cause
    ours_sampler: Optional[str] = None  # the node whose run happens on the ranks (phase tracking)
    ours_decode: Optional[str] = None
    action: Optional[Dict] = None  # the fault: {"do": ..., "at": ...}
    client: int = 0
    pair: Optional[int] = None  # mix cases queued at once by two clients share a pair number


class _Graph:
    def __init__(self):
        self.nodes: Dict[str, Dict] = {}

    def add(self, class_type: str, **inputs) -> str:
        nid = str(len(self.nodes) + 1)
        self.nodes[nid] = {"class_type": class_type, "inputs": inputs}
        return nid


_WORDS = ("a red boat", "a quiet harbour", "two cats on a wall", "mountains at dawn", "a city in rain", "blurry", "lowres")


def _cluster(g: _Graph, ranks: int) -> str:
    return g.add("PatchRayCluster", num_ranks=ranks, device="cpu", address="", gpu_ids="")


def _model_chain(g: _Graph, family: str, rng: random.Random, width: int, height: int, batch: int, frames: int = 9):
    """Loader (and model sampling) -> (MODEL link, positive, negative, LATENT link, VAE link)."""
    seed = rng.randrange(1 << 20)
    if family == "unet":
        ckpt = g.add("CheckpointLoaderSimple", ckpt_name="sd_xl_base_1.0.safetensors")
        pos = g.add("CLIPTextEncode", text=rng.choice(_WORDS[:5]), clip=[ckpt, 1])
        neg = g.add("CLIPTextEncode", text=rng.choice(_WORDS[5:]), clip=[ckpt, 1])
        latent = g.add("EmptyLatentImage", width=width, height=height, batch_size=batch)
        model = [ckpt, 0]
    elif family == "wan":
        loader = g.add("UNETLoader", unet_name="wan2.1_t2v_1.3B_fp16.safetensors", weight_dtype="default")
        model = [g.add("ModelSamplingSD3", model=[loader, 0], shift=8.0), 0]
        pos = g.add("PatchRayTestConditioning", seed=seed, tokens=9, width=4096, pooled=0)
        neg = g.add("PatchRayTestConditioning", seed=seed + 1, tokens=6, width=4096, pooled=0)
        latent = g.add("EmptyHunyuanLatentVideo", width=width, height=height, length=frames, batch_size=batch)
    else:
        loader = g.add("UNETLoader", unet_name="sd3_tiny.safetensors", weight_dtype="default")
        model = [g.add("ModelSamplingSD3", model=[loader, 0], shift=3.0), 0]
        pos = g.add("PatchRayTestConditioning", seed=seed, tokens=9, width=4096, pooled=2048)
        neg = g.add("PatchRayTestConditioning", seed=seed + 1, tokens=6, width=4096, pooled=2048)
        latent = g.add("EmptySD3LatentImage", width=width, height=height, batch_size=batch)
    vae = g.add("VAELoader", vae_name=FAMILIES[family]["vae"])
    return model, [pos, 0], [neg, 0], [latent, 0], [vae, 0]


def _size(family: str, rng: random.Random, large: bool = False) -> Tuple[int, int]:
    if family == "unet":
        return (rng.choice((64, 80, 96)), rng.choice((64, 72, 96))) if not large else (512, 512)
    if family == "wan":
        return rng.choice(((48, 72), (64, 64), (48, 96)))
    return rng.choice(((64, 48), (64, 64), (48, 80)))


def _pick_split(family: str, rng: random.Random, ranks: Optional[int], keep: bool = False) -> Tuple[str, int, int]:
    """(parallelism, num_ranks, latent batch) the family allows; ``ranks``: keep this rank count when possible (always,
    with ``keep``)."""
    options = []
    for parallelism in FAMILIES[family]["parallelism"]:
        for n in (1, 2, 3):
            if parallelism == "cfg" and n != 2:
                continue
            if parallelism == "batch" and n == 1:
                continue
            options.append((parallelism, n))
    same = [o for o in options if o[1] == ranks]
    parallelism, n = rng.choice(same if same and (keep or rng.random() < 0.75) else options)
    batch = n if parallelism == "batch" else rng.choice((1, 1, 2))
    return parallelism, n, batch


def _parallel_model(g: _Graph, model, cluster: str, parallelism: str, preset: str, sharding: str) -> str:
    return g.add("PatchRayParallelModel", model=model, cluster=[cluster, 0], preset=preset, warmup_steps=1 if preset != "full_sync" else -1,
                 refresh_every=-1, k_ratio=0.25, block_size=4, parallelism=parallelism, sequence_attention="auto", balance="equal",
                 sharding=sharding)


def mix_case(index: int, rng: random.Random, *, family: Optional[str] = None, ranks: Optional[int] = None,
             steps: Optional[int] = None, keep_ranks: bool = False) -> Case:
    """A PatchRay sampler path and a PatchRay decode path beside their stock twins, saved for comparison."""
    family = family or rng.choice(tuple(FAMILIES))
    parallelism, n, batch = _pick_split(family, rng, ranks, keep_ranks)
    spec = FAMILIES[family]
    preset = rng.choice(spec["presets"]) if parallelism == "sequence" and n > 1 else "full_sync"
    sharding = rng.choice(spec["sharding"]) if n > 1 else "none"
    sampler_path = rng.choice(("parallel_model_ksampler", "parallel_model_ksampler", "parallel_model_custom", "distributed_ksampler",
                               "distributed_ksampler_advanced"))
    decode_path = rng.choice(("parallel_vae", "parallel_vae", "parallel_vae_tiled", "distributed_decode"))
    encode = family == "unet" and rng.random() < 0.15
    steps = steps or rng.choice((2, 3, 4))
    sampler_name = rng.choice(("euler", "euler", "dpmpp_2m", "euler_ancestral")) if sampler_path != "parallel_model_custom" else "euler"
    width, height = _size(family, rng)
    g = _Graph()
    model, pos, neg, latent, vae = _model_chain(g, family, rng, width, height, batch)
    cluster = _cluster(g, n)
    seed = rng.randrange(1 << 31)
    cfg = rng.choice((3.5, 5.0))
    common = dict(seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler="simple", positive=pos, negative=neg,
                  latent_image=latent, denoise=1.0)
    knobs = dict(cluster=[cluster, 0], preset=preset, warmup_steps=1 if preset != "full_sync" else -1, refresh_every=-1, k_ratio=0.25,
                 block_size=4, parallelism=parallelism, sequence_attention="auto", balance="equal", sharding=sharding)
    if sampler_path == "parallel_model_ksampler":
        pm = _parallel_model(g, model, cluster, parallelism, preset, sharding)
        stock = g.add("KSampler", model=model, **common)
        ours = g.add("KSampler", model=[pm, 0], **common)
    elif sampler_path == "parallel_model_custom":
        pm = _parallel_model(g, model, cluster, parallelism, preset, sharding)

        def custom(m):
            guider = g.add("CFGGuider", model=m, positive=pos, negative=neg, cfg=cfg)
            noise = g.add("RandomNoise", noise_seed=seed)
            sampler = g.add("KSamplerSelect", sampler_name=sampler_name)
            sigmas = g.add("BasicScheduler", model=model, scheduler="simple", steps=steps, denoise=1.0)
            return g.add("SamplerCustomAdvanced", noise=[noise, 0], guider=[guider, 0], sampler=[sampler, 0], sigmas=[sigmas, 0],
                         latent_image=latent)

        stock, ours = custom(model), custom([pm, 0])
    elif sampler_path == "distributed_ksampler":
        stock = g.add("KSampler", model=model, **common)
        ours = g.add("PatchRayKSampler", model=model, **common, **knobs)
    else:
        adv = dict(add_noise="enable", noise_seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler="simple",
                   positive=pos, negative=neg, latent_image=latent, start_at_step=0, end_at_step=10000,
                   return_with_leftover_noise="disable")
        stock = g.add("KSamplerAdvanced", model=model, **adv)
        ours = g.add("PatchRayKSamplerAdvanced", model=model, **adv, **knobs)
    g.add("SaveLatent", samples=[stock, 0], filename_prefix=f"soak/c{index}_stock")
    g.add("SaveLatent", samples=[ours, 0], filename_prefix=f"soak/c{index}_ours")
    stock_save, ours_save = str(len(g.nodes) - 1), str(len(g.nodes))
    bound = EXACT_LATENT if preset == "full_sync" else APPROX_LATENT
    checks = [Check("latent", stock_save, ours_save, bound)]

    decode_input = [stock, 0]  # both decoders decode the stock sampler's latent: the image check is the VAE's alone
    stock_img = g.add("VAEDecode", samples=decode_input, vae=vae)
    if decode_path == "distributed_decode":
        ours_img = g.add("PatchRayVAEDecode", samples=decode_input, vae=vae, cluster=[cluster, 0], mode="row", precision="fp32", gn_sync=False)
    else:
        pv = g.add("PatchRayParallelVAE", vae=vae, cluster=[cluster, 0], mode="row", precision="fp32", gn_sync=False, balance="equal")
        if decode_path == "parallel_vae_tiled":
            ours_img = g.add("VAEDecodeTiled", samples=decode_input, vae=[pv, 0], tile_size=256, overlap=64, temporal_size=64,
                             temporal_overlap=8)
        else:
            ours_img = g.add("VAEDecode", samples=decode_input, vae=[pv, 0])
        if encode:
            stock_z = g.add("VAEEncode", pixels=[stock_img, 0], vae=vae)
            ours_z = g.add("VAEEncode", pixels=[stock_img, 0], vae=[pv, 0])
            s1 = g.add("SaveLatent", samples=[stock_z, 0], filename_prefix=f"soak/c{index}_stock_enc")
            s2 = g.add("SaveLatent", samples=[ours_z, 0], filename_prefix=f"soak/c{index}_ours_enc")
            checks.append(Check("latent", s1, s2, ENCODE_REL))
    s1 = g.add("PatchRayTestSaveImageTensor", images=[stock_img, 0], prefix=f"soak/c{index}_stock_img")
    s2 = g.add("PatchRayTestSaveImageTensor", images=[ours_img, 0], prefix=f"soak/c{index}_ours_img")
    checks.append(Check("image", s1, s2, IMAGE_LEVEL))
    settings = dict(ranks=n, parallelism=parallelism, preset=preset, sharding=sharding, sampler=sampler_path, sampler_name=sampler_name,
                    decode=decode_path, encode=encode, steps=steps, size=[width, height], batch=batch)
    return Case(index, "mix", family, settings, g.nodes, checks, ours_sampler=ours, ours_decode=ours_img)


def _long_sampling(index: int, rng: random.Random, ranks: int, family: str = "unet", steps: int = 400, capped_mb: Optional[float] = None) -> Case:
    """A sampling run long enough to be caught in the middle (no stock twin: it is interrupted or killed)."""
    g = _Graph()
    width, height = (128, 128) if family == "unet" else (64, 64)
    model, pos, neg, latent, _ = _model_chain(g, family, rng, width, height, 1)
    if capped_mb is not None:
        cluster = g.add("PatchRaySoakCappedCluster", num_ranks=ranks, rank_memory_mb=capped_mb)
    else:
        cluster = _cluster(g, ranks)
    pm = _parallel_model(g, model, cluster, "sequence", "full_sync", "none")
    ours = g.add("KSampler", model=[pm, 0], seed=rng.randrange(1 << 31), steps=steps, cfg=4.0, sampler_name="euler", scheduler="simple",
                 positive=pos, negative=neg, latent_image=latent, denoise=1.0)
    g.add("SaveLatent", samples=[ours, 0], filename_prefix=f"soak/c{index}_long")
    return Case(index, "long", family, dict(ranks=ranks, steps=steps, size=[width, height], capped_mb=capped_mb), g.nodes,
                ours_sampler=ours)


def _long_decode(index: int, rng: random.Random, ranks: int, path: str, size: int = 512, capped_mb: Optional[float] = None) -> Case:
    """A decode of a large latent on the ranks (no stock twin)."""
    g = _Graph()
    latent = g.add("EmptyLatentImage", width=size, height=size, batch_size=1)
    vae = g.add("VAELoader", vae_name="sdxl_vae.safetensors")
    cluster = (g.add("PatchRaySoakCappedCluster", num_ranks=ranks, rank_memory_mb=capped_mb) if capped_mb is not None
               else _cluster(g, ranks))
    if path == "distributed_decode":
        ours = g.add("PatchRayVAEDecode", samples=[latent, 0], vae=[vae, 0], cluster=[cluster, 0], mode="row", precision="fp32", gn_sync=False)
    else:
        pv = g.add("PatchRayParallelVAE", vae=[vae, 0], cluster=[cluster, 0], mode="row", precision="fp32", gn_sync=False, balance="equal")
        ours = g.add("VAEDecode", samples=[latent, 0], vae=[pv, 0])
    g.add("PatchRayTestSaveImageTensor", images=[ours, 0], prefix=f"soak/c{index}_long_img")
    return Case(index, "long", "unet", dict(ranks=ranks, decode=path, size=[size, size], capped_mb=capped_mb), g.nodes, ours_decode=ours)


def fault_case(kind: str, index: int, rng: random.Random, state: Dict) -> Case:
    """The case that injects ``kind``; ``state`` is what the schedule knows of the server (last family, last rank
    count), so a fault meant for shipping switches the model and one meant for a start changes the rank count."""
    ranks = state.get("ranks") or 2
    if kind == "interrupt_start":
        case = mix_case(index, rng, ranks=3 if ranks != 3 else 2)
        case.action = {"do": "interrupt", "at": "start"}
        case.expect, case.words = ("interrupted", "success"), ""
    elif kind == "interrupt_ship":
        other = rng.choice([f for f in FAMILIES if f != state.get("family")])
        case = mix_case(index, rng, family=other, ranks=ranks)
        case.action = {"do": "interrupt", "at": "ship"}
        case.expect = ("interrupted", "success")
    elif kind == "interrupt_sample":
        case = _long_sampling(index, rng, ranks if ranks > 1 else 2)
        case.action = {"do": "interrupt", "at": "sample"}
        case.expect = ("interrupted",)
    elif kind == "interrupt_decode":
        case = _long_decode(index, rng, ranks if ranks > 1 else 2, rng.choice(("parallel_vae", "distributed_decode")))
        case.action = {"do": "interrupt", "at": "decode"}
        case.expect = ("interrupted",)
    elif kind == "kill_rank_sample":
        case = _long_sampling(index, rng, ranks if ranks > 1 else 2)
        case.action = {"do": "kill_rank", "at": "sample"}
        case.expect, case.words = ("error",), r"rank \d+ died|died"
    elif kind == "kill_rank_decode":
        case = _long_decode(index, rng, ranks if ranks > 1 else 2, rng.choice(("parallel_vae", "distributed_decode")))
        case.action = {"do": "kill_rank", "at": "decode"}
        case.expect, case.words = ("error",), r"rank \d+ died|died"
    elif kind in ("kill_rank_idle",):
        case = Case(index, kind, action={"do": "kill_rank", "at": "idle"}, expect=())
    elif kind in ("kill_raylet", "kill_gcs"):
        what = "raylet" if kind == "kill_raylet" else "gcs"
        if rng.random() < 0.5:
            case = _long_sampling(index, rng, ranks if ranks > 1 else 2)
            case.action = {"do": f"kill_{what}", "at": "sample"}
            case.expect, case.words = ("error",), r"raylet|GCS"
        else:
            case = Case(index, kind, action={"do": f"kill_{what}", "at": "idle"}, expect=())
    elif kind == "rank_oom_sample":
        case = _long_sampling(index, rng, 2, steps=3, capped_mb=rng.choice((4.0, 16.0)))
        case.action = {"do": "none", "at": "sample"}
        case.expect, case.words = ("error",), r"out of memory|rank_memory_mb"
    elif kind == "rank_oom_decode":
        case = _long_decode(index, rng, 2, "distributed_decode", size=rng.choice((256, 384)), capped_mb=rng.choice((24.0, 48.0)))
        case.action = {"do": "none", "at": "decode"}
        # the decode node retries in row tiles and says so on the node; past that it fails naming the memory
        case.expect, case.words = ("success", "error"), r"out of memory|rank_memory_mb|memory"
        case.settings["note_words"] = r"ran out of memory"
    elif kind == "nan_latent":
        case = _nan_case(index, rng, ranks)
    elif kind.startswith("malformed_"):
        case = _malformed_case(kind, index, rng, ranks)
    elif kind == "free_models":
        if rng.random() < 0.5:  # while a prompt runs on the ranks: ComfyUI acts on it when that prompt ends
            case = mix_case(index, rng, ranks=ranks)
            case.action = {"do": "free", "at": "ship"}
        else:
            case = Case(index, kind, action={"do": "free", "at": "idle"}, expect=())
    elif kind in ("restart_kill9", "restart_term"):
        case = Case(index, kind, action={"do": kind}, expect=())
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
    case.kind = kind
    return case


def _nan_case(index: int, rng: random.Random, ranks: int) -> Case:
    variant = rng.choice(("distributed_decode", "parallel_vae", "sampler"))
    ranks = ranks if ranks > 1 else 2
    g = _Graph()
    latent = g.add("EmptyLatentImage", width=64, height=64, batch_size=1)
    noised = g.add("PatchRaySoakNaNLatent", samples=[latent, 0], where=rng.choice(("all", "one")))
    vae = g.add("VAELoader", vae_name="sdxl_vae.safetensors")
    cluster = _cluster(g, ranks)
    checks, ours_decode, ours_sampler = [], None, None
    if variant == "distributed_decode":
        ours_decode = g.add("PatchRayVAEDecode", samples=[noised, 0], vae=[vae, 0], cluster=[cluster, 0], mode="row", precision="fp32", gn_sync=False)
        g.add("PatchRayTestSaveImageTensor", images=[ours_decode, 0], prefix=f"soak/c{index}_nan_img")
        expect, words = ("error",), r"NaN"
    elif variant == "parallel_vae":
        pv = g.add("PatchRayParallelVAE", vae=[vae, 0], cluster=[cluster, 0], mode="row", precision="fp32", gn_sync=False, balance="equal")
        stock = g.add("VAEDecode", samples=[noised, 0], vae=[vae, 0])
        ours_decode = g.add("VAEDecode", samples=[noised, 0], vae=[pv, 0])
        s1 = g.add("PatchRayTestSaveImageTensor", images=[stock, 0], prefix=f"soak/c{index}_nan_stock")
        s2 = g.add("PatchRayTestSaveImageTensor", images=[ours_decode, 0], prefix=f"soak/c{index}_nan_ours")
        checks = [Check("image", s1, s2, IMAGE_LEVEL)]
        expect, words = ("success", "error"), r"NaN"  # the stock node's result (NaNs where it has them), or a refusal naming them
    else:
        ckpt = g.add("CheckpointLoaderSimple", ckpt_name="sd_xl_base_1.0.safetensors")
        pos = g.add("CLIPTextEncode", text="a red boat", clip=[ckpt, 1])
        pm = _parallel_model(g, [ckpt, 0], cluster, "sequence", "full_sync", "none")
        common = dict(seed=rng.randrange(1 << 31), steps=2, cfg=4.0, sampler_name="euler", scheduler="simple", positive=[pos, 0],
                      negative=[pos, 0], latent_image=[noised, 0], denoise=0.5)
        stock = g.add("KSampler", model=[ckpt, 0], **common)
        ours_sampler = g.add("KSampler", model=[pm, 0], **common)
        s1 = g.add("SaveLatent", samples=[stock, 0], filename_prefix=f"soak/c{index}_nan_stock")
        s2 = g.add("SaveLatent", samples=[ours_sampler, 0], filename_prefix=f"soak/c{index}_nan_ours")
        checks = [Check("latent", s1, s2, EXACT_LATENT)]
        expect, words = ("success", "error"), r"NaN|not finite|diverged"
    return Case(index, "nan_latent", "unet", dict(variant=variant, ranks=ranks), g.nodes, checks, expect, words,
                ours_sampler=ours_sampler, ours_decode=ours_decode)


def _malformed_case(kind: str, index: int, rng: random.Random, ranks: int) -> Case:
    ranks = ranks if ranks > 1 else 2
    g = _Graph()
    variants = {
        "malformed_type": ("string_widget", "wire_type"),
        "malformed_range": ("width_beyond", "steps_zero", "ranks_zero", "k_ratio_beyond"),
        "malformed_shape": ("video_latent_to_image_vae", "channels_to_parallel_vae", "channels_to_sampler"),
        "malformed_absurd": ("sampling_16k", "decode_8k", "ranks_64"),
    }[kind]
    variant = rng.choice(variants)
    vae = g.add("VAELoader", vae_name="sdxl_vae.safetensors")
    cluster = _cluster(g, ranks)
    expect, words, ours_sampler, ours_decode = ("rejected",), "", None, None
    if variant in ("string_widget", "width_beyond", "video_latent_to_image_vae", "decode_8k", "ranks_64"):
        width = {"string_widget": "sixty-four", "width_beyond": 100000, "decode_8k": 8192}.get(variant, 64)
        if variant == "video_latent_to_image_vae":
            latent = g.add("EmptyHunyuanLatentVideo", width=64, height=64, length=9, batch_size=1)
        else:
            latent = g.add("EmptyLatentImage", width=width, height=width, batch_size=1)
        if variant == "ranks_64":
            g.nodes[cluster]["inputs"]["num_ranks"] = 64
        ours_decode = g.add("PatchRayVAEDecode", samples=[latent, 0], vae=[vae, 0], cluster=[cluster, 0], mode="row", precision="fp32",
                            gn_sync=False)
        g.add("PatchRayTestSaveImageTensor", images=[ours_decode, 0], prefix=f"soak/c{index}_bad_img")
        if variant == "video_latent_to_image_vae":
            expect, words = ("error",), r"video latent|latent channels|channels"
        elif variant == "decode_8k":
            expect, words = ("error",), r"memory|GiB|holds"
        elif variant == "ranks_64":
            expect, words = ("error",), r"num_ranks is 64"
    elif variant == "wire_type":
        latent = g.add("EmptyLatentImage", width=64, height=64, batch_size=1)
        ours_decode = g.add("PatchRayVAEDecode", samples=[latent, 0], vae=[latent, 0], cluster=[cluster, 0], mode="row", precision="fp32",
                            gn_sync=False)
        g.add("PatchRayTestSaveImageTensor", images=[ours_decode, 0], prefix=f"soak/c{index}_bad_img")
    elif variant == "channels_to_parallel_vae":
        latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=1)  # 16 channels into a 4-channel VAE
        pv = g.add("PatchRayParallelVAE", vae=[vae, 0], cluster=[cluster, 0], mode="row", precision="fp32", gn_sync=False, balance="equal")
        ours_decode = g.add("VAEDecode", samples=[latent, 0], vae=[pv, 0])
        g.add("PatchRayTestSaveImageTensor", images=[ours_decode, 0], prefix=f"soak/c{index}_bad_img")
        expect, words = ("error",), r"channel|expected|shape|size"
    else:
        ckpt = g.add("CheckpointLoaderSimple", ckpt_name="sd_xl_base_1.0.safetensors")
        pos = g.add("CLIPTextEncode", text="a red boat", clip=[ckpt, 1])
        if variant == "channels_to_sampler":
            # a 16-channel latent that is not empty (ComfyUI resizes an all-zero latent to the model's channels, so an
            # EmptySD3LatentImage would sample as stock): the 16-channel VAE's encode of a plain image
            image = g.add("EmptyImage", width=64, height=64, batch_size=1, color=0x806040)
            vae16 = g.add("VAELoader", vae_name=FAMILIES["sd3"]["vae"])
            latent = g.add("VAEEncode", pixels=[image, 0], vae=[vae16, 0])
            expect, words = ("error",), r"channel|expected|shape|size"
        elif variant == "sampling_16k":
            latent = g.add("EmptyLatentImage", width=16384, height=16384, batch_size=1)
            expect, words = ("error",), r"GiB|memory"
        else:
            latent = g.add("EmptyLatentImage", width=64, height=64, batch_size=1)
        steps = 0 if variant == "steps_zero" else 2
        if variant == "ranks_zero":
            g.nodes[cluster]["inputs"]["num_ranks"] = 0
        pm = g.add("PatchRayParallelModel", model=[ckpt, 0], cluster=[cluster, 0], preset="full_sync", warmup_steps=-1, refresh_every=-1,
                   k_ratio=2.0 if variant == "k_ratio_beyond" else 0.25, block_size=8, parallelism="sequence", sequence_attention="auto",
                   balance="equal", sharding="none")
        ours_sampler = g.add("KSampler", model=[pm, 0], seed=1, steps=steps, cfg=4.0, sampler_name="euler", scheduler="simple",
                             positive=[pos, 0], negative=[pos, 0], latent_image=[latent, 0], denoise=1.0)
        g.add("SaveLatent", samples=[ours_sampler, 0], filename_prefix=f"soak/c{index}_bad")
    return Case(index, kind, "unet", dict(variant=variant, ranks=ranks), g.nodes, [], expect, words, ours_sampler=ours_sampler,
                ours_decode=ours_decode)


def schedule(prompts: int, rng_start: int, kinds=FAULT_KINDS, min_each: int = 1, fault_share: float = 0.3, pair_share: float = 0.1,
             block: int = 30, quiet: int = 12) -> List[Case]:
    """``prompts`` cases: mix prompts, pairs of mix prompts queued at once by two clients, and faults (every kind in
    ``kinds`` at least ``min_each`` times, about ``fault_share`` of the cases in all).

    In every ``block`` of cases the first ``quiet`` are mix prompts on one rank count (the ranks live through them:
    their memory is measured over a life of ``quiet`` prompts, models switching); the faults fall in the rest, never
    two in a row and never last, so the case after each fault is a mix prompt that must work."""
    rng = random.Random(rng_start)
    free = [i for i in range(1, prompts - 1) if i % block >= quiet]
    slots_max = len(free[::2])
    n_faults = max(len(kinds) * min_each, round(fault_share * prompts))
    n_faults = min(n_faults, slots_max)
    faults = [k for k in kinds for _ in range(min_each)]
    faults += [rng.choice(kinds) for _ in range(max(0, n_faults - len(faults)))]
    rng.shuffle(faults)
    faults = faults[:n_faults]
    # fault slots: every other free index (no two adjacent), a random subset of them
    slots = sorted(rng.sample(free[::2], len(faults))) if faults else []
    at = dict(zip(slots, faults))
    cases: List[Case] = []
    state: Dict = {}
    pair = 0
    i = 0
    while i < prompts:
        steady = i % block < quiet and i % block > 0
        if i in at:
            case = fault_case(at[i], i, rng, state)
        else:
            case = mix_case(i, rng, ranks=state.get("ranks"), keep_ranks=steady)
            if i + 1 < prompts and i + 1 not in at and (rng.random() < pair_share or (i == 2 and pair == 0)):
                other = mix_case(i + 1, rng, ranks=case.settings["ranks"], keep_ranks=True)
                case.pair = other.pair = pair
                other.client = 1
                pair += 1
                cases += [case, other]
                state.update(ranks=other.settings["ranks"], family=other.family)
                i += 2
                continue
        if case.api and case.settings.get("ranks") and not case.kind.startswith("malformed_"):
            state.update(ranks=case.settings["ranks"], family=case.family if case.family != "-" else state.get("family"))
        cases.append(case)
        i += 1
    return cases
