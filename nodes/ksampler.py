"""Distributed KSampler: the stock KSampler's inputs, run on the cluster's ranks.

Every rank runs ComfyUI's own sampler and scheduler on the MODEL as loaded (LoRAs and patches applied). The
``parallelism`` widget picks how the ranks share the work: a band of latent rows each (``sequence``: UNets by
DistriFusion-style patch parallelism with the preset, DiTs by token sharding with exact attention), cond and
uncond on different ranks (``cfg``, ``cfg+sequence``), or the rows of the batch (``batch``). ``full_sync`` and every
parallelism equal the stock KSampler within floating-point tolerance. The advanced node adds the stock KSampler
(Advanced)'s start and end steps, added noise and leftover noise (two-model schedules such as Wan 2.2 14B's experts).
Both are the stock KSampler (Advanced) on a PatchRay Parallel Model (:mod:`.bridge.ksampler`): one code path.
"""

from __future__ import annotations

from ._comfy import io, sampler_lists, ui
from .bridge import ksampler as bridge_ksampler
from .parallel_model import cluster_inputs, run_hooks, sampling_options
from .types import CATEGORY

__all__ = ["PatchRayKSampler", "PatchRayKSamplerAdvanced"]


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
                *cluster_inputs(),
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
                *cluster_inputs(),
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
    options = sampling_options(cluster, preset, warmup_steps, refresh_every, k_ratio, block_size, parallelism,
                               sequence_attention, balance, sharding)
    lines = []
    latent = bridge_ksampler.ksample(
        model, options, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
        hooks=run_hooks(lines.append), **schedule,
    )
    return io.NodeOutput(latent, ui=ui.PreviewText("\n".join(lines)) if lines else None)
