"""Opt-in: parallelism=auto's measured plan in a real ComfyUI server: the Parallel Model's panel shows the plan with its
expected s/step before the ranks sample and the measured s/step, bytes per step and seconds in communication after; the
first run measures, the next reuses the measurement; the result equals the stock KSampler's.

    COMFYUI_DIR=/path/to/ComfyUI [COMFYUI_PYTHON=/path/to/its/python] pytest tests/comfyui/test_auto_plan_server.py
"""

import asyncio
import json
import re
import time
import uuid

import pytest

from .test_comfyui_server import COMFYUI_DIR, _get, _latent, server  # noqa: F401
from .test_parallel_model_server import BOUND, WAN, _dit_graph, _ksampler_pair, _rel

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
]


async def _panel_lines(url: str, prompt: dict, node: str, timeout_s: float = 900):
    """Queue ``prompt`` with a websocket open; the ``patchray.report`` lines node ``node`` received, in order, the
    prompt's outcome and its id."""
    import aiohttp

    client = uuid.uuid4().hex
    lines, outcome = [], None
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={client}") as ws:
            async with session.post(url + "/prompt", json={"prompt": prompt, "client_id": client}) as r:
                body = await r.json()
                assert r.status == 200 and not body.get("node_errors"), body
            pid = body["prompt_id"]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while loop.time() < deadline:
                msg = await ws.receive(timeout=deadline - loop.time())
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                kind, payload = data.get("type"), data.get("data", {})
                if kind == "patchray.report" and payload.get("node") == node:
                    lines.append(payload["text"])
                elif kind in ("execution_success", "execution_error", "execution_interrupted") and \
                        payload.get("prompt_id") == pid:
                    outcome = (kind, payload.get("exception_message"))
                    break
    return lines, outcome, pid


def _history(url: str, pid: str, timeout_s: float = 60) -> dict:
    """The prompt's history entry (written just after the outcome event is sent)."""
    for _ in range(int(timeout_s * 10)):
        hist = json.loads(_get(f"{url}/history/{pid}")[1])
        if pid in hist:
            return hist[pid]
        time.sleep(0.1)
    raise AssertionError(f"no history for prompt {pid}")


def test_an_auto_run_shows_its_plan_before_sampling_and_the_measured_figures_after(server):  # noqa: F811
    url, base = server
    texts = []
    for seed in (5, 6):
        api = _ksampler_pair(_dit_graph(WAN, 2, parallelism="auto"), steps=2)
        api["6"]["inputs"]["seed"] = api["8"]["inputs"]["seed"] = seed
        lines, outcome, pid = asyncio.run(_panel_lines(url, api, "20"))
        assert outcome == ("execution_success", None), outcome
        texts.append(lines)
        print("\n".join(lines))
        entry = _history(url, pid)
        rel = _rel(_latent(base, entry, "10"), _latent(base, entry, "9"))
        assert rel <= BOUND, rel  # the plan picks exact layouts only: the stock KSampler's result
    first, again = texts
    plan = next(line for line in first if line.startswith("plan: "))
    # the plan comes before what ran (the panel shows it while the ranks sample)
    assert first.index(plan) < next(i for i, line in enumerate(first) if line.startswith("parallelism "))
    assert re.match(r"plan: cfg, expected [0-9.e+-]+ s/step \(MODELLED from a measured call of [0-9.]+ ms and an "
                    r"assumed link \(pcie4_x16_no_p2p: no GPU link probed\)\)", plan), plan
    after = next(line for line in first if line.startswith("measured: "))
    assert re.match(r"measured: [0-9.e+-]+ s/step over 2 steps, [1-9][0-9.]* [kMG]?B exchanged per step, [0-9.e+-]+ s in "
                    r"communication \([0-9.e+-]+ s/step\); the plan expected [0-9.e+-]+ s/step \(MODELLED\)", after), after
    assert any("(measured earlier)" in line for line in again if line.startswith("plan: ")), again
    assert "WanModel|" in (base / "patchray-cache" / "auto_plan.json").read_text()
