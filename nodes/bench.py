"""Benchmark: run PatchRay's VAE benchmark for a family, shape and rank count; report JSON, chart and summary."""

from __future__ import annotations

import json
import os

from ._comfy import interrupt_check, io, measure_again, output_directory, progress_callback
from .bridge import diagnostics
from .planner import FAMILY_NAMES, family_tooltip
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayBenchmark"]


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
