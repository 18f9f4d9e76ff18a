"""Drive ComfyUI's real frontend in headless Chromium over the DevTools protocol (ComfyUI's own aiohttp is the
websocket client; no browser-automation package). Used by the opt-in test_vae_frontend.py; runnable by hand against
a running server:

    <ComfyUI's python> tests/comfyui/frontend_driver.py http://127.0.0.1:8188

The browser resolves only loopback names (the frontend's release-notes poll is blocked) and records every console
message and uncaught exception, so a test can require that PatchRay's extension logged none.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"


def chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Page:
    """One tab: ``js(expr)`` evaluates (awaiting promises) and returns the value; ``logs`` collects console errors,
    warnings and uncaught exceptions as ``(kind, text, url)``."""

    def __init__(self, ws):
        self.ws, self.next_id, self.logs = ws, 0, []

    def _record(self, msg: dict) -> None:
        method, p = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            frames = (p.get("stackTrace") or {}).get("callFrames") or [{}]
            self.logs.append(("console." + p["type"], text, frames[0].get("url", "")))
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            text = (d.get("exception") or {}).get("description") or d.get("text", "")
            self.logs.append(("exception", text, d.get("url", "")))

    async def call(self, method: str, timeout: float = 120, **params):
        self.next_id += 1
        my = self.next_id
        await self.ws.send_json({"id": my, "method": method, "params": params})
        deadline = time.monotonic() + timeout
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), timeout=max(1.0, deadline - time.monotonic()))
            self._record(msg)
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def js(self, expression: str, timeout: float = 120):
        r = await self.call("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True, returnByValue=True)
        if r.get("exceptionDetails"):
            d = r["exceptionDetails"]
            raise RuntimeError(f"JS failed: {(d.get('exception') or {}).get('description') or d}")
        return r.get("result", {}).get("value")

    def patchray_logs(self) -> list:
        """Console errors/warnings and exceptions that come from PatchRay's extension or mention PatchRay."""
        return [entry for entry in self.logs if "patchray" in (entry[1] + entry[2]).lower()]


_READY = """
(async () => {
  for (let i = 0; i < 240 && !(window.app && window.app.graph && window.LiteGraph); i++) await new Promise(r => setTimeout(r, 250));
  if (!window.app) throw new Error("ComfyUI's app did not load");
  document.querySelectorAll('.p-dialog-mask, .p-toast').forEach(e => e.remove());
  return window.app.extensions.map(e => e.name);
})()
"""

# load a UI workflow; report unknown node types, each node's widgets by name, what graphToPrompt makes and what the
# Queue button would send (api.queuePrompt intercepted: nothing is queued)
LOAD_UI = """
(async ([wf, name]) => {
  const app = window.app;
  await app.loadGraphData(wf, true, true, name);
  await new Promise(r => setTimeout(r, 800));
  const reg = LiteGraph.registered_node_types;
  const missing = app.graph._nodes.filter(n => !(n.type in reg)).map(n => n.type);
  const widgets = {};
  for (const n of app.graph._nodes) widgets[n.id] = (n.widgets || []).filter(w => w.serialize !== false).map(w => [w.name, w.value]);
  const sent = [];
  const api = app.api;
  const original = api.queuePrompt;
  api.queuePrompt = async (number, data) => { sent.push(JSON.parse(JSON.stringify(data.output))); return {prompt_id: "not-queued", number: 0, node_errors: {}}; };
  try { await app.queuePrompt(0, 1); } finally { api.queuePrompt = original; }
  const prompt = await app.graphToPrompt();
  return {missing, widgets, output: prompt.output, sent};
})(%s)
"""


def run_and_read_panel(node_type: str, filename: str, setup: str) -> str:
    """A page script template (``% json.dumps([api, arg])``): load the API prompt ``api`` (when given) as
    ``filename``, find the first ``node_type`` node, run ``setup`` (JavaScript with ``node`` and ``arg`` in scope:
    change a widget, unplug an input), queue the prompt, wait for the run to end, and return
    ``{outcome: "execution_success" | "execution_error" | "execution_interrupted" | "timeout", text: the node's panel}``."""
    return """
(async ([api, arg]) => {
  const app = window.app;
  if (api) await app.loadApiJson(api, %(filename)s);
  const node = app.graph._nodes.find(n => n.type === %(node_type)s);
  %(setup)s
  const done = new Promise((resolve) => {
    const end = (e) => { for (const t of ["execution_success", "execution_error", "execution_interrupted"]) app.api.removeEventListener(t, end); resolve(e.type); };
    for (const t of ["execution_success", "execution_error", "execution_interrupted"]) app.api.addEventListener(t, end);
  });
  await app.queuePrompt(0, 1);
  const outcome = await Promise.race([done, new Promise(r => setTimeout(() => r("timeout"), 600000))]);
  await new Promise(r => setTimeout(r, 500));
  const view = node.widgets.find(w => w.name === "patchray_view");
  return {outcome, text: view?.element?.textContent || ""};
})(%%s)
""" % {"filename": json.dumps(filename), "node_type": json.dumps(node_type), "setup": setup}


def differences(frontend: dict, shipped: dict) -> list:
    """Where a prompt the frontend made differs from an API file (``_meta`` titles aside)."""
    found = []
    for nid in sorted(set(frontend) | set(shipped), key=str):
        a, b = frontend.get(nid), shipped.get(nid)
        if a is None or b is None:
            found.append(f"node {nid}: only in the {'API file' if a is None else 'frontend prompt'}")
        elif a["class_type"] != b["class_type"]:
            found.append(f"node {nid}: {a['class_type']} vs {b['class_type']}")
        elif a["inputs"] != b["inputs"]:
            keys = sorted(k for k in set(a["inputs"]) | set(b["inputs"]) if a["inputs"].get(k) != b["inputs"].get(k))
            found.append(f"node {nid} {a['class_type']}: " + ", ".join(
                f"{k}: frontend {a['inputs'].get(k)!r} vs file {b['inputs'].get(k)!r}" for k in keys))
    return found


@asynccontextmanager
async def browser_page(url: str):
    """A headless Chromium tab with ComfyUI's frontend loaded from ``url``; the browser is stopped afterwards."""
    import aiohttp

    exe = chromium()
    if exe is None:
        raise RuntimeError("no Chromium found (apt-get install chromium, or set CHROMIUM)")
    profile = tempfile.mkdtemp(prefix="patchray-chrome-")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
         f"--remote-debugging-port={port}", f"--user-data-dir={profile}", "--window-size=1600,1100",
         "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1 , EXCLUDE localhost", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        target = None
        while target is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    target = next((t for t in json.loads(r.read()) if t.get("type") == "page"), None)
            except OSError:
                pass
            if target is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("Chromium did not start")
                await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                for domain in ("Runtime.enable", "Page.enable"):
                    await page.call(domain)
                await page.call("Emulation.setDeviceMetricsOverride", width=1600, height=1100, deviceScaleFactor=1, mobile=False)
                await page.call("Page.navigate", url=url)
                await asyncio.sleep(2)
                page.extensions = await page.js(_READY)
                yield page
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(profile, ignore_errors=True)


async def check_workflows(url: str, names=None) -> dict:
    """Every UI workflow (or ``names``): ``{name: problems}`` (empty lists where all is well) and PatchRay's log."""
    names = names or sorted(p.name for p in WORKFLOWS.glob("*.json") if not p.name.endswith(".api.json"))
    out = {}
    async with browser_page(url) as page:
        for name in names:
            wf = json.loads((WORKFLOWS / name).read_text())
            api = json.loads((WORKFLOWS / name.replace(".json", ".api.json")).read_text())
            r = await page.js(LOAD_UI % json.dumps([wf, name]))
            problems = [f"unknown node type {t}" for t in r["missing"]]
            problems += [f"graphToPrompt: {d}" for d in differences(r["output"], api)]
            problems += [f"queued: {d}" for d in differences(r["sent"][0], api)] if r["sent"] else ["the Queue button sent nothing"]
            out[name] = problems
        out["PatchRay log"] = page.patchray_logs()
        out["extensions"] = page.extensions
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(check_workflows(sys.argv[1])), indent=1))
