"""The Distributed KSampler's one call: ComfyUI's MODEL, conditioning and LATENT in, the denoised LATENT out.

Driver side (ComfyUI's process). It resolves the ``parallelism`` widget to a layout of CFG groups, sequence ranks
and batch rows (:mod:`.dit_layout`), refuses what that layout cannot honour before anything is shipped, converts the
MODEL (:mod:`.model`), prepares the latent and the seeded noise exactly as the stock KSampler does, ships the model
once per weights and patches, and runs ComfyUI's own sampler on every rank (:mod:`.ksampler_rank`, named by its
canonical module path so the ranks can import it however ComfyUI loaded the pack).
"""

from __future__ import annotations

import logging
import operator
from typing import Callable, Optional

from . import model as bridge_model
from . import shard_models as bridge_shard
from . import validate
from .errors import rank_errors_for_user
from .shim import CANONICAL

__all__ = [
    "PRESET_NAMES", "PRESET_HELP", "PARALLELISM_NAMES", "sequence_families", "ATTENTION_NAMES", "BALANCE_NAMES", "SHARDING_NAMES", "patch_config",
    "auto_inputs",
    "link_profile", "sample", "steps_run", "rank_call_shape", "check_call_memory", "layout_summary", "attention_note",
]

log = logging.getLogger(__name__)

_RANK = f"{CANONICAL}.nodes.bridge.ksampler_rank"

PRESET_NAMES = ["full_sync", "auto", "displaced", "compressed", "compressed_2bit", "compressed_1bit", "otil", "otil_compressed", "balanced"]
#: the node's help text for each preset (the widget's tooltip is built from it)
PRESET_HELP = {
    "full_sync": "exact (equal to the stock KSampler): every layer exchanges every step",
    "auto": "picked from the GPUs' link and the number of ranks sharing the latent, by the modelled step time: "
            "displaced while its stream hides behind compute ((ranks - 1) x the model's exchange rate fits the link), "
            "compressed (or compressed_2bit on Ethernet) once it does not, full_sync when exact costs under 10% more "
            "(e.g. PCIe without P2P: displaced at 2 ranks, compressed at 4; NVLink: full_sync up to 3 ranks, "
            "displaced from 4; CPU ranks or no GPU link measured: full_sync)",
    "displaced": "DistriFusion/PipeFusion: the neighbours' halos and K/V of the previous step, sent asynchronously behind "
                 "compute; 4 exact warm-up steps",
    "compressed": "displaced, but the per-step refresh travels as 4-bit residuals with error feedback (CompactFusion): "
                  "~1/4 of displaced's bytes at displaced's error; for PCIe without P2P",
    "compressed_2bit": "compressed with 2-bit residuals: ~1/7.5 of displaced's bytes, slightly larger error (Ethernet)",
    "compressed_1bit": "compressed with 1-bit (sign) residuals: ~1/14 of displaced's bytes, larger error",
    "otil": "stale layers refreshed every 10 steps, plus only the top-k most-changed latent blocks sent per step (OTIL)",
    "otil_compressed": "compressed layers plus OTIL's top-k latent blocks as 4-bit residuals",
    "balanced": "stale layers refreshed every 5 steps, full output exchange",
}
PARALLELISM_NAMES = ["auto", "sequence", "cfg", "cfg+sequence", "batch"]  # dit_layout.MODES, without importing it here


def sequence_families() -> str:
    """The models ``parallelism=sequence`` covers, as the node's description names them (from the DiT table, so the
    description follows the table)."""
    from .dit_models import ROWS

    names = []
    for row in ROWS:
        name = row.family.split(" (")[0]
        if name not in names:
            names.append(name)
    return "UNets SD 1.x/2.x/SDXL and the DiTs " + ", ".join(names)

ATTENTION_NAMES = ["auto", "gathered", "overlapped", "ring", "ulysses"]
BALANCE_NAMES = ["equal", "speed"]  # topology.throughput.BALANCE_MODES, without importing it here
SHARDING_NAMES = bridge_shard.SHARDING_NAMES
# samplers whose step control reads the whole latent: with OTIL's approximate remote regions the ranks would take
# different numbers of steps, and their collectives would not line up
_ADAPTIVE = {"dpm_adaptive"}


def link_profile(cluster_config) -> Optional[str]:
    """The named link profile nearest to the cluster's slowest GPU link (the topology probe, once per cluster
    configuration, no bandwidth runs); ``None`` for CPU ranks or when no link is known."""
    if getattr(cluster_config, "device", "auto") == "cpu":
        return None
    try:
        from ...distributed.topology import cached_probe
        from ...distributed.topology.links import bottleneck_link, nearest_profile

        link = bottleneck_link(cached_probe(("ksampler-auto", cluster_config), measure=False))
        prof = nearest_profile(link.bandwidth_gbps, link.via_host) if link.bandwidth_gbps else None
        return prof.name if prof is not None else None
    except Exception as exc:  # advice is optional: never fail a sampling run over it
        log.debug("topology probe unavailable: %s", exc)
        return None


def auto_inputs(model, cluster_config, parallelism: str = "auto") -> dict:
    """What ``preset=auto`` decides from, as :func:`patch_config`'s keywords: the link profile (:func:`link_profile`),
    the ranks that share the latent and the model kind (``unet`` / ``dit``).

    The ranks that share the latent: one under ``cfg`` and ``batch`` (every rank holds whole latents, so ``auto``
    gives the exact preset), half the cluster's under ``cfg+sequence``, all of them under ``sequence`` and ``auto``
    parallelism (decided later, per call; counting all errs towards less traffic)."""
    n = int(getattr(cluster_config, "num_ranks", 1) or 1)
    ranks = {"cfg": 1, "batch": 1, "cfg+sequence": max(1, n // 2)}.get(parallelism, n)
    try:
        kind = bridge_model.diffusion_kind(model)
    except Exception as exc:  # refused later, in the user's terms, by sample()'s own checks
        log.debug("model kind unknown for preset auto: %s", exc)
        kind = "unet"
    return {"link": link_profile(cluster_config), "ranks": ranks, "kind": kind}


def patch_config(preset: str, warmup_steps: int = -1, refresh_every: int = -1, k_ratio: float = 0.25, block_size: int = 8,
                 link: Optional[str] = None, ranks: Optional[int] = None, kind: str = "unet"):
    """The PatchConfig for the node's widgets (-1: the preset's own value). CFG is not split across ranks.

    ``preset="auto"`` picks one from ``link`` (a link profile name, :func:`link_profile`), ``ranks`` (the ranks that
    share the latent; ``None``: the link class alone) and ``kind`` (``unet`` / ``dit``): see :data:`PRESET_HELP` and
    :func:`auto_inputs`.
    """
    from ...distributed.sampling.config import OutputMode, auto_preset, preset as make

    if preset not in PRESET_NAMES:
        raise ValueError(f"preset must be one of {PRESET_NAMES} (got {preset!r})")
    if preset == "auto":
        preset = auto_preset(link, ranks, kind=kind)
        log.info("PatchRay KSampler: preset auto -> %s (link %s, %s ranks, %s)", preset, link or "unknown",
                 ranks if ranks is not None else "?", kind)
    over = {"split_batch": False}  # ComfyUI may evaluate cond and uncond in separate calls: every rank takes both
    if preset != "full_sync":
        if int(warmup_steps) >= 0:
            over["warmup_steps"] = int(warmup_steps)
        if int(refresh_every) >= 0:
            over["refresh_every"] = int(refresh_every)
    config = make(preset, **over)
    if config.output is OutputMode.OTIL:
        config = config.replace(k_ratio=float(k_ratio), block_size=int(block_size))
    return config


def steps_run(total: int, start_step: Optional[int] = None, last_step: Optional[int] = None) -> int:
    """How many steps of a ``total``-step schedule (``len(sigmas) - 1``) ComfyUI's sampler runs from ``start_step`` to
    ``last_step`` (``comfy.samplers.KSampler.sample``: the sigmas are cut at ``last_step``, then from ``start_step``; a
    start at or past the cut runs none and returns the latent as it came)."""
    end = int(total) if last_step is None else min(int(total), int(last_step))
    return max(0, end - int(start_step or 0))


def sample(
    model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise, cluster_config, config,
    *, parallelism: str = "auto", attention: str = "auto", balance: str = "equal", sharding: str = "none",
    add_noise: bool = True, start_step: Optional[int] = None, last_step: Optional[int] = None,
    force_full_denoise: bool = False,
    cancel_check: Optional[Callable[[], None]] = None, progress: Optional[Callable[[int, int], None]] = None,
    report: Optional[Callable[[str], None]] = None,
) -> dict:
    """Run the KSampler on the ranks of ``cluster_config``; return the LATENT dict.

    Args:
        add_noise, start_step, last_step, force_full_denoise: KSamplerAdvanced's part of the schedule, passed to
            ComfyUI's sampler on every rank as the stock node passes them (``nodes.common_ksampler``): no noise
            added (a latent with the previous sampler's leftover noise), the steps ``[start_step, last_step)`` of
            ``steps``, and whether the last of them denoises fully. The defaults are the stock KSampler's.
        config: the :class:`PatchConfig` (:func:`patch_config`) of the UNet's row-band patch parallelism.
        parallelism: the node's widget (:data:`PARALLELISM_NAMES`; see :mod:`.dit_layout`).
        attention: sequence-parallel attention of DiTs: ``gathered`` K/V, ``overlapped`` (gathered, the gather in
            flight behind the rank's own keys' part), ``ring`` (the K/V point to point, one peer per stage, each
            peer's part attended while the next travels), ``ulysses`` (heads must divide by the sequence ranks) or
            ``auto`` (per call, from the modelled link cost; on NCCL gathered calls become overlapped at 2 ranks,
            ring from 3).
        balance: the sequence split's bands (UNet row bands, DiT token shards): ``equal``, or ``speed``
            (proportional to each rank's measured throughput, measured once per cluster; the result is the same).
        sharding: the diffusion model's weights on the ranks: ``none`` (each rank holds all of them), ``blocks``
            (1/N of each block per rank, FSDP2, gathered per block as it runs; :mod:`.shard_models`),
            ``blocks+offload`` (``blocks`` with the shards in the host's pinned memory, copied to the card per block;
            refused before anything ships when a machine's available memory cannot hold its ranks' shards) or
            ``auto`` (none -> blocks -> blocks+offload, from the smallest card's free memory).
        cancel_check: ComfyUI's interrupt check, polled while the ranks work.
        progress: ``fn(done, total)`` for ComfyUI's progress bar.
        report: ``fn(line)`` receives what the user should read on the node: how the ranks shared the work, and
            why a requested parallelism was changed (cfg = 1).

    Raises:
        ValueError / TypeError / NotImplementedError: refused inputs, before anything is shipped.
        RankFailure: a rank failed (clean message; the trace is chained for the log).
    """
    from ...distributed.cluster import ClusterConfig, get_cluster
    from ...distributed.sampling.config import LayerMode, OutputMode
    from ...distributed.sampling.remote import distributed_sample
    from ...distributed.sampling.ship import ship_model_in_parts
    from ...distributed.topology.throughput import cluster_band_weights
    from .dit_layout import plan_layout
    from .dit_models import cond_refusal, find_row

    if parallelism not in PARALLELISM_NAMES:
        raise ValueError(f"parallelism must be one of {PARALLELISM_NAMES} (got {parallelism!r})")
    if attention not in ATTENTION_NAMES:
        raise ValueError(f"sequence_attention must be one of {ATTENTION_NAMES} (got {attention!r})")
    if balance not in BALANCE_NAMES:
        raise ValueError(f"balance must be one of {BALANCE_NAMES} (got {balance!r})")
    if sharding not in SHARDING_NAMES:
        raise ValueError(f"sharding must be one of {SHARDING_NAMES} (got {sharding!r})")
    for name, value in (("start_at_step", start_step), ("end_at_step", last_step)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a step number >= 0 (got {value!r})")
    if sampler_name in _ADAPTIVE and config.output is OutputMode.OTIL:
        raise ValueError(f"sampler {sampler_name!r} adapts its step count to the whole latent, which OTIL leaves approximate on each rank; pick another sampler or preset")
    if not isinstance(cluster_config, ClusterConfig):
        raise TypeError(f"cluster must come from a PatchRay Cluster node (got {type(cluster_config).__name__})")
    if not isinstance(latent_image, dict) or "samples" not in latent_image:
        raise TypeError("latent_image must be a ComfyUI LATENT (a dict with 'samples')")
    bridge_model.check_model_type(model)
    kind = bridge_model.diffusion_kind(model)
    stale = config.layer_mode is not LayerMode.FULL_SYNC or config.output is not OutputMode.GATHER
    latent, noise = bridge_model.latent_and_noise(model, latent_image, seed, add_noise=add_noise)
    total = steps
    if start_step is not None or last_step is not None:
        total = bridge_model.schedule_steps(model, steps, sampler_name, scheduler, denoise)
    if start_step is not None and steps_run(total, start_step, last_step) == 0:
        # ComfyUI's sampler returns the latent as it came, calling no model: so does this, before any rank starts
        end = total if last_step is None else min(total, last_step)
        if report is not None:
            report(f"start_at_step {start_step} is at or past the end of this part of the schedule (step {end} of "
                   f"{total}): nothing to sample, the latent is returned as it came, as the stock KSampler (Advanced) does")
        out = latent_image.copy()
        out["samples"] = latent
        return out
    n = cluster_config.num_ranks
    no_sequence = bridge_model.sequence_refusal(model)
    layout = plan_layout(
        parallelism, n, cfg, int(latent.shape[0]),
        sequence_refusal=no_sequence, unet_stale_preset=kind == "unet" and stale,
    )
    if layout.note:
        log.warning("PatchRay KSampler: %s", layout.note)
    if stale and kind == "unet" and layout.mode != "sequence":
        raise ValueError(
            f"preset {config_name(config)} (stale neighbour data) is the UNet's row-band patch parallelism: it applies to "
            f"parallelism=sequence on SD 1.x/2.x/SDXL UNets; this run is parallelism={layout.mode}: pick preset full_sync"
        )
    if stale and kind == "dit" and layout.seq_ranks < 2:
        raise ValueError(
            f"preset {config_name(config)} (stale K/V between sequence ranks) needs sequence ranks; this run is "
            f"parallelism={layout.mode} with {layout.seq_ranks} sequence rank(s) per group: pick preset full_sync or "
            f"parallelism sequence / cfg+sequence"
        )
    if stale and kind == "dit" and attention == "ulysses":
        raise ValueError(
            f"preset {config_name(config)} keeps earlier steps' K/V in a gathered memory; sequence_attention=ulysses "
            f"exchanges this step's queries, keys and values: pick sequence_attention gathered or auto"
        )
    if layout.seq_ranks > 1:
        if kind == "unet":  # in node terms, before the ranks start or weights ship (DiT rows: check_sequence)
            validate.sampling_rows(model, latent, layout.seq_ranks)
        bridge_model.check_sequence(model, latent, layout.seq_ranks)
        if kind == "dit":
            dm = model.model.diffusion_model
            row = find_row(type(dm).__name__)
            for name, cond in (("positive", positive), ("negative", negative)):
                why = cond_refusal(row, name, cond)
                if why:
                    raise NotImplementedError(why)
            heads = int(operator.attrgetter(row.heads)(dm))  # a dotted path ("transformer_blocks.0.attn1.heads")
            if attention == "ulysses" and heads % layout.seq_ranks:
                raise ValueError(
                    f"sequence_attention=ulysses splits the {heads} attention heads over the {layout.seq_ranks} sequence "
                    f"ranks, which does not divide; pick auto, gathered, overlapped or ring (all exact), or a rank "
                    f"count on the PatchRay Cluster node that divides {heads}"
                )
    bridge_model.check_conditioning("positive", positive, layout.mode)
    bridge_model.check_conditioning("negative", negative, layout.mode)
    key, make_skeleton, names, tensor, sizes = bridge_model.portable_parts(model, layout.mode)
    dm = model.model.diffusion_model
    if sharding in bridge_shard.SHARDED:
        bridge_shard.blocks_for(dm, sharding)  # an uncovered class is refused before the ranks start

    inputs = {
        "noise": noise, "latent_image": latent, "noise_mask": latent_image.get("noise_mask"), "seed": int(seed),
        "steps": int(steps), "cfg": float(cfg), "sampler_name": sampler_name, "scheduler": scheduler,
        "denoise": float(denoise), "positive": positive, "negative": negative, "model_options": model.model_options,
        "object_patches": dict(model.object_patches), "layout": layout._asdict(), "kind": kind, "attention": attention,
        "disable_noise": not add_noise, "start_step": start_step, "last_step": last_step,
        "force_full_denoise": bool(force_full_denoise),
    }
    root = bridge_model.comfy_root()
    with rank_errors_for_user():
        rank_cluster = get_cluster(cluster_config, cancel_check=cancel_check)  # the ranks start here on first use
        # bands by speed only where the run splits a sequence: CFG/batch layouts give every rank whole work
        weights = cluster_band_weights(rank_cluster, balance) if layout.seq_ranks > 1 else None
        free_min = total_min = None
        host_ranks = False
        if n > 1:
            mem = rank_cluster.run(f"{_RANK}:device_memory", timeout_s=60.0, cancel_check=cancel_check)
            # a size no rank can hold is refused here, before any weight ships or a rank allocates
            check_call_memory(model, tuple(latent.shape), layout, mem)
            if sharding == "auto":
                free_min, total_min = min(m[0] for m in mem), min(m[1] for m in mem)
                host_ranks = all(len(m) > 2 and m[2] == "cpu" for m in mem)
        # the link only words the advice (is an offloaded sharded step slower than one card with ComfyUI's offload?)
        link = link_profile(cluster_config) if sharding in ("auto", "blocks+offload") and n > 1 else None
        resolved, why = bridge_shard.resolve_sharding(sharding, dm, n, free_min, total_min, link=link, host_ranks=host_ranks)
        cost = bridge_shard.offload_advice(dm, n, link) if resolved == "blocks+offload" and n > 1 else None
        # said plainly where the user looks: a warning when the offloaded sharded step is modelled slower than one
        # card with ComfyUI's own offload
        level = logging.WARNING if cost is not None and cost.slower else logging.INFO
        if sharding == "auto":
            log.log(level, "PatchRay KSampler: %s", why)
        elif cost is not None:
            log.log(level, "PatchRay KSampler: sharding=blocks+offload: %s", cost.text)
        if cost is not None:
            # the shards go to pinned host memory: refuse, in the node's terms and before any weight ships, a machine
            # whose available memory cannot hold its ranks' shards
            hosts = rank_cluster.run(f"{_RANK}:host_memory", timeout_s=60.0, cancel_check=cancel_check)
            log.info("PatchRay KSampler: sharding=blocks+offload: %s", bridge_shard.check_host_memory(dm, n, hosts))
        key = key + (("sharding", resolved),)  # a sharded model and a whole one are different things on the ranks

        def make_payload(make=make_skeleton, resolved=resolved):
            return dict(make(), sharding=resolved)

        # the weights travel a part at a time (numpy views of Ray's shared store): beside ComfyUI's own weights the
        # host holds at most one part in flight (sampling/ship.py)
        ship_model_in_parts(
            rank_cluster, key, make_payload, names, tensor, f"{_RANK}:begin_parts", end=f"{_RANK}:end_parts", sizes=sizes,
            prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel_check,
        )
        result = distributed_sample(
            rank_cluster, key, f"{_RANK}:sample", inputs, config,
            prepare=f"{_RANK}:prepare", prepare_args=(root,), cancel_check=cancel_check, progress=progress,
            timeout_s=cluster_config.call_timeout_s, band_weights=weights,
        )
    if result["calls"] == 0 and float(denoise) > 0 and steps_run(total, start_step, last_step) > 0:
        raise RuntimeError(
            "PatchRay Distributed KSampler: the ranks sampled without calling the model through PatchRay's wrapper "
            "(another extension replaced ComfyUI's diffusion-model call?); refusing to return an unsharded result"
        )
    attention_calls = (result.get("info") or {}).get("attention_calls")
    summary = layout_summary(layout, result["calls"], attention_calls)
    # no model call ran (denoise 0, or an end step of 0): no attention mode to speak of
    unused = attention_note(attention, kind, layout, attention_calls, sequence_ok=no_sequence is None) if result["calls"] else None
    log.info("PatchRay KSampler: %s", summary)
    if unused:
        log.info("PatchRay KSampler: %s", unused)
    if report is not None:
        report(summary)
        if layout.note:
            report(f"note: {layout.note}")
        if unused:
            report(f"note: {unused}")
    out = latent_image.copy()
    out["samples"] = result["latent"]
    return out


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


_GIB = 1024**3


def rank_call_shape(latent_shape: tuple, layout) -> tuple:
    """The smallest model call a rank of ``layout`` makes for a latent of ``latent_shape``: ComfyUI evaluates one
    conditioning at a time when memory is short (all of the latent's batch rows), ``batch`` gives each rank its share
    of those rows, and sequence ranks take a band of the rows (the last but one dimension, all frames)."""
    shape = list(latent_shape)
    n = max(1, int(layout.num_ranks))
    if layout.batch:
        shape[0] = -(-shape[0] // n)
    if layout.seq_ranks > 1:
        shape[-2] = -(-shape[-2] // int(layout.seq_ranks))
    return tuple(shape)


def check_call_memory(model, latent_shape: tuple, layout, memory) -> None:
    """Refuse, before anything ships, a latent whose smallest model call on a rank ComfyUI itself estimates larger than
    the memory that rank can use (``BaseModel.memory_required``, the figure ComfyUI plans its loads and batching with).

    What a rank can use: GPU ranks their card (ComfyUI offloads weights to make room for the activations); CPU ranks
    the host's available memory shared by the ranks on it (they run their calls at the same time, so N CPU ranks each
    sized against the whole free memory would together exhaust the machine).

    Args:
        model: the ComfyUI MODEL (its ``memory_required``).
        latent_shape: the latent as sampled (``[B, C, H, W]`` or ``[B, C, T, H, W]``).
        layout: the run's :class:`.dit_layout.Layout`.
        memory: per rank ``(free bytes, total bytes, device type)`` (``ksampler_rank.device_memory``).
    """
    estimate = getattr(getattr(model, "model", None), "memory_required", None)
    if estimate is None or not memory:
        return
    call = rank_call_shape(latent_shape, layout)
    try:
        need = float(estimate(list(call)))
    except Exception as exc:  # an estimate is advice: a model that cannot give one is not refused over it
        log.debug("memory estimate unavailable: %s", exc)
        return
    cpu = all(len(m) > 2 and m[2] == "cpu" for m in memory)
    if cpu:
        have = min(float(m[0]) for m in memory) / len(memory)  # embedded CPU ranks share one host's memory
        where = f"the host's available memory ({min(float(m[0]) for m in memory) / _GIB:.1f} GiB) shared by its {len(memory)} CPU ranks"
    else:
        have = min(float(m[1]) for m in memory)
        where = "the smallest rank's card"
    if need <= have:
        return
    shrink = (need / have) ** 0.5
    batch_hint = f" or batch_size (each rank's calls hold {call[0]} of the batch's {latent_shape[0]} rows)" if call[0] > 1 else ""
    raise ValueError(
        f"latent_image: ComfyUI estimates {need / _GIB:.1f} GiB for one model call on each rank at this size (latent "
        f"{'x'.join(str(d) for d in latent_shape[2:])}, {layout.mode} over {layout.num_ranks} ranks: each rank's call "
        f"covers {'x'.join(str(d) for d in call[2:])}); a rank has {have / _GIB:.1f} GiB ({where}). Lower width and "
        f"height about {shrink:.1f}x{batch_hint}, or use more ranks"
        + (" with parallelism sequence" if layout.seq_ranks <= 1 else "")
    )


def config_name(config) -> str:
    """The preset a PatchConfig came from (for messages)."""
    from ...distributed.sampling.config import PRESETS

    for name in PRESET_NAMES:
        if name not in PRESETS:  # "auto" names a choice, not a config
            continue
        base = PRESETS[name].replace(split_batch=False)
        key = (base.layer_mode, base.output, base.groupnorm, base.exchange_bits)
        if key == (config.layer_mode, config.output, config.groupnorm, config.exchange_bits):
            return name
    return "(custom)"
