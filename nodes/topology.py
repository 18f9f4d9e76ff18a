"""Topology Probe: the GPU P2P matrix, link kinds, measured bandwidths and advice, as a heatmap and text."""

from __future__ import annotations

import json

from ._comfy import interrupt_check, io, measure_again
from .bridge import diagnostics
from .types import CATEGORY, CLUSTER

__all__ = ["PatchRayTopologyProbe"]


class PatchRayTopologyProbe(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PatchRayTopologyProbe",
            display_name="PatchRay Topology Probe",
            category=f"{CATEGORY}/diagnostics",
            description=(
                "Probes how this machine's GPUs are connected (NVLink, PCIe switch, host bridge, cross-socket), whether "
                "peer-to-peer works, the measured copy bandwidth of each pair, and advises NCCL settings, the decode mode "
                "and the OTIL preset. Shows the matrix on the node."
            ),
            is_experimental=True,
            is_output_node=True,
            not_idempotent=True,
            inputs=[
                io.Boolean.Input("measure", default=True, tooltip="Measure copy bandwidth between GPU pairs (a few seconds); off: read the driver's topology only."),
                CLUSTER.Input("cluster", optional=True, tooltip="Optional: also check the rank cluster (all-reduce, neighbour exchange, bandwidth between ranks)."),
            ],
            outputs=[
                io.Image.Output(display_name="heatmap", tooltip="GPU x GPU heatmap: colour = measured bandwidth (or link kind), hatched = no P2P."),
                io.String.Output(display_name="summary", tooltip="The matrix, link kinds, bandwidths and advice as text."),
                io.String.Output(display_name="report_json", tooltip="The full topology report (schema 1) as JSON, e.g. to attach to a bug report."),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        return measure_again(**inputs)  # a measurement runs again on every prompt, never from the cache

    @classmethod
    def execute(cls, measure=True, cluster=None) -> io.NodeOutput:
        report = diagnostics.probe(bool(measure), cluster, cancel_check=interrupt_check())
        return io.NodeOutput(report.image, report.text, json.dumps(report.data, indent=1),
                             ui={"text": [report.text], "patchray_topology": [report.data]})
