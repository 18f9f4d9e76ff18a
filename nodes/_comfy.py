"""The one place the node pack touches ComfyUI.

Everything ComfyUI-specific the nodes need is imported or reached from here: the V3 schema API
(``comfy_api.latest``), the progress bar, the interrupt check and the output folder. The schema API is
imported eagerly (a node module cannot be defined without it); the rest is looked up when called, so the
node bodies also run outside a ComfyUI server (the CI tests, scripts), where there is no progress UI and
no cancel button.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from typing import Callable, Optional

from comfy_api.latest import ComfyExtension, io, ui  # noqa: F401  (re-exported for the node modules)

__all__ = [
    "ComfyExtension", "io", "ui", "progress_callback", "interrupt_check", "output_directory", "sampler_lists", "measure_again",
    "panel_report", "REPORT_EVENT",
]

#: the websocket event that carries a line for a node's panel after that node ran (the web extension shows it)
REPORT_EVENT = "patchray.report"

# ComfyUI 0.3.64's sampler and scheduler names, for the schema when ComfyUI is absent (CI); inside ComfyUI its live
# lists are used, so samplers added later appear in the node too
_SAMPLERS_0364 = [
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2", "dpm_2_ancestral",
    "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral", "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde", "dpmpp_sde_gpu",
    "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu",
    "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm", "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp",
    "res_multistep_ancestral", "res_multistep_ancestral_cfg_pp", "gradient_estimation", "gradient_estimation_cfg_pp",
    "er_sde", "seeds_2", "seeds_3", "sa_solver", "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2",
]
_SCHEDULERS_0364 = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal", "linear_quadratic", "kl_optimal"]


def sampler_lists():
    """(sampler names, scheduler names) of the running ComfyUI (0.3.64's lists outside ComfyUI)."""
    try:
        import comfy.samplers
    except ImportError:
        return list(_SAMPLERS_0364), list(_SCHEDULERS_0364)
    return list(comfy.samplers.KSampler.SAMPLERS), list(comfy.samplers.KSampler.SCHEDULERS)


def progress_callback(total: int, node_id: Optional[str] = None) -> Optional[Callable[[int, int], None]]:
    """A ``fn(done, total)`` that drives ComfyUI's progress bar for the running node (None outside ComfyUI)."""
    try:
        import comfy.utils
    except ImportError:
        return None
    bar = comfy.utils.ProgressBar(max(1, int(total)), node_id=node_id)

    def update(done: int, total_now: Optional[int] = None) -> None:
        bar.update_absolute(int(done), int(total_now) if total_now else None)

    return update


def panel_report(node_id: Optional[str]) -> Callable[[str], None]:
    """A ``fn(line)`` that shows ``line`` on node ``node_id``'s panel in the frontend, and logs it.

    For a node whose effect comes later than its own run: PatchRay Parallel Model returns a MODEL at once, and what
    ran on the ranks is known only when a sampler node samples it. Outside a server (or without a node id) the line
    is only logged.
    """
    import logging

    log = logging.getLogger("patchray")

    def report(line: str) -> None:
        log.info("PatchRay: %s", line)
        if node_id is None:
            return
        try:
            from server import PromptServer
        except ImportError:
            return
        instance = getattr(PromptServer, "instance", None)
        if instance is not None:
            instance.send_sync(REPORT_EVENT, {"node": str(node_id), "text": str(line)}, instance.client_id)

    return report


def interrupt_check() -> Optional[Callable[[], None]]:
    """ComfyUI's cancel check: raises when the user pressed Cancel (None outside ComfyUI).

    The cluster calls it about twice a second while the ranks work; when it raises, the cluster stops
    every rank and re-raises, so ComfyUI reports an interrupted prompt and the next one rebuilds the ranks.
    """
    try:
        import comfy.model_management as mm
    except ImportError:
        return None
    return mm.throw_exception_if_processing_interrupted


def output_directory() -> str:
    """ComfyUI's output folder; outside ComfyUI ``$PATCHRAY_OUTPUT_DIR`` or a temp folder."""
    try:
        import folder_paths

        return folder_paths.get_output_directory()
    except ImportError:
        path = os.environ.get("PATCHRAY_OUTPUT_DIR") or os.path.join(tempfile.gettempdir(), "patchray-output")
        os.makedirs(path, exist_ok=True)
        return path


_runs = itertools.count()


def measure_again(**_inputs) -> str:
    """A ``fingerprint_inputs`` for measurement nodes: a value no earlier prompt had, so the node runs every time.

    ComfyUI (0.3.64) reuses a node's cached output while its inputs and fingerprint are unchanged; the schema's
    ``not_idempotent`` only keeps two identical nodes of one prompt from sharing a result (it adds the node id to the
    cache key), so a re-queued Topology Probe or Benchmark would return the earlier report without this.
    """
    return f"{time.time_ns()}-{os.getpid()}-{next(_runs)}"
