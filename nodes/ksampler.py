"""Distributed KSampler: the stock KSampler's inputs, run on the cluster's ranks.

Every rank runs ComfyUI's own sampler and scheduler on the MODEL as loaded (LoRAs and patches applied). The
``parallelism`` widget picks how the ranks share the work: a band of latent rows each (``sequence``: UNets by
DistriFusion-style patch parallelism with the preset, DiTs by token sharding with exact attention), cond and
uncond on different ranks (``cfg``, ``cfg+sequence``), or the rows of the batch (``batch``). ``full_sync`` and every
parallelism equal the stock KSampler within floating-point tolerance. The advanced node adds the stock KSampler
(Advanced)'s start and end steps, added noise and leftover noise (two-model schedules such as Wan 2.2 14B's experts).
Schema only; the work is one call into the bridge (:mod:`.bridge.ksampler`).
"""

from __future__ import annotations

from ._comfy import interrupt_check, io, progress_callback, sampler_lists, ui
from .bridge import ksampler as bridge_ksampler
from .bridge.ksampler import ATTENTION_NAMES, BALANCE_NAMES, PARALLELISM_NAMES, PRESET_HELP, PRESET_NAMES, SHARDING_NAMES
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayKSampler", "PatchRayKSamplerAdvanced"]


def _cluster_inputs() -> list:
    """The inputs after the sampler's: the cluster and how its ranks share the work (both nodes)."""
    return [
        CLUSTER.Input("cluster", tooltip="The rank cluster, from PatchRay Cluster. How its ranks share the work: parallelism."),
        io.Combo.Input(
            "preset",
            options=PRESET_NAMES,
            default="full_sync",
            tooltip=" ".join(f"{name}: {PRESET_HELP[name]}." for name in PRESET_NAMES)
            + " UNets: parallelism sequence; DiTs: sequence or cfg+sequence, gathered or auto attention.",
        ),
        io.Int.Input("warmup_steps", default=-1, min=-1, max=1000, tooltip="Synchronous steps at the start (-1: the preset's, 4). Ignored by full_sync."),
        io.Int.Input("refresh_every", default=-1, min=-1, max=1000, tooltip="Run every Nth step synchronous to refresh stale data (-1: the preset's; 0: never). Ignored by full_sync."),
        io.Float.Input("k_ratio", default=0.25, min=0.01, max=1.0, step=0.01, tooltip="otil: fraction of each band's latent blocks sent per step (the OTIL paper: 0.25)."),
        io.Int.Input("block_size", default=8, min=1, max=64, tooltip="otil: side of a latent block in latent pixels (the OTIL paper: 8)."),
        io.Combo.Input(
            "parallelism",
            options=PARALLELISM_NAMES,
            default="auto",
            optional=True,
            tooltip=(
                "How the ranks share the work (all exact). sequence: each rank a band of latent rows, all frames "
                "(DiTs: its tokens, attention over every token; UNets: the preset's patch parallelism). cfg: cond "
                "on one rank, uncond on the other, outputs exchanged once per step (2 ranks; every model). "
                "cfg+sequence: 2 CFG groups of N/2 sequence ranks (4, 6, 8 ranks). batch: the latent batch split "
                "across the ranks (batch size >= ranks; every model). auto: batch if the batch divides evenly, "
                "else cfg (+sequence) when cfg > 1, else sequence. cfg = 1 turns cfg into sequence, with a note."
            ),
        ),
        io.Combo.Input(
            "sequence_attention",
            options=ATTENTION_NAMES,
            default="auto",
            optional=True,
            tooltip=(
                "DiT sequence parallelism's attention (all exact). gathered: every rank gathers all keys and "
                "values. overlapped: the same gather, running while the rank attends to its own keys. "
                "ring: the same keys and values sent to one peer at a time, each peer's part attended while "
                "the next travels (overlapped and ring: PyTorch's attention kernel; a call with a mask or a "
                "stale preset's keys and values runs gathered). ulysses: all-to-all over attention heads "
                "(heads must divide by the sequence ranks; less traffic from 3 ranks). auto: per layer, from "
                "the modelled link cost; on NCCL the gather is hidden (overlapped at 2 ranks, ring from 3). "
                "The node's text names the mode the attention calls ran."
            ),
        ),
        io.Combo.Input(
            "balance",
            options=BALANCE_NAMES,
            default="equal",
            optional=True,
            tooltip=(
                "How big each rank's band of latent rows is when the work is split by sequence. equal: the same "
                "for every rank. speed: proportional to each rank's measured speed (a short benchmark run once "
                "per cluster), so a faster GPU takes more rows and a mixed pair (e.g. 4090 + 3090) finishes "
                "together. The result is the same either way; cfg and batch splits are unaffected."
            ),
        ),
        io.Combo.Input(
            "sharding",
            options=SHARDING_NAMES,
            default="none",
            optional=True,
            tooltip=(
                "Where the model's weights live. none: every rank holds the whole model. blocks: each rank holds "
                "1/N of every transformer/UNet block and gathers a block's weights just before it runs (for models "
                "bigger than one card; fp8 stays fp8; costs one gather of the weights per model call over the "
                "link). blocks+offload: blocks with each rank's 1/N in pinned host RAM, copied to the card per "
                "block (for ranks that still do not fit; each rank also copies 1/N of the blocks host -> card per "
                "model call: on PCIe 4.0 x16 about 36 ms per GB, and on PCIe without peer-to-peer a step is then "
                "slower than one card with ComfyUI's own offload; refused, before loading, if the ranks' shards "
                "would not leave 10% (at least 4 GiB) of a machine's RAM free). auto, from the smallest card's free "
                "memory F and a reserve R (20% of the card, at least 3 GiB): none if the weights + R fit F, else "
                "blocks if 1/N of the blocks + the rest + R fit, else blocks+offload."
            ),
        ),
    ]


class PatchRayKSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        samplers, schedulers = sampler_lists()
        return io.Schema(
            node_id="PatchRayKSampler",
            display_name="PatchRay Distributed KSampler",
            category=f"{CATEGORY}/sampling",
            description=(
                "The KSampler across the cluster's ranks: every rank runs ComfyUI's own sampler and scheduler on the "
                f"MODEL as loaded. parallelism: a band of latent rows per rank (sequence; {bridge_ksampler.sequence_families()}), "
                "cond and uncond on different ranks (cfg; every model), or the batch split (batch; every model). "
                "Exact (equal to the stock KSampler) with preset full_sync; "
                "displaced/compressed/otil/balanced trade exactness for less traffic (UNets and DiTs); auto picks from the link and the number of ranks."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model (from a checkpoint loader; LoRAs and model patches applied)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True, tooltip="The random seed for the noise (same noise as the stock KSampler)."),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="The number of denoising steps."),
                io.Float.Input("cfg", default=8.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip="Classifier-free guidance scale."),
                io.Combo.Input("sampler_name", options=samplers, tooltip="ComfyUI's sampler, run on every rank."),
                io.Combo.Input("scheduler", options=schedulers, tooltip="ComfyUI's scheduler (the sigma schedule)."),
                io.Conditioning.Input("positive", tooltip="Positive conditioning."),
                io.Conditioning.Input("negative", tooltip="Negative conditioning."),
                io.Latent.Input("latent_image", tooltip="The latent to denoise (an Empty Latent Image for txt2img)."),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01, tooltip="How much of the schedule to run (1.0 = all; less for img2img)."),
                *_cluster_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT", tooltip="The denoised latent, like the stock KSampler's.")],
        )

    @classmethod
    def execute(
        cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise, cluster,
        preset="full_sync", warmup_steps=-1, refresh_every=-1, k_ratio=0.25, block_size=8, parallelism="auto",
        sequence_attention="auto", balance="equal", sharding="none",
    ) -> io.NodeOutput:
        return _sample(
            model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise, cluster, preset,
            warmup_steps, refresh_every, k_ratio, block_size, parallelism, sequence_attention, balance, sharding,
        )


class PatchRayKSamplerAdvanced(io.ComfyNode):
    """The stock KSamplerAdvanced's inputs on the cluster: part of a schedule, with or without added noise.

    Two of them in a row run a two-model schedule, as Wan 2.2 14B's high-noise and low-noise experts do: the first
    adds the noise, runs steps [0, k) and returns the leftover noise; the second adds none and runs [k, steps).
    """

    @classmethod
    def define_schema(cls):
        samplers, schedulers = sampler_lists()
        return io.Schema(
            node_id="PatchRayKSamplerAdvanced",
            display_name="PatchRay Distributed KSampler (Advanced)",
            category=f"{CATEGORY}/sampling",
            description=(
                "The KSampler (Advanced) across the cluster's ranks: the stock node's start and end steps, added noise "
                "and leftover noise, so two of them run a two-model schedule (Wan 2.2 14B's high-noise and low-noise "
                "experts, or a base and a refiner model). Every rank runs ComfyUI's own sampler on the MODEL as loaded; "
                "parallelism, preset and sharding as on the PatchRay Distributed KSampler. Exact (equal to the stock "
                "KSampler (Advanced)) with preset full_sync."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model (from a loader; LoRAs and model patches applied)."),
                io.Combo.Input("add_noise", options=["enable", "disable"], default="enable", tooltip="enable: add the seeded noise before the first step (the first sampler of a chain). disable: the latent already holds its noise (the second sampler of a chain)."),
                io.Int.Input("noise_seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True, tooltip="The random seed for the noise (same noise as the stock KSampler (Advanced))."),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="The number of steps of the whole schedule (both samplers of a chain give the same)."),
                io.Float.Input("cfg", default=8.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip="Classifier-free guidance scale."),
                io.Combo.Input("sampler_name", options=samplers, tooltip="ComfyUI's sampler, run on every rank."),
                io.Combo.Input("scheduler", options=schedulers, tooltip="ComfyUI's scheduler (the sigma schedule)."),
                io.Conditioning.Input("positive", tooltip="Positive conditioning."),
                io.Conditioning.Input("negative", tooltip="Negative conditioning."),
                io.Latent.Input("latent_image", tooltip="The latent to denoise: an empty latent for the first sampler, the first sampler's output for the second."),
                io.Int.Input("start_at_step", default=0, min=0, max=10000, tooltip="The first step of the schedule this sampler runs (0: from the start)."),
                io.Int.Input("end_at_step", default=10000, min=0, max=10000, tooltip="The step this sampler stops before (at least steps: to the end)."),
                io.Combo.Input("return_with_leftover_noise", options=["disable", "enable"], default="disable", tooltip="enable: stop with the noise of end_at_step left in the latent, for the next sampler of a chain. disable: denoise fully at the last step."),
                *_cluster_inputs(),
            ],
            outputs=[io.Latent.Output(display_name="LATENT", tooltip="The latent after these steps, like the stock KSampler (Advanced)'s.")],
        )

    @classmethod
    def execute(
        cls, model, add_noise, noise_seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
        start_at_step, end_at_step, return_with_leftover_noise, cluster, preset="full_sync", warmup_steps=-1,
        refresh_every=-1, k_ratio=0.25, block_size=8, parallelism="auto", sequence_attention="auto", balance="equal",
        sharding="none",
    ) -> io.NodeOutput:
        return _sample(
            model, noise_seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, 1.0, cluster, preset,
            warmup_steps, refresh_every, k_ratio, block_size, parallelism, sequence_attention, balance, sharding,
            add_noise=add_noise != "disable", start_step=start_at_step, last_step=end_at_step,
            force_full_denoise=return_with_leftover_noise != "enable",
        )


def _sample(
    model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise, cluster, preset,
    warmup_steps, refresh_every, k_ratio, block_size, parallelism, sequence_attention, balance, sharding, **schedule,
) -> io.NodeOutput:
    """Both nodes' one call into the bridge; ``schedule``: the advanced node's part of the schedule."""
    auto = bridge_ksampler.auto_inputs(model, cluster, parallelism) if preset == "auto" else {}
    config = bridge_ksampler.patch_config(preset, warmup_steps, refresh_every, k_ratio, block_size, **auto)
    progress = progress_callback(steps)
    lines = []
    latent = bridge_ksampler.sample(
        model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise, cluster, config,
        parallelism=parallelism, attention=sequence_attention, balance=balance, sharding=sharding,
        cancel_check=interrupt_check(), progress=progress, report=lines.append, **schedule,
    )
    if progress is not None:
        progress(steps, steps)
    return io.NodeOutput(latent, ui=ui.PreviewText("\n".join(lines)) if lines else None)
