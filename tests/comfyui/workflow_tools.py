"""Workflow helpers shared by the workflow tests and ``build_workflows.py`` (no ComfyUI needed).

* :func:`node_info` -- every known node type's inputs (in declaration order, with widget flags) and outputs:
  ComfyUI's stock nodes from ``tests/fixtures/comfy_stock_nodes.json`` (recorded from a real 0.3.64
  ``/object_info``) plus PatchRay's nodes read from their schemas.
* :func:`ui_to_api` -- the UI-format -> API-format conversion the frontend performs on Queue (for graphs
  without subgraphs, reroutes or primitive nodes): positional ``widgets_values`` -> named inputs, skipping the
  frontend-only values (the "control after generate" of a seed widget, an upload combo's "upload"), links -> ``[id, slot]``,
  virtual nodes (Note, MarkdownNote) and muted/bypassed nodes dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STOCK = ROOT / "tests" / "fixtures" / "comfy_stock_nodes.json"
VIRTUAL = {"Note", "MarkdownNote"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _patchray_info() -> dict:
    import importlib.util
    import sys

    if importlib.util.find_spec("comfy_api") is None:
        sys.path.insert(0, str(ROOT / "tests" / "nodes" / "standin"))
    from patchray.nodes import NODES

    out = {}
    for cls in NODES:
        s = cls.define_schema()
        inputs = []
        for i in s.inputs:
            t = "COMBO" if getattr(i, "options", None) is not None else str(i.io_type)
            entry = {"name": i.id, "type": t, "optional": bool(i.optional), "widget": t in WIDGET_TYPES,
                     "control_after_generate": bool(getattr(i, "control_after_generate", False)), "upload": False}
            if t == "COMBO":
                entry["options"] = list(i.options)
            inputs.append(entry)
        out[s.node_id] = {"inputs": inputs, "outputs": [str(o.io_type) for o in s.outputs], "output_node": bool(s.is_output_node)}
    return out


def node_info() -> dict:
    stock = json.loads(STOCK.read_text())["nodes"]
    for d in stock.values():
        for i in d["inputs"]:
            for flag in ("optional", "widget", "control_after_generate", "upload"):
                i.setdefault(flag, False)
    return {**stock, **_patchray_info()}


def widget_inputs(info: dict, node_type: str) -> list:
    return [i for i in info[node_type]["inputs"] if i["widget"]]


def ui_to_api(ui: dict, info: dict) -> dict:
    """Convert a UI-format workflow to the API prompt the frontend would queue."""
    links = {l[0]: l for l in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        t = node["type"]
        if t in VIRTUAL or node.get("mode", 0) in (2, 4):
            continue
        inputs = {}
        values = list(node.get("widgets_values") or [])
        pos = 0
        for w in widget_inputs(info, t):
            if pos >= len(values):
                break
            linked = any(s["name"] == w["name"] and s.get("link") is not None for s in node.get("inputs", []))
            if not linked:
                inputs[w["name"]] = values[pos]
            pos += 1 + int(w["control_after_generate"]) + int(w["upload"])
        if pos != len(values):
            raise ValueError(f"node {node['id']} ({t}): {len(values)} widget values, the node type takes {pos}")
        for slot in node.get("inputs", []):
            if slot.get("link") is None:
                continue
            l = links[slot["link"]]
            inputs[slot["name"]] = [str(l[1]), l[2]]
        api[str(node["id"])] = {"class_type": t, "inputs": inputs, "_meta": {"title": node.get("title") or t}}
    return api
