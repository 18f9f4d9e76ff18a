#!/usr/bin/env python3
"""Convert UI-format workflows to API prompts with ComfyUI's real frontend, and check the template-based workflows.

Starts ComfyUI (``main.py --cpu``, a private base directory with this pack linked into its ``custom_nodes``), opens
its frontend in headless Chromium (``tests/comfyui/frontend_driver.py``), and for each workflow:

* loads the UI form as a user does (``app.loadGraphData``) and asks the frontend for its prompt
  (``app.graphToPrompt``, before anything is queued, so no "control after generate" has changed a seed yet);
* compares it with the shipped ``.api.json`` (``_meta`` titles aside);
* for a workflow made from one of ComfyUI's templates (``tests/comfyui/template_workflows.py``): deletes the PatchRay
  nodes as a user does (select them, Delete; the frontend's default "Keep all links when deleting nodes" reconnects
  the MODEL and VAE links through them) and compares the prompt with the one the stock template gives.

Usage (ComfyUI's Python; ``source /work/comfy_env.sh`` or set COMFYUI_DIR / COMFYUI_PYTHON)::

    python tools/frontend_prompts.py                 # every template-based workflow
    python tools/frontend_prompts.py --ui a.json ... # print the frontend's prompt for any UI workflow files

Exits 1 if any difference was found (without ``--ui``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "comfyui"))

# the frontend's prompt for a UI workflow, read before anything is queued
PROMPT_OF = """
(async ([wf, name]) => {
  const app = window.app;
  await app.loadGraphData(wf, true, true, name);
  await new Promise(r => setTimeout(r, 800));
  const reg = LiteGraph.registered_node_types;
  const missing = app.graph._nodes.filter(n => !(n.type in reg)).map(n => n.type);
  const prompt = await app.graphToPrompt();
  return {missing, output: prompt.output};
})(%s)
"""

# the same after deleting the PatchRay nodes the way a user does: select them, then the canvas's Delete
PROMPT_WITHOUT_PATCHRAY = """
(async ([wf, name]) => {
  const app = window.app;
  await app.loadGraphData(wf, true, true, name);
  await new Promise(r => setTimeout(r, 800));
  const canvas = app.canvas;
  const ours = app.graph._nodes.filter(n => n.type.startsWith("PatchRay"));
  const keep = app.extensionManager?.setting?.get?.("Comfy.Node.BypassAllLinksOnDelete");
  canvas.deselectAll();
  for (const n of ours) canvas.select(n);
  canvas.deleteSelected();
  await new Promise(r => setTimeout(r, 300));
  const prompt = await app.graphToPrompt();
  return {removed: ours.length, keep_links_setting: keep, output: prompt.output};
})(%s)
"""


def _strip(prompt: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


def _base_dir() -> Path:
    base = Path(tempfile.mkdtemp(prefix="patchray-frontend-"))
    (base / "custom_nodes").mkdir()
    os.symlink(ROOT, base / "custom_nodes" / "PatchRay")
    return base


async def _run(url: str, jobs: list) -> list:
    from frontend_driver import browser_page

    out = []
    async with browser_page(url) as page:
        for script, wf, name in jobs:
            out.append(await page.js(script % json.dumps([wf, name])))
        out.append(page.patchray_logs())
    return out


def frontend_prompts(jobs: list) -> list:
    """``jobs``: ``(script, ui_workflow, name)``; returns each script's result, then PatchRay's console log."""
    import test_comfyui_server as srv

    if not srv.COMFYUI_DIR:
        raise SystemExit("set COMFYUI_DIR (and COMFYUI_PYTHON) to a ComfyUI checkout: source /work/comfy_env.sh")
    with srv.serve(_base_dir()) as (url, _proc):
        return asyncio.run(_run(url, jobs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ui", nargs="+", help="UI workflow files: print the frontend's prompt for each")
    ap.add_argument("names", nargs="*", help="template-based workflow names (default: all)")
    args = ap.parse_args(argv)

    if args.ui:
        jobs = [(PROMPT_OF, json.loads(Path(p).read_text()), Path(p).name) for p in args.ui]
        results = frontend_prompts(jobs)
        for p, r in zip(args.ui, results):
            print(json.dumps({"file": p, "missing": r["missing"], "prompt": _strip(r["output"])}, indent=1))
        print(json.dumps({"PatchRay log": results[-1]}))
        return 0

    import template_workflows as tw
    from frontend_driver import differences

    names = args.names or list(tw.TEMPLATE_WORKFLOWS)
    jobs = []
    for name in names:
        ui = json.loads((tw.OUT / f"{name}.json").read_text())
        stock = tw.load_template(tw.TEMPLATE_WORKFLOWS[name].template)
        jobs += [(PROMPT_OF, ui, f"{name}.json"), (PROMPT_WITHOUT_PATCHRAY, ui, f"{name}.json"),
                 (PROMPT_OF, stock, f"{tw.TEMPLATE_WORKFLOWS[name].template}.json")]
    results = frontend_prompts(jobs)
    log = results.pop()
    failed = False
    report = {}
    for i, name in enumerate(names):
        mine, removed, stock = results[3 * i : 3 * i + 3]
        api_path = tw.OUT / f"{name}.api.json"
        shipped = json.loads(api_path.read_text())
        problems = [f"unknown node type {t}" for t in mine["missing"] + stock["missing"]]
        problems += [f"frontend vs {api_path.name}: {d}" for d in differences(mine["output"], shipped)]
        problems += [f"PatchRay nodes deleted vs the stock template: {d}" for d in differences(removed["output"], stock["output"])]
        if removed["keep_links_setting"] is False:
            problems.append("the frontend's 'Keep all links when deleting nodes' setting is off")
        report[name] = {"nodes in the frontend's prompt": len(mine["output"]), "PatchRay nodes deleted": removed["removed"],
                        "problems": problems}
        failed |= bool(problems)
    report["PatchRay log"] = log
    failed |= bool(log)
    print(json.dumps(report, indent=1, ensure_ascii=False))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
