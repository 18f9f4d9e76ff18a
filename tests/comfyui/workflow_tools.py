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


# -- node sizes as the frontend (LiteGraph in ComfyUI frontend 1.27) computes them, for layout and overlap checks

#: the title bar is drawn above a node's ``pos`` (LiteGraph.NODE_TITLE_HEIGHT)
TITLE_HEIGHT = 30
#: node badges (the node's source, e.g. "PatchRay", "[BETA] PatchRay") sit above the title bar's right end
BADGE_HEIGHT = 20
#: one input/output socket row, one widget row (LiteGraph.NODE_SLOT_HEIGHT, NODE_WIDGET_HEIGHT + its 4 px margin)
SLOT_HEIGHT, WIDGET_HEIGHT = 20, 24
#: what some nodes show below their widgets, at the size the shipped workflows give them: image previews (the
#: frontend draws an executed image node's pictures in the space left), multi-line text boxes, PatchRay's panels
#: (web/patchray.js: the DOM view's minimum height)
EXTRA_HEIGHT = {
    "SaveImage": 300, "PreviewImage": 300, "LoadImage": 260, "SaveAnimatedWEBP": 260, "CLIPTextEncode": 90,
    "MarkdownNote": 200, "Note": 200,
    "PatchRayCluster": 110, "PatchRayTilePlanner": 230, "PatchRayTopologyProbe": 220, "PatchRayBenchmark": 240,
    "PatchRayVAEDecode": 70, "PatchRayVAEEncode": 70, "PatchRayParallelVAE": 70, "PatchRayKSampler": 70, "PatchRayKSamplerAdvanced": 70,
    "PatchRayParallelModel": 90, "PatchRaySamplerBenchmark": 170,
}
#: widths that keep the widget labels and values, and the panels' lines, readable
MIN_WIDTH = {"PatchRayTopologyProbe": 520, "PatchRayBenchmark": 560, "PatchRayTilePlanner": 520, "PatchRayCluster": 400,
             "PatchRayKSampler": 360, "PatchRayKSamplerAdvanced": 360, "PatchRayParallelModel": 360, "CLIPTextEncode": 400, "MarkdownNote": 560, "Note": 400}
DEFAULT_WIDTH = 320


def min_node_size(info: dict, node_type: str) -> tuple:
    """``(width, height)`` a node of ``node_type`` needs so every socket, widget and panel shows (height without title)."""
    spec = info.get(node_type)
    extra = EXTRA_HEIGHT.get(node_type, 0)
    if spec is None:  # a virtual node (Note, MarkdownNote): its text box only
        return MIN_WIDTH.get(node_type, DEFAULT_WIDTH), 40 + extra
    widgets = sum(1 + int(i["control_after_generate"]) + int(i["upload"]) for i in spec["inputs"] if i["widget"])
    sockets = sum(1 for i in spec["inputs"] if not i["widget"])
    rows = max(sockets, len(spec["outputs"]))
    # 14: the body's top and bottom padding (measured: frontend 1.27 sized these estimates 4 px taller with 10)
    return MIN_WIDTH.get(node_type, DEFAULT_WIDTH), 14 + rows * SLOT_HEIGHT + widgets * WIDGET_HEIGHT + extra


#: a widget row shows its label at the left and its value at the right; when both do not fit, the frontend cuts the
#: label (to "unet_n..." or nothing). Frontend 1.27's widget font takes about 6 px per character at zoom 1 (measured on
#: the shipped screenshots: a 39-character file name spans 226 px); arrows and margins take about 80 px.
CHAR_WIDTH, WIDGET_CHROME = 6.5, 80


def widget_text_width(info: dict, node_type: str, values: dict) -> int:
    """Width a node needs so every combo and one-line text widget shows its whole label and value.

    ``values``: input name -> value (the API form's inputs). Text with whitespace is a prompt box (multi-line, no
    label), not a one-line widget."""
    spec = info.get(node_type)
    if spec is None:
        return 0
    need = 0
    for i in spec["inputs"]:
        v = values.get(i["name"])
        if not i["widget"] or not isinstance(v, str) or i["type"] not in ("COMBO", "STRING"):
            continue
        if i["type"] == "STRING" and any(c.isspace() for c in v):
            continue
        need = max(need, int(CHAR_WIDTH * (len(i["name"]) + len(v)) + WIDGET_CHROME + 0.5))
    return need


def node_box(node: dict) -> tuple:
    """``(x0, y0, x1, y1)`` of a UI-format node on the canvas, title bar and badges included."""
    (x, y), (w, h) = node["pos"], node["size"]
    return x, y - TITLE_HEIGHT - BADGE_HEIGHT, x + w, y + h


def overlaps(ui: dict, margin: int = 0) -> list:
    """Pairs of node ids whose boxes (title bars included, grown by ``margin``) intersect."""
    boxes = [(n["id"], node_box(n)) for n in ui["nodes"] if not n.get("flags", {}).get("collapsed")]
    found = []
    for i, (a, (ax0, ay0, ax1, ay1)) in enumerate(boxes):
        for b, (bx0, by0, bx1, by1) in boxes[i + 1 :]:
            if ax0 < bx1 + margin and bx0 < ax1 + margin and ay0 < by1 + margin and by0 < ay1 + margin:
                found.append((a, b))
    return found


# -- the frontend's conversion for any graph of ComfyUI's templates: bypassed nodes, primitive nodes, reroutes

#: frontend-only nodes: never in a prompt (a PrimitiveNode's value goes into the widget it feeds; a Reroute passes its link on)
FRONTEND_ONLY = VIRTUAL | {"PrimitiveNode", "Reroute"}
#: node modes (LiteGraph): 0 always, 2 never (muted), 4 bypassed
MUTED, BYPASSED = 2, 4


def _valid_connection(a, b) -> bool:
    """LiteGraph.isValidConnection: "*" or "" matches anything, else a shared entry of the comma lists (any case)."""
    if a in ("", "*", None, 0) or b in ("", "*", None, 0) or a == b:
        return True
    return bool({t.strip().lower() for t in str(a).split(",")} & {t.strip().lower() for t in str(b).split(",")})


def _bypass_input(node: dict, slot: int, want: str):
    """The input a bypassed node passes to its output ``slot`` when read as type ``want`` (the frontend's rule in
    ExecutableNodeDTO: the input at the same index if its type fits both, else the first input of exactly ``want``)."""
    inputs = node.get("inputs") or []
    if want in ("*", ""):
        return slot if len(inputs) > slot else (0 if inputs else None)
    out_type = node["outputs"][slot]["type"]
    if slot < len(inputs) and _valid_connection(inputs[slot]["type"], out_type) and _valid_connection(inputs[slot]["type"], want):
        return slot
    return next((i for i, inp in enumerate(inputs) if inp["type"] == want), None)


def ui_to_api_graph(ui: dict, info: dict) -> dict:
    """:func:`ui_to_api` for the graphs ComfyUI's templates use, as ComfyUI's frontend (1.27) converts them on Queue.

    Beyond :func:`ui_to_api`: a link from a bypassed node (mode 4) reads the bypassed node's matching input instead
    (nothing if that input is unplugged), a PrimitiveNode's value goes into the widget it feeds, a Reroute passes its
    link on. Muted (mode 2) and bypassed nodes and frontend-only nodes are left out. A graph with subgraphs is refused
    (``NotImplementedError``); so is an active node reading a muted node's output (the frontend's answer there is not
    modelled). Nodes come out in id order."""
    if (ui.get("definitions") or {}).get("subgraphs"):
        raise NotImplementedError("a workflow with subgraphs")
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {l[0]: l for l in ui["links"]}

    def resolve(link_id, want, reader):
        """``("link", [id, slot])``, ``("value", v)`` or ``None`` (nothing arrives) for the link feeding ``reader``."""
        for _ in range(len(nodes) + 1):
            _, src_id, slot = links[link_id][:3]
            src = nodes[src_id]
            if src["type"] == "PrimitiveNode":
                return "value", src["widgets_values"][0]
            if src["type"] == "Reroute" or src.get("mode", 0) == BYPASSED:
                idx = 0 if src["type"] == "Reroute" else _bypass_input(src, slot, want)
                if idx is None or (src.get("inputs") or [{}])[idx].get("link") is None:
                    return None
                link_id = src["inputs"][idx]["link"]
                continue
            if src.get("mode", 0) == MUTED:
                raise ValueError(f"node {reader} reads the output of muted node {src_id}")
            return "link", [str(src_id), slot]
        raise ValueError(f"node {reader}: a loop of bypassed nodes")

    api = {}
    for node in sorted(ui["nodes"], key=lambda n: n["id"]):
        t = node["type"]
        if t in FRONTEND_ONLY or node.get("mode", 0) in (MUTED, BYPASSED):
            continue
        inputs = {}
        values = list(node.get("widgets_values") or [])
        pos = 0
        for w in widget_inputs(info, t):
            if pos >= len(values):
                break
            inputs[w["name"]] = values[pos]
            pos += 1 + int(w["control_after_generate"]) + int(w["upload"])
        if pos != len(values):
            raise ValueError(f"node {node['id']} ({t}): {len(values)} widget values, the node type takes {pos}")
        declared = {i["name"]: i["type"] for i in info[t]["inputs"]}
        for slot in node.get("inputs", []):
            if slot.get("link") is None:
                continue
            got = resolve(slot["link"], declared.get(slot["name"], slot["type"]), node["id"])
            if got is not None:
                inputs[slot["name"]] = got[1]
        api[str(node["id"])] = {"class_type": t, "inputs": inputs, "_meta": {"title": node.get("title") or t}}
    return api
