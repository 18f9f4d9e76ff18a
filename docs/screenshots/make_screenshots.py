"""Screenshots of every PatchRay node as it opens in ComfyUI's real frontend, and a check of the shipped workflows there.

Starts ComfyUI (``main.py --cpu``, a private base directory with this pack linked into ``custom_nodes``) and a headless
Chromium driven over the DevTools protocol (no browser automation package needed: ComfyUI's own aiohttp is the
websocket client). For each PatchRay node it adds the node to an empty graph at zoom 1 and saves a PNG of the node
(title bar, sockets, widgets, panel) to ``docs/screenshots/<node id>.png``; the Tile Planner and the Topology Probe
(which need no cluster) are also queued once and saved with their result as ``<node id>_run.png``. ``workflow_two_nodes.png`` is
the README's picture: the Parallel Model and the Parallel VAE in a stock text-to-image graph. Then it loads
every shipped workflow
(``workflows/*.json``), reads the node sizes the frontend gave them and reports any overlap, converts it to the API
prompt with the frontend's own ``graphToPrompt`` (what the Queue button sends) and compares that with the shipped
``workflows/<name>.api.json`` (exit status 1 on any overlap or difference), and saves
``docs/screenshots/workflow_<name>.png`` at the zoom the workflow opens with.

Run with ComfyUI's Python (it has aiohttp and the frontend package):

    COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/.venv/bin/python docs/screenshots/make_screenshots.py

``PATCHRAY_ONLY_NODES=1`` makes the node pictures only (no workflow check).

Needs ``chromium`` (Debian: ``apt-get install chromium``) or ``CHROMIUM=/path/to/chrome``. Nothing is fetched from
outside: Chromium resolves only loopback (the frontend's release-notes poll is blocked).
"""

from __future__ import annotations

import asyncio
import base64
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
NODES = ["PatchRayCluster", "PatchRayParallelModel", "PatchRayParallelVAE", "PatchRayVAEDecode", "PatchRayVAEEncode",
         "PatchRayKSampler", "PatchRayKSamplerAdvanced", "PatchRayTilePlanner", "PatchRayTopologyProbe", "PatchRayBenchmark",
         "PatchRaySamplerBenchmark"]
TITLE = 30  # LiteGraph's title bar, drawn above a node's pos
BADGE = 20  # the node's badges, above the title bar


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def call(self, method: str, **params):
        self.next_id += 1
        my = self.next_id
        await self.ws.send_json({"id": my, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), timeout=120)
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def js(self, expression: str):
        r = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if r.get("exceptionDetails"):
            raise RuntimeError(f"JS failed: {r['exceptionDetails'].get('exception', {}).get('description') or r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    async def shot(self, path: Path, clip=None, scale: float = 1.0) -> None:
        params = {"format": "png"}
        if clip:
            params["clip"] = dict(clip, scale=scale)
        data = (await self.call("Page.captureScreenshot", **params))["data"]
        path.write_bytes(base64.b64decode(data))


# -- what runs in the page

_SETUP = """
(async () => {
  for (let i = 0; i < 240 && !(window.app && window.app.graph && window.LiteGraph); i++) await new Promise(r => setTimeout(r, 250));
  if (!window.app) throw new Error("ComfyUI's app did not load");
  document.querySelectorAll('.p-dialog-mask, .p-toast').forEach(e => e.remove());
  return true;
})()
"""

_ADD_NODE = """
(async (type) => {
  const app = window.app;
  document.querySelectorAll('.p-dialog-mask, .p-dialog, .p-toast').forEach(e => e.remove());
  app.graph.clear();
  const node = LiteGraph.createNode(type);
  app.graph.add(node);
  const ds = app.canvas.ds;
  ds.scale = 1; ds.offset = [0, 0];
  node.pos = [200, 200];
  app.canvas.setDirty(true, true);
  await new Promise(r => setTimeout(r, 800));
  const rect = app.canvas.canvas.getBoundingClientRect();
  return {pos: [node.pos[0], node.pos[1]], size: [node.size[0], node.size[1]], left: rect.left, top: rect.top};
})(%s)
"""

_RUN_NODE = """
(async ([type, slot, widgets]) => {
  const app = window.app;
  document.querySelectorAll('.p-dialog-mask, .p-dialog, .p-toast').forEach(e => e.remove());
  app.graph.clear();
  const node = LiteGraph.createNode(type);
  app.graph.add(node);
  for (const [name, value] of Object.entries(widgets)) node.widgets.find(w => w.name === name).value = value;
  const preview = LiteGraph.createNode("PreviewImage");
  app.graph.add(preview);
  node.connect(slot, preview, 0);
  const ds = app.canvas.ds;
  ds.scale = 1; ds.offset = [0, 0];
  node.pos = [120, 120];
  preview.pos = [120 + node.size[0] + 40, 120];
  preview.size = [420, Math.max(node.size[1], 360)];
  await app.queuePrompt(0, 1);
  const view = () => (node.widgets || []).find(w => w.name === "patchray_view");
  for (let i = 0; i < 600; i++) {
    const text = view()?.element?.textContent || "";
    if (text && !text.startsWith("Runs when")) break;
    await new Promise(r => setTimeout(r, 500));
  }
  for (let i = 0; i < 120 && !(preview.imgs && preview.imgs.length && preview.imgs[0].complete); i++) {
    await new Promise(r => setTimeout(r, 500));
  }
  await new Promise(r => setTimeout(r, 1000));
  app.canvas.setDirty(true, true);
  const rect = app.canvas.canvas.getBoundingClientRect();
  return {x0: node.pos[0], y0: node.pos[1], x1: preview.pos[0] + preview.size[0], y1: Math.max(node.pos[1] + node.size[1], preview.pos[1] + preview.size[1]),
          left: rect.left, top: rect.top, text: view()?.element?.textContent || ""};
})(%s)
"""

#: nodes run in the page (no cluster needed), with the output slot shown in a Preview Image and widget values
RUNS = [("PatchRayTilePlanner", 1, {"width": 1280, "height": 768, "ranks": 3}),
        ("PatchRayTopologyProbe", 0, {"measure": False})]

#: the README's picture: the two patch nodes in a stock text-to-image graph (loader -> Parallel Model -> KSampler,
#: loader's VAE -> Parallel VAE -> VAE Decode, one Cluster for both), at zoom 1
_TWO_NODES = """
(async () => {
  const app = window.app;
  document.querySelectorAll('.p-dialog-mask, .p-dialog, .p-toast').forEach(e => e.remove());
  app.graph.clear();
  const add = (type, x, y) => { const n = LiteGraph.createNode(type); app.graph.add(n); n.pos = [x, y]; return n; };
  const ckpt = add("CheckpointLoaderSimple", 40, 120);
  const cluster = add("PatchRayCluster", 40, 360);
  const pm = add("PatchRayParallelModel", 490, 70);
  const pv = add("PatchRayParallelVAE", 490, 460);
  const ks = add("KSampler", 820, 70);
  const vd = add("VAEDecode", 1180, 460);
  ckpt.connect(0, pm, "model"); cluster.connect(0, pm, "cluster");
  pm.connect(0, ks, "model");
  ckpt.connect(2, pv, "vae"); cluster.connect(0, pv, "cluster");
  ks.connect(0, vd, "samples"); pv.connect(0, vd, "vae");
  const ds = app.canvas.ds;
  ds.scale = 1; ds.offset = [0, 0];
  document.querySelectorAll('[class*="minimap"]').forEach(e => { e.style.display = "none"; });
  app.canvas.setDirty(true, true);
  await new Promise(r => setTimeout(r, 1200));
  const rect = app.canvas.canvas.getBoundingClientRect();
  const nodes = [ckpt, cluster, pm, pv, ks, vd];
  return {left: rect.left, top: rect.top,
          x1: Math.max(...nodes.map(n => n.pos[0] + n.size[0])), y1: Math.max(...nodes.map(n => n.pos[1] + n.size[1]))};
})()
"""

_LOAD_WORKFLOW = """
(async ([wf, name]) => {
  const app = window.app;
  await app.loadGraphData(wf, true, true, name);  // the tab shows the file's name, as when a user opens it
  await new Promise(r => setTimeout(r, 1200));
  document.querySelectorAll('.p-dialog-mask, .p-toast').forEach(e => e.remove());
  const nodes = app.graph._nodes.map(n => ({id: n.id, type: n.type, pos: [n.pos[0], n.pos[1]], size: [n.size[0], n.size[1]],
    collapsed: !!(n.flags && n.flags.collapsed)}));
  const prompt = await app.graphToPrompt();  // what the Queue button sends: the frontend's own UI -> API conversion
  return {nodes, output: prompt.output};
})(%s)
"""


def _api_differences(frontend: dict, shipped: dict) -> list:
    """Where the frontend's conversion of a UI workflow differs from the shipped API file (``_meta`` titles aside)."""
    found = []
    for nid in sorted(set(frontend) | set(shipped), key=str):
        a, b = frontend.get(nid), shipped.get(nid)
        if a is None or b is None:
            found.append(f"node {nid}: only in the {'shipped API file' if a is None else 'frontend conversion'}")
        elif a["class_type"] != b["class_type"]:
            found.append(f"node {nid}: {a['class_type']} vs {b['class_type']}")
        elif a["inputs"] != b["inputs"]:
            keys = sorted(k for k in set(a["inputs"]) | set(b["inputs"]) if a["inputs"].get(k) != b["inputs"].get(k))
            found.append(f"node {nid} {a['class_type']}: " + ", ".join(
                f"{k}: frontend {a['inputs'].get(k)!r} vs file {b['inputs'].get(k)!r}" for k in keys))
    return found


def _overlaps(nodes, margin=0):
    boxes = [(n["id"], n["type"], (n["pos"][0], n["pos"][1] - TITLE - BADGE, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1]))
             for n in nodes if not n["collapsed"]]
    found = []
    for i, (a, ta, (ax0, ay0, ax1, ay1)) in enumerate(boxes):
        for b, tb, (bx0, by0, bx1, by1) in boxes[i + 1:]:
            if ax0 < bx1 + margin and bx0 < ax1 + margin and ay0 < by1 + margin and by0 < ay1 + margin:
                found.append((f"{a}:{ta}", f"{b}:{tb}"))
    return found


async def _drive(cdp_port: int, url: str) -> int:
    import aiohttp

    with urllib.request.urlopen(f"http://127.0.0.1:{cdp_port}/json/list", timeout=10) as r:
        target = next(t for t in json.loads(r.read()) if t.get("type") == "page")
    problems = 0
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            page = Page(ws)
            await page.call("Page.enable")
            await page.call("Emulation.setDeviceMetricsOverride", width=1600, height=1100, deviceScaleFactor=1, mobile=False)
            await page.call("Page.navigate", url=url)
            await asyncio.sleep(3)
            await page.js(_SETUP)
            for node_type in NODES:
                info = await page.js(_ADD_NODE % json.dumps(node_type))
                (x, y), (w, h) = info["pos"], info["size"]
                clip = {"x": info["left"] + x - 6, "y": info["top"] + y - TITLE - BADGE - 6, "width": w + 12, "height": h + TITLE + BADGE + 12}
                path = OUT / f"{node_type}.png"
                await page.shot(path, clip)
                print(f"{path.relative_to(ROOT)}: node {w:.0f}x{h:.0f}")
            info = await page.js(_TWO_NODES)
            clip = {"x": info["left"] + 20, "y": info["top"], "width": info["x1"] + 20, "height": info["y1"] + 20}
            await page.shot(OUT / "workflow_two_nodes.png", clip, scale=0.8)
            print("docs/screenshots/workflow_two_nodes.png: the two patch nodes in a text-to-image graph")
            for node_type, slot, widgets in RUNS:
                info = await page.js(_RUN_NODE % json.dumps([node_type, slot, widgets]))
                clip = {"x": info["left"] + info["x0"] - 6, "y": info["top"] + info["y0"] - TITLE - BADGE - 6,
                        "width": info["x1"] - info["x0"] + 12, "height": info["y1"] - info["y0"] + TITLE + BADGE + 12}
                path = OUT / f"{node_type}_run.png"
                await page.shot(path, clip)
                print(f"{path.relative_to(ROOT)}: after a run; panel text starts {info['text'][:60]!r}")
            if os.environ.get("PATCHRAY_ONLY_NODES"):  # the node pictures only, not the shipped workflows' check
                return problems
            for wf_path in sorted((ROOT / "workflows").glob("*.json")):
                if wf_path.name.endswith(".api.json"):
                    continue
                wf = json.loads(wf_path.read_text())
                loaded = await page.js(_LOAD_WORKFLOW % json.dumps([wf, wf_path.name]))
                nodes = loaded["nodes"]
                api_path = wf_path.with_name(wf_path.name[: -len(".json")] + ".api.json")
                api_diff = _api_differences(loaded["output"], json.loads(api_path.read_text())) if api_path.exists() else ["no API file"]
                saved = {n["id"]: n["size"] for n in wf["nodes"]}
                grown = [(n["id"], n["type"], saved.get(n["id"]), [round(v) for v in n["size"]]) for n in nodes
                         if saved.get(n["id"]) and (n["size"][0] > saved[n["id"]][0] + 1 or n["size"][1] > saved[n["id"]][1] + 1)]
                over = _overlaps(nodes)
                name = wf_path.name[: -len(".json")]
                print(f"workflows/{wf_path.name}: {len(nodes)} nodes, overlaps {over or 'none'}, grown by the frontend {grown or 'none'}, "
                      f"frontend's API conversion vs {api_path.name}: {api_diff or 'identical'}")
                problems += len(over) + len(api_diff)
                # the whole window at 60 %: what the user sees when the workflow opens, small enough to commit
                await page.shot(OUT / f"workflow_{name}.png", {"x": 0, "y": 0, "width": 1600, "height": 1100}, scale=0.6)
                if os.environ.get("PATCHRAY_FULL_SHOTS"):  # the same view at full scale, for reading it closely (not committed)
                    await page.shot(Path(os.environ["PATCHRAY_FULL_SHOTS"]) / f"workflow_{name}.png", {"x": 0, "y": 0, "width": 1600, "height": 1100})
    return problems


def main() -> int:
    comfy = Path(os.environ.get("COMFYUI_DIR", ""))
    if not (comfy / "main.py").exists():
        print("set COMFYUI_DIR to a ComfyUI checkout", file=sys.stderr)
        return 2
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chromium:
        print("no Chromium found (apt-get install chromium, or set CHROMIUM)", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="patchray-shots-"))
    (base / "custom_nodes").mkdir()
    os.symlink(ROOT, base / "custom_nodes" / "PatchRay")
    port, cdp = _free_port(), _free_port()
    log = open(base / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
         "--disable-auto-launch", "--dont-print-server", "--disable-api-nodes"],
        cwd=str(comfy), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    browser = None
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/system_stats", 240, server)
        browser = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
             f"--remote-debugging-port={cdp}", f"--user-data-dir={base / 'chrome'}", "--window-size=1600,1100",
             "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1 , EXCLUDE localhost", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        _wait_http(f"http://127.0.0.1:{cdp}/json/version", 60, browser)
        problems = asyncio.run(_drive(cdp, url))
        return 1 if problems else 0
    finally:
        for proc in (browser, server):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        log.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
