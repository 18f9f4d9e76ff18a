"""P2P topology probe and PCIe-aware advice.

``probe_topology()`` inspects this machine (nvidia-smi, NVML, PyTorch, NCCL; each optional),
``report_from_saved()`` reads ``nvidia-smi topo -m`` / ``topo -p2p`` text saved elsewhere, and ``advise()`` turns
either into the NCCL environment, the decode mode and the OTIL preset to use, plus plain warnings.
Nothing here imports torch, NVML or matplotlib until a function needs it.
"""

from .advice import (
    Advice,
    DecodeChoice,
    OtilChoice,
    advise,
    bottleneck_link,
    choose_decode_mode,
    choose_otil_preset,
    link_profiles,
    recommended_settings,
    report_with_advice,
)
from .cli import probe_main
from .parse import TopoMatrix, parse_gpu_listing, parse_p2p_matrix, parse_saved_outputs, parse_topo_matrix
from .probe import cached_probe, clear_probe_cache, probe_topology, report_from_saved
from .throughput import BALANCE_MODES, cluster_band_weights, measure_rank_speed, rank_speeds_task, speed_weights
from .render import heatmap_image, render_heatmap, summary_text
from .report import TopologyReport

__all__ = [
    "BALANCE_MODES",
    "cluster_band_weights",
    "measure_rank_speed",
    "rank_speeds_task",
    "speed_weights",
    "Advice",
    "DecodeChoice",
    "OtilChoice",
    "TopoMatrix",
    "TopologyReport",
    "advise",
    "bottleneck_link",
    "cached_probe",
    "choose_decode_mode",
    "choose_otil_preset",
    "clear_probe_cache",
    "heatmap_image",
    "link_profiles",
    "parse_gpu_listing",
    "parse_p2p_matrix",
    "parse_saved_outputs",
    "parse_topo_matrix",
    "probe_main",
    "probe_topology",
    "recommended_settings",
    "render_heatmap",
    "report_from_saved",
    "report_with_advice",
    "summary_text",
]
