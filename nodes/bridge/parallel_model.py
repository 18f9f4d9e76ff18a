"""PatchRay Parallel Model: a MODEL that samples on the cluster's ranks, whichever sampler node samples it.

Driver side (ComfyUI's process). :func:`patch_model` returns a clone of the user's MODEL carrying one wrapper at
ComfyUI's ``OUTER_SAMPLE`` extension point (``comfy.patcher_extension.WrappersMP.OUTER_SAMPLE``, around
``CFGGuider.outer_sample``). Every sampling path of ComfyUI passes there:

* KSampler and KSampler (Advanced): ``comfy.sample.sample`` -> ``comfy.samplers.KSampler.sample`` -> ``CFGGuider``;
* SamplerCustom / SamplerCustomAdvanced with any guider (CFGGuider, BasicGuider, DualCFGGuider, PerpNegGuider are
  ``CFGGuider`` subclasses overriding ``predict_noise``), any sampler object and any sigmas;
* a third-party sampler node that samples through ComfyUI's sampling functions (``comfy.sample``, a guider).

Design decisions:

* **Intercept where everything is decided and nothing is loaded.** At ``OUTER_SAMPLE`` the noise is generated, the
  sigmas are cut to this part of the schedule (start/end steps, denoise), added noise and leftover noise are settled,
  and the guider holds its conditionings and scales; ``prepare_sampling`` (which loads the diffusion model onto the
  device) has not run. The wrapper never calls its executor, so ComfyUI's process does not load the diffusion model
  onto its own GPU while the ranks sample (on a two-GPU rig that would put a second copy on GPU 0).
* **The ranks run the same loop.** What travels: the guider without its model (its class by reference, its state:
  conditionings, scales), the sampler object, the sigmas, noise, latent, mask and seed; the model itself once per
  weights and patches (:func:`.model.portable_parts`), its ``model_options`` and object patches with each run. Each
  rank rebuilds the guider around its own ModelPatcher and calls ``guider.sample``: ComfyUI's own sampler loop, with
  PatchRay's rank wrappers doing the split (:mod:`.ksampler_rank`). The result is rank 0's exact final latent.
* **Refused by name, before any rank starts**: a patch, guider, sampler or option that cannot travel (objects
  holding a model, code the ranks cannot import), and everything the layout cannot honour (:mod:`.model`'s checks).
  Code from another custom-node pack travels by value (``cloudpickle``), so a third-party sampler function or guider
  class works on the ranks without that pack being importable there.
* **What ran is shown where the user looks**: ``Hooks.report`` receives the summary (ranks, parallelism, attention,
  sharding, model calls, bytes exchanged per step, seconds per step).
"""

from __future__ import annotations

import logging
import math
import operator
import time
from typing import Callable, NamedTuple, Optional

import torch

from . import ksampler_rank
from . import model as bridge_model
from . import runtime_check
from . import shard_models as bridge_shard
from . import validate
from .errors import rank_errors_for_user
from .sampling_options import SamplingOptions
from .auto_plan import words_bytes
from .rank_call import OUTER_KEY, check_call_memory, guider_scale, portable_guider, rank_call_shape, rank_inputs

__all__ = [
    "OUTER_KEY", "Hooks", "patch_model", "parallel_options", "sample_guided", "rank_inputs", "guider_scale", "portable_guider",
    "layout_summary", "attention_note", "rank_call_shape", "check_call_memory", "config_name",
]

log = logging.getLogger(__name__)


# samplers whose step control reads the whole latent: with OTIL's approximate remote regions the ranks would take
# different numbers of steps, and their collectives would not line up
_ADAPTIVE = ("dpm_adaptive",)


class Hooks(NamedTuple):
    """What the node layer lends the sampling run (all optional; ``None`` outside a ComfyUI server).

    Args:
        cancel_check: ComfyUI's interrupt check, polled while the ranks work.
        progress: ``progress(total) -> fn(done, total)``: a progress bar for the node that is sampling.
        report: ``report(line)``: the lines the user should read (what ran, notes).
        stats: ``stats(record)``: what ran as figures (layout, model calls, steps, seconds, bytes exchanged per step,
            attention calls), for a benchmark.
    """

    cancel_check: Optional[Callable[[], None]] = None
    progress: Optional[Callable[[int], Callable[[int, int], None]]] = None
    report: Optional[Callable[[str], None]] = None
    stats: Optional[Callable[[dict], None]] = None


def patch_model(model, options: SamplingOptions, hooks: Hooks = Hooks()):
    """A clone of ComfyUI MODEL ``model`` whose sampling runs on the ranks of ``options.cluster``.

    The clone shares the weights (ComfyUI's ``ModelPatcher.clone``); ``model`` itself is unchanged. Patching a MODEL
    that already carries PatchRay's wrapper replaces it (the last Parallel Model node's widgets win). What the MODEL
    already carries that cannot travel to the ranks is refused here, on the node, by name.
    """
    import comfy.patcher_extension as pe

    if not isinstance(options, SamplingOptions):
        raise TypeError(f"options must be SamplingOptions (got {type(options).__name__})")
    bridge_model.check_model_type(model)
    bridge_model.check_patches(model, ignore=(OUTER_KEY,))
    patched = model.clone()
    patched.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, OUTER_KEY)
    wrapper = _outer_sample(options, hooks)
    patched.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, OUTER_KEY, wrapper)
    return patched


def parallel_options(model) -> Optional[SamplingOptions]:
    """The options a MODEL was patched with (``None``: not a PatchRay Parallel Model)."""
    import comfy.patcher_extension as pe

    for fn in model.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, OUTER_KEY) or []:
        options = getattr(fn, "patchray_options", None)
        if options is not None:
            return options
    return None


def _outer_sample(options: SamplingOptions, hooks: Hooks):
    def wrapper(executor, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None, disable_pbar=False,
                seed=None):
        # the executor (ComfyUI's outer_sample, which loads the model here) is deliberately not called
        return sample_guided(executor.class_obj, noise, latent_image, sampler, sigmas, denoise_mask, callback, seed,
                             options, hooks)

    wrapper.patchray_options = options
    return wrapper


# ------------------------------------------------------------------------------------------- what travels


# ------------------------------------------------------------------------------------------- the run


def _conditioning(conds) -> list:
    """ComfyUI's converted conditionings (dicts) as CONDITIONING pairs, for the checks written against the latter."""
    return [[c.get("cross_attn"), c] for c in conds or [] if isinstance(c, dict)]


def _sequence_cond_reason(mp, kind: str, conds: dict) -> Optional[str]:
    """Why the conditionings keep this run from a sequence split (``None``: they do not): for a UNet area or mask
    conditions (its row bands cannot follow a crop; a DiT's split cuts each call's own tokens and follows them), for
    a DiT the row's own conditioning refusals (reference latents, text masks it cannot split)."""
    from .dit_models import cond_refusal, find_row

    for name, cond in conds.items():
        for item in cond:
            extra = item[1] if len(item) > 1 and isinstance(item[1], dict) else {}
            for key in ("area", "mask"):
                if extra.get(key) is not None and kind != "dit":
                    return f"{key} conditioning in {name} crops the latent, which a band of rows cannot follow"
    if kind == "dit":
        row = find_row(type(mp.model.diffusion_model).__name__)
        for name, cond in conds.items():
            why = cond_refusal(row, name, cond) if row is not None else None
            if why:
                return why.split(": ", 1)[-1].split("; use parallelism")[0]
    return None


def sample_guided(guider, noise, latent_image, sampler, sigmas, denoise_mask, callback, seed, options: SamplingOptions,
                  hooks: Hooks = Hooks()) -> torch.Tensor:
    """``guider.outer_sample`` on the ranks of ``options.cluster``: returns the latent ComfyUI's own call would
    (``process_latent_out`` applied), computed by the ranks.

    Raises:
        ValueError / TypeError / NotImplementedError: refused inputs, before any rank starts or any weight ships.
        RankFailure: a rank failed (clean message; the trace is chained for the log).
    """
    from ...distributed.cluster import get_cluster
    from ...distributed.sampling.config import LayerMode, OutputMode
    from ...distributed.sampling.remote import distributed_sample
    from ...distributed.sampling.ship import ship_model
    from ...distributed.topology.throughput import cluster_band_weights
    from .dit_layout import plan_layout
    from .dit_models import cond_refusal, find_row

    mp = guider.model_patcher
    bridge_model.check_model_type(mp)
    kind = bridge_model.diffusion_kind(mp)
    latent = latent_image
    if latent.dim() not in (4, 5):
        raise ValueError(f"PatchRay Parallel Model takes image latents [B, C, H, W] or video latents [B, C, T, H, W]; "
                         f"got shape {tuple(latent.shape)}")
    bridge_model.check_latent_channels(mp, latent)
    steps = max(0, int(sigmas.shape[-1]) - 1)
    config = options.patch_config(mp)
    stale = config.layer_mode is not LayerMode.FULL_SYNC or config.output is not OutputMode.GATHER
    fn = getattr(sampler, "sampler_function", None)
    if config.output is OutputMode.OTIL and any(a in getattr(fn, "__name__", "") for a in _ADAPTIVE):
        raise ValueError("the sampler adapts its step count to the whole latent, which OTIL leaves approximate on each "
                         "rank; pick another sampler or preset")
    n = options.num_ranks
    no_sequence = bridge_model.sequence_refusal(mp)
    conds = {k: _conditioning(v) for k, v in (guider.original_conds or {}).items()}
    auto_note = None
    if options.parallelism == "auto" and no_sequence is None:
        # a conditioning the sequence split cannot follow: auto picks a whole-model split (cfg, batch) and says so
        why = _sequence_cond_reason(mp, kind, conds)
        if why:
            no_sequence = why
            auto_note = f"parallelism auto did not split by sequence: {why}"
    layout = plan_layout(options.parallelism, n, guider_scale(guider), int(latent.shape[0]),
                         sequence_refusal=no_sequence, stale_preset=stale)
    if auto_note:
        layout = layout._replace(note="; ".join(x for x in (layout.note, f"{auto_note}; ran as {layout.mode}") if x))
    planned = None
    if options.parallelism == "auto" and not stale and n > 1 and options.sharding == "none" and layout.mode != "replicated":
        # the measured plan: the fastest exact layout on this rig, from one measured call (auto_plan)
        from . import auto_plan

        with rank_errors_for_user():
            planned = auto_plan.measured_layout(
                layout, mp=mp, options=options, cfg_on=not math.isclose(guider_scale(guider), 1.0),
                batch=int(latent.shape[0]), latent_shape=tuple(latent.shape), sequence_ok=no_sequence is None,
                check_layout=lambda lay: auto_plan.check_layout(mp, latent, lay, kind, options.sequence_attention),
                probe=lambda: auto_plan.probe_run(guider, noise, latent, sampler, sigmas, denoise_mask, seed, options,
                                                  hooks, kind, config),
                memory=lambda: auto_plan.ranks_memory(options, hooks))
        layout = planned.layout._replace(note=layout.note if planned.layout.mode == layout.mode else "")
        if planned.line:
            log.info("PatchRay: %s", planned.line)
            if hooks.report is not None:
                hooks.report(planned.line)  # before the ranks sample: the panel shows the plan while they work
    elif options.parallelism == "auto" and stale and n > 1 and layout.mode == "sequence" and hooks.report is not None:
        hooks.report(f"plan: sequence (preset {config_name(config)} works between sequence ranks; auto measures a plan "
                     "for the exact presets)")
    if layout.note:
        log.warning("PatchRay: %s", layout.note)
    if options.preset == "auto" and options.parallelism == "auto":
        config = options.patch_config(mp, layout.mode)  # auto's preset for the ranks that share the latent
        stale = config.layer_mode is not LayerMode.FULL_SYNC or config.output is not OutputMode.GATHER
    name = config_name(config)
    if stale and kind == "unet" and layout.mode != "sequence":
        raise ValueError(
            f"preset {name} (stale neighbour data) is the UNet's row-band patch parallelism: it applies to "
            f"parallelism=sequence on SD 1.x/2.x/SDXL UNets; this run is parallelism={layout.mode}: pick preset full_sync")
    if stale and kind == "dit" and layout.seq_ranks < 2:
        raise ValueError(
            f"preset {name} (stale K/V between sequence ranks) needs sequence ranks; this run is "
            f"parallelism={layout.mode} with {layout.seq_ranks} sequence rank(s) per group: pick preset full_sync or "
            f"parallelism sequence / cfg+sequence")
    attention = options.sequence_attention
    if stale and kind == "dit" and attention == "ulysses":
        raise ValueError(
            f"preset {name} keeps earlier steps' K/V in a gathered memory; sequence_attention=ulysses exchanges this "
            f"step's queries, keys and values: pick sequence_attention gathered or auto")
    if layout.seq_ranks > 1:
        if kind == "unet":  # in node terms, before the ranks start or weights ship (DiT rows: check_sequence)
            validate.sampling_rows(mp, latent, layout.seq_ranks)
        bridge_model.check_sequence(mp, latent, layout.seq_ranks)
        if kind == "dit":
            dm = mp.model.diffusion_model
            row = find_row(type(dm).__name__)
            for cname, cond in conds.items():
                why = cond_refusal(row, cname, cond)
                if why:
                    raise NotImplementedError(why)
            heads = int(operator.attrgetter(row.heads)(dm))  # a dotted path ("transformer_blocks.0.attn1.heads")
            if attention == "ulysses" and heads % layout.seq_ranks:
                raise ValueError(
                    f"sequence_attention=ulysses splits the {heads} attention heads over the {layout.seq_ranks} sequence "
                    f"ranks, which does not divide; pick auto, gathered, overlapped or ring (all exact), or a rank "
                    f"count on the PatchRay Cluster node that divides {heads}")
    for cname, cond in conds.items():
        bridge_model.check_conditioning(cname, cond, layout.mode, kind)
        if kind == "dit" and layout.seq_ranks > 1:
            bridge_model.check_area_sequence(mp, cname, cond, tuple(latent.shape), layout.seq_ranks)
    key, make_skeleton, names, tensor, sizes = bridge_model.portable_parts(mp, layout.mode, ignore=(OUTER_KEY,))
    dm = mp.model.diffusion_model
    sharding = options.sharding
    if sharding in bridge_shard.SHARDED:
        bridge_shard.blocks_for(dm, sharding)  # an uncovered class is refused before the ranks start
    inputs = rank_inputs(guider, noise, latent, sampler, sigmas, denoise_mask, seed, layout, kind, attention)
    check_key = check_mode = verdict = None
    if layout.seq_ranks > 1 and kind == "dit":
        # the split depends on ComfyUI's internals of this class: checked once per class, versions and mode
        check_mode = f"sequence/{attention}"
        check_key, verdict = runtime_check.cached_verdict(type(dm).__name__, check_mode)
        if verdict is not None and not verdict.ok:
            raise runtime_check.refusal(type(dm).__name__, check_mode, verdict)
        inputs["verify"] = verdict is None
    root = bridge_model.comfy_root()
    progress = hooks.progress(steps) if hooks.progress is not None and steps else None
    cluster_config = options.cluster
    with rank_errors_for_user():
        rank_cluster = get_cluster(cluster_config, cancel_check=hooks.cancel_check)  # the ranks start here on first use
        weights = cluster_band_weights(rank_cluster, options.balance) if layout.seq_ranks > 1 else None
        free_min = total_min = None
        host_ranks = False
        if n > 1:
            mem = rank_cluster.run(ksampler_rank.device_memory, timeout_s=60.0, cancel_check=hooks.cancel_check)
            # a size no rank can hold is refused here, before any weight ships or a rank allocates
            check_call_memory(mp, tuple(latent.shape), layout, mem)
            if sharding == "auto":
                free_min, total_min = min(m[0] for m in mem), min(m[1] for m in mem)
                host_ranks = all(len(m) > 2 and m[2] == "cpu" for m in mem)
        from .sampling_options import link_profile

        # the link only words the advice (is an offloaded sharded step slower than one card with ComfyUI's offload?)
        link = link_profile(cluster_config) if sharding in ("auto", "blocks+offload") and n > 1 else None
        resolved, why = bridge_shard.resolve_sharding(sharding, dm, n, free_min, total_min, link=link, host_ranks=host_ranks)
        cost = bridge_shard.offload_advice(dm, n, link) if resolved == "blocks+offload" and n > 1 else None
        level = logging.WARNING if cost is not None and cost.slower else logging.INFO
        if sharding == "auto":
            log.log(level, "PatchRay: %s", why)
        elif cost is not None:
            log.log(level, "PatchRay: sharding=blocks+offload: %s", cost.text)
        if cost is not None:
            # the shards go to pinned host memory: refuse, before any weight ships, a machine whose available memory
            # cannot hold its ranks' shards
            hosts = rank_cluster.run(ksampler_rank.host_memory, timeout_s=60.0, cancel_check=hooks.cancel_check)
            log.info("PatchRay: sharding=blocks+offload: %s", bridge_shard.check_host_memory(dm, n, hosts))
        key = key + (("sharding", resolved),)  # a sharded model and a whole one are different things on the ranks

        def make_payload(make=make_skeleton, resolved=resolved):
            return dict(make(), sharding=resolved)

        # the weights travel a part at a time (numpy views of Ray's shared store): beside ComfyUI's own weights the
        # host holds at most one part in flight (sampling/ship.py)
        ship_model(
            rank_cluster, key, make_payload, ksampler_rank.begin_parts, names=names, tensor=tensor,
            end=ksampler_rank.end_parts, sizes=sizes, prepare=ksampler_rank.prepare, prepare_args=(root,),
            cancel_check=hooks.cancel_check,
        )
        start = time.perf_counter()
        try:
            result = distributed_sample(
                rank_cluster, key, ksampler_rank.sample, inputs, config,
                prepare=ksampler_rank.prepare, prepare_args=(root,), cancel_check=hooks.cancel_check, progress=progress,
                timeout_s=cluster_config.call_timeout_s, band_weights=weights, return_traffic=True,
            )
        except Exception as exc:
            from ...distributed.cluster import caused_by
            from ...distributed.sampling.exactness import ExactnessMismatch

            if check_key is not None and caused_by(exc, ExactnessMismatch):
                failed = runtime_check.record_mismatch(check_key, str(exc))
                raise runtime_check.refusal(type(dm).__name__, check_mode, failed) from exc
            raise
        seconds = time.perf_counter() - start
    if result["calls"] == 0 and steps > 0:
        raise RuntimeError(
            "PatchRay: the ranks sampled without calling the model through PatchRay's wrapper (another extension "
            "replaced ComfyUI's diffusion-model call?); refusing to return an unsharded result")
    info = result.get("info") or {}
    check_line = None
    if check_key is not None:
        fresh = bool(info.get("exactness"))
        if fresh:
            verdict = runtime_check.record(check_key, info["exactness"])
        if verdict is not None:
            check_line = runtime_check.line(type(dm).__name__, check_mode, verdict, fresh)
    attention_calls = info.get("attention_calls")
    summary = layout_summary(layout, result["calls"], attention_calls)
    summary += f"; sharding {resolved}; preset {name}"
    per_step = _bytes_per_step(result.get("traffic"), steps)
    if steps:
        summary += f"; {seconds / steps:.3g} s/step over {steps} step{'s' if steps != 1 else ''}"
        if per_step is not None and n > 1:
            summary += f", {words_bytes(per_step)} exchanged per step"
        if info.get("comm_s") is not None and n > 1:
            summary += f", {info['comm_s']:.3g} s in communication"
    unused = attention_note(attention, kind, layout, attention_calls, sequence_ok=no_sequence is None) if result["calls"] else None
    log.info("PatchRay: %s", summary)
    if unused:
        log.info("PatchRay: %s", unused)
    newer = runtime_check.newer_comfyui_note()
    if newer:
        log.warning("PatchRay: %s", newer)
        check_line = f"{check_line}\nnote: {newer}" if check_line else f"note: {newer}"
    if check_line:
        log.info("PatchRay: %s", check_line)
    if hooks.report is not None:
        hooks.report(summary)
        if check_line:
            hooks.report(check_line)
        if planned is not None and planned.line and steps:
            from .auto_plan import after_line

            sent = info.get("comm_bytes")
            hooks.report(after_line(seconds, steps, sent / steps if sent is not None else per_step, info.get("comm_s"),
                                    planned.expected_s))
        if layout.note:
            hooks.report(f"note: {layout.note}")
        if unused:
            hooks.report(f"note: {unused}")
    if hooks.stats is not None:
        hooks.stats({"mode": layout.mode, "ranks": layout.num_ranks, "cfg_groups": layout.cfg_groups,
                     "seq_ranks": layout.seq_ranks, "calls": int(result["calls"]), "steps": steps, "seconds": seconds,
                     "bytes_per_step": per_step, "attention_calls": dict(attention_calls or {}), "sharding": resolved,
                     "preset": name, "comm_s": info.get("comm_s"),
                     "plan_expected_s": planned.expected_s if planned is not None else None})
    if progress is not None:
        progress(steps, steps)
    x0 = info.get("x0")
    if callback is not None and steps and x0 is not None:
        # ComfyUI's callback once, with rank 0's last denoised estimate: SamplerCustom's "denoised_output" reads it,
        # and the node's own progress bar completes (the ranks' steps drove ``progress`` meanwhile)
        callback(steps - 1, x0, result["latent"], steps)
    return result["latent"]


def _bytes_per_step(traffic: Optional[dict], steps: int) -> Optional[float]:
    if not traffic or not steps:
        return None
    return sum((traffic.get("bytes") or {}).values()) / steps


# ------------------------------------------------------------------------------------------- words and checks


def layout_summary(layout, calls: int, attention_calls: Optional[dict] = None) -> str:
    """One line: how the ranks shared the work (the node shows it; the log has it too), and with
    ``attention_calls`` (``{mode: attention calls}`` of a DiT's sequence ranks) the attention modes that ran."""
    how = {
        "sequence": f"each of the {layout.seq_ranks} ranks a band of the latent's rows",
        "cfg": "cond and uncond on different ranks",
        "cfg+sequence": f"2 CFG groups x {layout.seq_ranks} sequence ranks",
        "batch": "the batch rows split across the ranks",
        "replicated": "the whole model on every rank (no split)",
    }.get(layout.mode, layout.mode)
    line = f"parallelism {layout.mode} on {layout.num_ranks} rank(s): {how}; {calls} model calls"
    if attention_calls:
        ran = ", ".join(f"{mode} ({n} attention call{'s' if n != 1 else ''})" for mode, n in sorted(attention_calls.items()))
        line += f"; sequence attention {ran}"
    return line


def attention_note(requested: str, kind: str, layout, attention_calls: Optional[dict], *, sequence_ok: bool = True
                   ) -> Optional[str]:
    """Why the attention did not run as ``requested`` (the sequence_attention widget), or ``None``: a mode other
    than ``auto`` that no call ran (no DiT sequence ranks in this run), or that some calls ran another way (overlapped
    and ring attend with PyTorch's kernel over exact K/V: a call with an attention mask, or a stale preset's K/V,
    runs gathered). ``sequence_ok``: the model has a sequence split (a row of the DiT table)."""
    if requested == "auto":
        return None
    if kind != "dit" or layout.seq_ranks < 2 or not attention_calls:
        if kind != "dit":
            split = "a UNet's row bands" if layout.seq_ranks > 1 else f"parallelism {layout.mode} of a UNet"
        elif not sequence_ok:
            split = f"parallelism {layout.mode} of a model without a sequence split"
        else:
            split = f"parallelism {layout.mode} (parallelism sequence or cfg+sequence uses it)"
        return (f"sequence_attention={requested} was not used: it applies to a DiT's sequence ranks, and this run "
                f"is {split}")
    total = sum(attention_calls.values())
    other = {mode: n for mode, n in attention_calls.items() if mode != requested}
    if not other:
        return None
    how = ", ".join(f"{mode} in {n}" for mode, n in sorted(other.items()))
    return (f"sequence_attention={requested} ran {how} of {total} attention calls (overlapped and ring run a call "
            f"with an attention mask, or a stale preset's keys and values, gathered)")


def config_name(config) -> str:
    """The preset a PatchConfig came from (for messages)."""
    from ...distributed.sampling.config import PRESETS
    from .sampling_options import PRESET_NAMES

    for name in PRESET_NAMES:
        if name not in PRESETS:  # "auto" names a choice, not a config
            continue
        base = PRESETS[name].replace(split_batch=False)
        key = (base.layer_mode, base.output, base.groupnorm, base.exchange_bits)
        if key == (config.layer_mode, config.output, config.groupnorm, config.exchange_bits):
            return name
    return "(custom)"
