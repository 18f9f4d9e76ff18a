"""Opt-in: the pack in ComfyUI's real frontend (headless Chromium, frontend_driver.py).

* every shipped UI workflow loads with every node type known, its widget values where the API file has them, and the
  Queue button sends exactly the shipped API prompt; PatchRay's extension logs no error or warning;
* the VAE Decode's panel shows a run's note (a plan it did not use) and a later run without a note clears it.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -q -k vae_frontend
"""

import asyncio
import json

import pytest

from .frontend_driver import browser_page, check_workflows, chromium, run_and_read_panel
from .test_comfyui_server import COMFYUI_DIR, server  # noqa: F401  (server: the fixture)

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
    pytest.mark.skipif(chromium() is None, reason="needs Chromium (apt-get install chromium, or set CHROMIUM)"),
]


def test_every_ui_workflow_loads_and_queues_the_shipped_api_prompt(server):  # noqa: F811
    url, _ = server
    result = asyncio.run(check_workflows(url))
    assert "PatchRay.views" in result.pop("extensions")
    assert result.pop("PatchRay log") == []
    assert result and all(problems == [] for problems in result.values()), json.dumps(result, indent=1)


_NOTE_PROMPT = {
    "1": {"class_type": "VAELoader", "inputs": {"vae_name": "sdxl_vae.safetensors"}},
    "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 96, "batch_size": 1}},
    "3": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": 2, "device": "cpu", "address": "", "gpu_ids": ""}},
    "4": {"class_type": "PatchRayTilePlanner", "inputs": {"family": "kl", "width": 264, "height": 184, "frames": 1, "ranks": 2, "choice": "balanced"}},
    "5": {"class_type": "PatchRayVAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0], "cluster": ["3", 0], "mode": "row",
                                                        "precision": "fp32", "gn_sync": False, "plan": ["4", 0], "balance": "equal"}},
    "6": {"class_type": "PreviewImage", "inputs": {"images": ["5", 0]}},
}

_RUN = run_and_read_panel('PatchRayVAEDecode', 'note.json',
                          'if (arg) node.disconnectInput(node.findInputSlot("plan"));')


def test_the_decode_panel_shows_a_runs_note_and_the_next_run_clears_it(server):  # noqa: F811
    url, _ = server

    async def scenario():
        async with browser_page(url) as page:
            first = await page.js(_RUN % json.dumps([_NOTE_PROMPT, False]), timeout=660)
            second = await page.js(_RUN % json.dumps([None, True]), timeout=660)
            return first, second, page.patchray_logs()

    first, second, logs = asyncio.run(scenario())
    assert first["outcome"] == "execution_success" and "plan is unused" in first["text"], first
    # the same node, its plan unplugged: it runs again, without a note, and the old note is gone
    assert second["outcome"] == "execution_success", second
    assert "plan is unused" not in second["text"] and second["text"].startswith("Runs when the prompt is queued"), second
    assert logs == []
