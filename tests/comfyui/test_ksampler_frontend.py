"""Opt-in: the Distributed KSampler in ComfyUI's real frontend (headless Chromium, frontend_driver.py).

* a new node offers sequence_attention with its modes, auto by default, and the tooltip names them;
* its panel names the attention mode a run's ranks ran; a run the node refuses (ulysses over heads that do not divide
  by the ranks) leaves no earlier run's summary under the changed widget, and the next run shows its own.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -q -k ksampler_frontend
"""

import asyncio
import json

import pytest

from .frontend_driver import browser_page, chromium, run_and_read_panel
from .test_comfyui_server import COMFYUI_DIR, _dit_prompt, server  # noqa: F401  (server: the fixture)

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
    pytest.mark.skipif(chromium() is None, reason="needs Chromium (apt-get install chromium, or set CHROMIUM)"),
]

_NEW_NODE = """
(async () => {
  const node = LiteGraph.createNode("PatchRayKSampler");
  app.graph.add(node);
  const info = await (await fetch("/object_info/PatchRayKSampler")).json();
  const w = node.widgets.find(x => x.name === "sequence_attention");
  const out = {value: w.value, options: w.options.values, tooltip: info.PatchRayKSampler.input.optional.sequence_attention[1].tooltip};
  app.graph.remove(node);
  return out;
})()
"""

_RUN = run_and_read_panel('PatchRayKSampler', 'ksampler.json',
                          'if (arg) node.widgets.find(w => w.name === "sequence_attention").value = arg;')


def test_the_ksampler_panel_names_the_attention_that_ran_and_a_refused_run_clears_it(server):  # noqa: F811
    url, _ = server
    api = _dit_prompt("wan2.1_t2v_1.3B_fp16.safetensors", "sequence", 3, 1, 2, attention="ring")
    api["5"]["inputs"].update(width=40, height=56, length=9)
    for nid in ("6", "9"):  # the Distributed KSampler's branch only
        del api[nid]

    async def scenario():
        async with browser_page(url) as page:
            fresh = await page.js(_NEW_NODE)
            ring = await page.js(_RUN % json.dumps([api, None]), timeout=660)
            refused = await page.js(_RUN % json.dumps([None, "ulysses"]), timeout=660)  # WanModel here: 2 heads, 3 ranks
            again = await page.js(_RUN % json.dumps([None, "overlapped"]), timeout=660)
            return fresh, ring, refused, again, page.patchray_logs()

    fresh, ring, refused, again, logs = asyncio.run(scenario())
    assert fresh["value"] == "auto" and fresh["options"] == ["auto", "gathered", "overlapped", "ring", "ulysses"], fresh
    for mode in fresh["options"]:
        assert f"{mode}:" in fresh["tooltip"], (mode, fresh["tooltip"])
    assert ring["outcome"] == "execution_success" and "sequence attention ring" in ring["text"], ring
    assert refused["outcome"] == "execution_error", refused
    assert "ring" not in refused["text"] and "last run failed" in refused["text"], refused
    assert again["outcome"] == "execution_success" and "sequence attention overlapped" in again["text"], again
    assert logs == []
