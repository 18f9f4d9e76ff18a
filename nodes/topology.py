"""Topology Probe: the GPU P2P matrix, link kinds, measured bandwidths and advice, as a heatmap and text."""

from __future__ import annotations

import json
import os
import tempfile

from ._comfy import io
from ._images import png_to_image
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
    def execute(cls, measure=True, cluster=None) -> io.NodeOutput:
        from ..distributed.topology import probe_topology, render_heatmap, summary_text

        report = probe_topology(measure=bool(measure))
        if cluster is not None:
            from ..distributed.cluster import check_cluster

            report.cluster = check_cluster(cluster)  # the report's slot for the rank cluster check
        data = report.to_dict()
        fd, path = tempfile.mkstemp(prefix="patchray_topology_", suffix=".png")
        os.close(fd)
        try:
            render_heatmap(report, path)
            image = png_to_image(path)
        finally:
            os.unlink(path)
        text = summary_text(report)
        return io.NodeOutput(image, text, json.dumps(data, indent=1), ui={"text": [text], "patchray_topology": [data]})
