"""Benchmark: run PatchRay's VAE benchmark for a family, shape and rank count; report JSON, chart and summary."""

from __future__ import annotations

import json
import os

from ._comfy import interrupt_check, io, measure_again, output_directory, progress_callback, sampler_lists
from .bridge import diagnostics, sampler_bench
from .bridge.images import png_to_image
from .bridge.parallel_model import Hooks
from .planner import FAMILY_NAMES, family_tooltip
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayBenchmark", "PatchRaySamplerBenchmark"]


class PatchRayBenchmark(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayBenchmark",
            display_name="PatchRay Benchmark",
            category=f"{CATEGORY}/diagnostics",
            description=(
                "Benchmarks distributed VAE decoding on the cluster for one family, shape and the cluster's rank count: the "
                "single-device reference, row mode and the tile plans, with latency, peak memory, bytes exchanged and the "
                "error against the single-device decode. The report JSON and its chart are saved to output/patchray/. "
                "With shape and size on auto it fits the device: on CPU ranks a quick suite (seconds), on GPUs the full model."
            ),
            is_experimental=True,
            is_output_node=True,
            not_idempotent=True,
            inputs=[
                CLUSTER.Input("cluster", tooltip="The rank cluster to benchmark on (its rank count is the benchmark's)."),
                io.Combo.Input("family", options=FAMILY_NAMES, default="kl", tooltip=family_tooltip("VAE family to benchmark (random weights of its architecture).")),
                io.String.Input("shape", default="auto", tooltip="Output size WIDTHxHEIGHT, or WIDTHxHEIGHTxFRAMES for video families (e.g. 832x480x81). auto: a size that fits the cluster's device (CPU ranks: 192x192 with the tiny model, a quick suite; GPU ranks: the family's first benchmark size)."),
                io.Combo.Input("size", options=["auto", "full", "tiny"], default="auto", tooltip="full: the released model's widths. tiny: a reduced-width model of the same architecture (quick CPU checks). auto: tiny on CPU ranks, full on GPU ranks."),
                io.Combo.Input("half", options=["decoder", "encoder"], default="decoder", tooltip="Which VAE half to benchmark (tile modes are decode-only)."),
                io.Int.Input("iters", default=2, min=1, max=100, tooltip="Timed invocations per mode (the latency is their median), after one warm-up."),
            ],
            outputs=[
                io.String.Output(display_name="report_json", tooltip="The benchmark report as JSON (also saved to output/patchray/)."),
                io.Image.Output(display_name="chart", tooltip="The report's chart: latency and memory per mode."),
                io.String.Output(display_name="summary", tooltip="The report as a table: one row per mode and shape."),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        return measure_again(**inputs)  # a measurement runs again on every prompt, never from the cache

    @classmethod
    def execute(cls, cluster, family, shape="auto", size="auto", half="decoder", iters=2) -> io.NodeOutput:
        # rank 0 reports (cases done, cases) while the benchmark runs
        report = diagnostics.benchmark(cluster, family, shape, size, half, iters, os.path.join(output_directory(), "patchray"),
                                       cancel_check=interrupt_check(), progress=progress_callback(1))
        ui = {"text": [report.text], "patchray_bench": [{"records": report.data["records"], "file": report.data["file"]}]}
        return io.NodeOutput(json.dumps(report.data["report"], indent=1), report.image, report.text, ui=ui)


class PatchRaySamplerBenchmark(io.ComfyNode):
    """A few steps of the user's own MODEL: ComfyUI's stock sampling, then each exact parallelism on the cluster."""

    @classmethod
    def define_schema(cls):
        samplers, schedulers = sampler_lists()
        return io.Schema(
            node_id="PatchRaySamplerBenchmark",
            display_name="PatchRay Sampler Benchmark",
            category=f"{CATEGORY}/diagnostics",
            description=(
                "Samples your MODEL a few steps with ComfyUI's own sampler in this process, then on the cluster's ranks "
                "in each exact parallelism (sequence, cfg, cfg+sequence, batch: each as PatchRay Parallel Model runs it), "
                "and reports s/step, the speed-up, bytes exchanged per step and the error against the stock result. "
                "Modes this model, latent or rank count cannot run are listed with the reason. Report JSON and chart "
                "saved to output/patchray/. Ranks that share one device measure contention, not a speed-up."
            ),
            is_experimental=True,
            is_output_node=True,
            not_idempotent=True,
            inputs=[
                io.Model.Input("model", tooltip="The model to benchmark (as you sample it: loaders and patches applied)."),
                io.Conditioning.Input("positive", tooltip="Positive conditioning."),
                io.Conditioning.Input("negative", tooltip="Negative conditioning."),
                io.Latent.Input("latent_image", tooltip="The latent to sample (its size is the benchmark's)."),
                CLUSTER.Input("cluster", tooltip="The rank cluster the modes run on."),
                io.Int.Input("steps", default=4, min=1, max=100, tooltip="Steps per run (s/step is the run's time over its steps)."),
                io.Float.Input("cfg", default=4.0, min=0.0, max=100.0, step=0.1, tooltip="Classifier-free guidance scale (cfg 1 leaves no CFG split)."),
                io.Combo.Input("sampler_name", options=samplers, default="euler", tooltip="ComfyUI's sampler."),
                io.Combo.Input("scheduler", options=schedulers, default="simple", tooltip="ComfyUI's scheduler."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, tooltip="The noise seed (the same for every run)."),
            ],
            outputs=[
                io.String.Output(display_name="report_json", tooltip="The benchmark as JSON (also saved to output/patchray/)."),
                io.Image.Output(display_name="chart", tooltip="s/step per mode."),
                io.String.Output(display_name="summary", tooltip="The benchmark as a table."),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        return measure_again(**inputs)

    @classmethod
    def execute(cls, model, positive, negative, latent_image, cluster, steps=4, cfg=4.0, sampler_name="euler",
                scheduler="simple", seed=0) -> io.NodeOutput:
        hooks = Hooks(cancel_check=interrupt_check(), progress=progress_callback)
        rows = sampler_bench.run(model, positive, negative, latent_image, cluster, seed, steps, cfg, sampler_name,
                                 scheduler, hooks=hooks)
        folder = os.path.join(output_directory(), "patchray")
        meta = {"steps": steps, "cfg": cfg, "sampler": sampler_name, "scheduler": scheduler,
                "latent": list(latent_image["samples"].shape), "ranks": cluster.num_ranks, "device": cluster.device}
        path = sampler_bench.save(rows, folder, meta)
        text = sampler_bench.table(rows, sampler_bench.shares_device(cluster))
        chart = png_to_image(sampler_bench.write_chart(rows, os.path.splitext(path)[0] + ".png"))
        with open(path) as fh:
            report = fh.read()
        return io.NodeOutput(report, chart, text, ui={"text": [text]})
