"""PatchRay Parallel Model: MODEL -> MODEL. Whatever sampler node then samples that MODEL runs on the cluster's ranks.

The ComfyUI way to change how a model runs is a model patch (a node that takes a MODEL and returns one: LoRA loaders,
ModelSampling, TorchCompileModel). This node is one: KSampler, KSampler (Advanced), SamplerCustom,
SamplerCustomAdvanced with any guider, and third-party samplers that go through ComfyUI's sampling functions then
sample on the ranks. The widgets are the Distributed KSampler's cluster widgets, under the same names. Schema only;
the work is one call into the bridge (:mod:`.bridge.parallel_model`).
"""

from __future__ import annotations

from ._comfy import interrupt_check, io, panel_report, progress_callback, ui
from .bridge import parallel_model as bridge_parallel
from .bridge.ksampler import sequence_families
from .bridge.sampling_options import (
    ATTENTION_NAMES, BALANCE_NAMES, PARALLELISM_NAMES, PRESET_HELP, PRESET_NAMES, SHARDING_NAMES, SamplingOptions,
)
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayParallelModel", "cluster_inputs", "sampling_options"]


def cluster_inputs() -> list:
    """The cluster and how its ranks share the work: the Parallel Model's inputs after the MODEL, and the Distributed KSamplers' after the sampler's."""
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
                "across the ranks (batch size >= ranks; every model). auto: the fastest of these on your rig, from one "
                "model call timed on the ranks on first use (kept on disk) and the GPUs' link; the node shows the plan "
                "and its expected s/step before sampling (a low-traffic preset: sequence; sharding other than none: "
                "batch if the batch divides evenly, else cfg (+sequence) when cfg > 1, else sequence). cfg = 1 turns "
                "cfg into sequence, with a note."
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


def sampling_options(cluster, preset="full_sync", warmup_steps=-1, refresh_every=-1, k_ratio=0.25, block_size=8,
                     parallelism="auto", sequence_attention="auto", balance="equal", sharding="none") -> SamplingOptions:
    """The widgets of :func:`cluster_inputs` as the bridge's typed options (validated: a bad value is refused here)."""
    return SamplingOptions(
        cluster=cluster, preset=preset, warmup_steps=warmup_steps, refresh_every=refresh_every, k_ratio=k_ratio,
        block_size=block_size, parallelism=parallelism, sequence_attention=sequence_attention, balance=balance,
        sharding=sharding,
    )


def run_hooks(report) -> "bridge_parallel.Hooks":
    """The cancel check, progress bar and report sink a sampling run on the ranks gets from ComfyUI."""
    return bridge_parallel.Hooks(cancel_check=interrupt_check(), progress=progress_callback, report=report)


class PatchRayParallelModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayParallelModel",
            display_name="PatchRay Parallel Model",
            category=f"{CATEGORY}/sampling",
            description=(
                "Makes any sampler node sample this MODEL on the cluster's ranks: KSampler, KSampler (Advanced), "
                "SamplerCustom, SamplerCustomAdvanced with any guider, or a third-party sampler that uses ComfyUI's "
                "sampling functions. Put it after the loaders and model patches (LoRA, ModelSampling...), before the "
                "sampler. parallelism: a band of latent rows per rank (sequence; "
                f"{sequence_families()}), cond and uncond on different ranks (cfg; every model), or the batch split "
                "(batch; every model). Exact (equal to sampling the MODEL without this node) with preset full_sync. "
                "ComfyUI's own process does not load the model onto its GPU: the ranks hold it. After a run this "
                "panel shows what ran."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model to sample on the cluster (from a loader; LoRAs and model patches applied)."),
                *cluster_inputs(),
            ],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The same model (weights shared), sampled on the cluster's ranks by any sampler node.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls, model, cluster, preset="full_sync", warmup_steps=-1, refresh_every=-1, k_ratio=0.25, block_size=8,
        parallelism="auto", sequence_attention="auto", balance="equal", sharding="none",
    ) -> io.NodeOutput:
        options = sampling_options(cluster, preset, warmup_steps, refresh_every, k_ratio, block_size, parallelism,
                                   sequence_attention, balance, sharding)
        node = getattr(getattr(cls, "hidden", None), "unique_id", None)
        patched = bridge_parallel.patch_model(model, options, run_hooks(panel_report(node)))
        plan = (f"samples on {options.num_ranks} rank(s): parallelism {parallelism}, preset {preset}, sharding "
                f"{sharding}; " + ("auto's plan shows here when the sampler starts, what ran after it runs"
                                   if parallelism == "auto" else "what ran shows here after the sampler runs"))
        return io.NodeOutput(patched, ui=ui.PreviewText(plan))
