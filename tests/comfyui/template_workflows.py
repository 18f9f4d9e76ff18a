"""Workflows made from ComfyUI's own templates: the template's graph, layout, notes and links, plus PatchRay's nodes.

Each entry of :data:`TEMPLATE_WORKFLOWS` names a template of ComfyUI's template library (the PyPI package
``comfyui-workflow-templates``, pinned by ComfyUI 0.3.64 at :data:`TEMPLATES_VERSION`, read at build time) and says
where the inserted nodes go. :func:`build` then

* finds every sampling node's MODEL (KSampler, KSamplerAdvanced, SamplerCustom, and the guiders SamplerCustomAdvanced
  reads) back to the output it comes from (the end of that model chain: after the loaders, LoRAs, ModelSampling...)
  and puts one **PatchRay Parallel Model** on each such output: every link that output fed now leaves the Parallel
  Model (the template's other MODEL links, e.g. a BasicScheduler's on the loader's output, stay as they are);
* puts one **PatchRay Parallel VAE** on the output each VAE Decode / VAE Decode (Tiled) reads its VAE from, and moves
  the decode nodes' links onto it (encode nodes stay on the plain VAE);
* adds one **PatchRay Cluster** feeding all of them, and a MarkdownNote saying what the added nodes do;
* gives an added node the mode of what it feeds (bypassed where it only feeds a bypassed group's nodes), sets the
  noise widgets' "control after generate" to *fixed* (so a run with and a run without the PatchRay nodes compare), and
  places the added nodes where nothing is (or in a column it opens inside a group, moving what is right of it);
* makes the API form with :func:`workflow_tools.ui_to_api_graph` (the frontend's conversion: bypassed nodes pass
  their input through, primitive nodes' values go into their widgets); ``tools/frontend_prompts.py`` checks it
  against ComfyUI's real frontend.

Run ``python tests/comfyui/build_workflows.py`` (it writes these with the other shipped workflows); without the
templates package it says so and writes only the others.
"""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workflow_tools import (  # noqa: E402
    BYPASSED, MUTED, ROOT, TITLE_HEIGHT, BADGE_HEIGHT, min_node_size, node_box, overlaps, ui_to_api_graph, widget_text_width,
)

sys.path.insert(0, str(ROOT / "tools"))
from template_facts import GUIDER_RE, SAMPLING_NODES, default_template_dirs  # noqa: E402

OUT = ROOT / "workflows"
TEMPLATES_PACKAGE = "comfyui-workflow-templates"
#: the version ComfyUI 0.3.64 pins (its requirements.txt), which the shipped files were made from
TEMPLATES_VERSION = "0.1.95"

#: the inserted nodes' widgets: the nodes' defaults (tests/nodes/test_workflows.py checks them against the schemas)
CLUSTER_VALUES = {"num_ranks": 2, "device": "auto", "address": "", "gpu_ids": ""}
MODEL_VALUES = {"preset": "full_sync", "warmup_steps": -1, "refresh_every": -1, "k_ratio": 0.25, "block_size": 8,
                "parallelism": "auto", "sequence_attention": "auto", "balance": "equal", "sharding": "none"}
VAE_VALUES = {"mode": "auto", "precision": "auto", "gn_sync": False, "balance": "equal"}

#: the decode nodes whose VAE link moves onto the Parallel VAE (VAE Decode, VAE Decode (Tiled)...; encodes stay)
DECODE_RE = re.compile(r"^VAEDecode\w*$")
#: space kept around an added node (the tests' overlap check uses 10)
MARGIN = 30
NOTE_WIDTH = 760


class TemplatesMissing(RuntimeError):
    """The templates package is not installed (or is another version than the shipped files were made from)."""


@dataclass
class Recipe:
    """Where one template's added nodes go.

    ``place``: role -> where: ``(x, y)`` (the node's ``pos``), or ``(side, ref)`` with side ``below`` / ``above`` /
    ``left`` / ``right`` of ``ref`` (a template node id, an earlier role, or ``"group:<title>"``): the nearest spot to
    that point where the node's box, grown by :data:`MARGIN`, meets no node and no group. Roles: ``cluster``,
    ``note``, ``model@<id>`` / ``vae@<id>`` (the Parallel Model / VAE on node ``<id>``'s output). A role not listed
    goes below the first node it feeds. ``inside``: role -> group title the node must lie in (it moves with, and is
    bypassed with, that group). ``columns``: ``(x, width, y0, y1)``: before placing, every node and group whose
    top-left lies at or right of ``x`` and between ``y0`` and ``y1`` moves right by ``width``; a group there that
    spans ``x`` grows by ``width``."""

    template: str
    title: str
    note: str
    place: dict = field(default_factory=dict)
    inside: dict = field(default_factory=dict)
    columns: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------- notes

_REMOVE = (
    "\n\nEverything else is the template as ComfyUI ships it: the same models (file names), prompts, sizes and "
    "settings. **To get the stock template back**, delete the PatchRay nodes (ComfyUI reconnects the MODEL and VAE "
    "links through them) or bypass them (select, Ctrl+B). The random-noise widgets are set to *fixed*, so a run "
    "with and a run without the PatchRay nodes can be compared."
)


def _note(title: str, model_where: str, vae_where: str, extra: str, video: bool = False) -> str:
    band = "frames' rows" if video else "image's rows"
    return (
        f"## PatchRay: ComfyUI's \"{title}\" template on several GPUs\n\n"
        f"This is ComfyUI's own **{title}** template with PatchRay's nodes added:\n\n"
        "- **PatchRay Cluster** starts one worker (rank) per GPU: *num_ranks* says how many, *gpu_ids* which ones.\n"
        f"- **PatchRay Parallel Model** sits {model_where}: the sampler then runs every step on the cluster's GPUs "
        f"instead of one. *parallelism* auto picks how they share a step: the positive and the negative prompt on "
        f"different GPUs when cfg is above 1, else each GPU a band of the {band}. *preset* full_sync gives the "
        "stock template's result. The GPUs hold the model, so ComfyUI's own process does not load it onto its GPU.\n"
        f"- **PatchRay Parallel VAE** sits {vae_where}: the decode runs on the same GPUs (*mode* auto: each GPU a "
        "band of rows, or tiles when the GPUs' links favour them)." + _REMOVE + ("\n\n" + extra if extra else "")
    )


TEMPLATE_WORKFLOWS = {
    "template_flux_dev_parallel": Recipe(
        template="flux_dev_checkpoint_example", title="Flux Dev fp8",
        note=_note("Flux Dev fp8", "between **Load Checkpoint** and the **KSampler**",
                   "between **Load Checkpoint**'s VAE and **VAE Decode**",
                   "FLUX.1 dev is guidance-distilled (cfg 1, **FluxGuidance** 3.5): with no negative pass to split, "
                   "*auto* gives each GPU a band of the image."),
        place={"model@30": (816, 760), "vae@30": ("right", "model@30"), "cluster": ("left", "model@30"),
               "note": ("left", "cluster")},
    ),
    "template_hunyuan_video_t2v_parallel": Recipe(
        template="hunyuan_video_text_to_video", title="Hunyuan Video Text to Video",
        note=_note("Hunyuan Video Text to Video", "between **ModelSamplingSD3** and **BasicGuider**",
                   "between **Load VAE** and **VAE Decode (Tiled)** (and the muted **VAE Decode**, should you "
                   "switch to it)",
                   "**BasicScheduler** keeps the loader's MODEL, as in the template: it only reads the model's noise "
                   "schedule. BasicGuider has no cfg, so *auto* gives each GPU a band of the frames' rows. On the "
                   "Parallel VAE, VAE Decode (Tiled) decodes whole (its tile sizes are not used): each GPU holds only "
                   "its band, which is what the tiles were for.", video=True),
        place={"model@67": ("below", "group:Custom sampler"), "vae@10": ("right", "model@67"),
               "cluster": ("left", "model@67"), "note": ("left", "cluster")},
    ),
    "template_ltxv_t2v_parallel": Recipe(
        template="ltxv_text_to_video", title="LTXV Text to Video",
        note=_note("LTXV Text to Video", "between **Load Checkpoint** and **SamplerCustom**",
                   "between **Load Checkpoint**'s VAE and **VAE Decode**",
                   "The checkpoint holds both the model and the VAE. With cfg 3 on 2 GPUs *auto* puts the positive "
                   "and the negative prompt on different GPUs.", video=True),
        place={"model@44": ("below", "group:Custom sampler"), "vae@44": ("right", "model@44"),
               "cluster": ("left", "model@44"), "note": ("left", "cluster")},
    ),
    "template_wan22_14b_t2v_parallel": Recipe(
        template="video_wan2_2_14B_t2v", title="Wan 2.2 14B Text to Video",
        note=_note("Wan 2.2 14B Text to Video",
                   "on each expert's model chain (after its LoRA and **ModelSamplingSD3**, before its **KSampler "
                   "(Advanced)**)",
                   "between **Load VAE** and **VAE Decode**",
                   "Wan 2.2 14B is two models, a high-noise expert for the first steps and a low-noise expert for "
                   "the rest: each gets its own Parallel Model, and both use the one Cluster. The second group (the "
                   "fp8_scaled version without the 4-step LoRA) has its own Parallel Models and Parallel VAE, "
                   "bypassed with it: they come on with the group (box-select it, Ctrl+B). The Cluster sits outside "
                   "both groups so either can use it.\n\n"
                   "The 4-step group applies the Lightning LoRAs to the fp8_scaled weights on the ranks exactly as "
                   "ComfyUI applies them; `sharding blocks` on the Parallel Models splits each expert's weights "
                   "over the ranks when one card cannot hold them.", video=True),
        columns=[(975, 860, -1000, 700), (895, 860, 700, 2200)],
        place={"model@82": (1000, -230), "model@86": (1420, -230), "vae@73": (1000, 210),
               "model@93": (920, 860), "model@94": (1340, 860), "vae@92": (920, 1300),
               "cluster": ("above", "model@86"), "note": ("right", "cluster")},
        inside={"model@82": "Wan2.2 T2V fp8_scaled +  4 steps LoRA", "model@86": "Wan2.2 T2V fp8_scaled +  4 steps LoRA",
                "vae@73": "Wan2.2 T2V fp8_scaled +  4 steps LoRA", "model@93": "Wan2.2 T2V fp8_scaled",
                "model@94": "Wan2.2 T2V fp8_scaled", "vae@92": "Wan2.2 T2V fp8_scaled"},
    ),
    "template_qwen_image_parallel": Recipe(
        template="image_qwen_image", title="Qwen-Image Text to Image",
        note=_note("Qwen-Image Text to Image", "between **ModelSamplingAuraFlow** and the **KSampler**",
                   "between **Load VAE** and **VAE Decode**",
                   "The model chain is the template's: the loader, the Lightning LoRA (bypassed, as in the template: "
                   "un-bypass it for 8 steps) and ModelSamplingAuraFlow. With cfg 2.5 on 2 GPUs *auto* puts the "
                   "positive and the negative prompt on different GPUs."),
        place={"model@66": ("below", 3), "vae@39": ("right", "model@66"), "cluster": ("left", "model@66"),
               "note": ("left", "cluster")},
    ),
    "template_sdxl_parallel": Recipe(
        template="sdxl_simple_example", title="SDXL Simple",
        note=_note("SDXL Simple", "on the base model and on the refiner model (each before its **KSampler "
                   "(Advanced)**)", "between the refiner's **Load Checkpoint** VAE and **VAE Decode**",
                   "The base and the refiner are two models: each gets its own Parallel Model, both on the one "
                   "Cluster. The decode uses the refiner checkpoint's VAE, as the template does."),
        place={"model@4": ("right", "group:Base"), "model@12": ("right", "group:Refiner"),
               "vae@12": ("below", "group:VAE Decoder"), "cluster": ("above", "model@4"), "note": ("right", "cluster")},
    ),
}


# ---------------------------------------------------------------------------------------------- the templates

def installed_version():
    import importlib.metadata

    try:
        return importlib.metadata.version(TEMPLATES_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def templates_dir(check_version: bool = True) -> Path:
    """The installed templates folder; :class:`TemplatesMissing` (saying how to install it) if there is none, or if
    ``check_version`` and it is another version than :data:`TEMPLATES_VERSION`."""
    dirs = default_template_dirs()
    version = installed_version()
    if not dirs:
        raise TemplatesMissing(f"ComfyUI's template library is not installed: pip install {TEMPLATES_PACKAGE}=="
                               f"{TEMPLATES_VERSION} (the version ComfyUI 0.3.64 pins) to build the template workflows")
    if check_version and version != TEMPLATES_VERSION:
        raise TemplatesMissing(f"{TEMPLATES_PACKAGE} {version} is installed; the shipped template workflows are made "
                               f"from {TEMPLATES_VERSION}: pip install {TEMPLATES_PACKAGE}=={TEMPLATES_VERSION}")
    return dirs[0]


def load_template(name: str, check_version: bool = True) -> dict:
    path = templates_dir(check_version) / f"{name}.json"
    if not path.is_file():
        raise TemplatesMissing(f"no template {name!r} in {path.parent}")
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------- the graph edit

def _is_sampling(node_type: str) -> bool:
    return node_type in SAMPLING_NODES or bool(GUIDER_RE.search(node_type))


def _mode_for(targets: list) -> int:
    """An added node runs if anything it feeds runs; else it is bypassed (or muted) with what it feeds."""
    modes = {t.get("mode", 0) for t in targets}
    return 0 if 0 in modes else (BYPASSED if BYPASSED in modes else MUTED)


def splices(ui: dict) -> list:
    """``(kind, source node id, source slot, [link ids to move])`` for each Parallel Model / Parallel VAE to add."""
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {l[0]: l for l in ui["links"]}
    found = {}
    for n in sorted(ui["nodes"], key=lambda n: n["id"]):
        for kind, wants, name in (("model", _is_sampling, "model"), ("vae", DECODE_RE.match, "vae")):
            if not wants(n["type"]):
                continue
            link = next((i.get("link") for i in n.get("inputs") or [] if i["name"] == name), None)
            if link is None:
                continue
            src, slot = links[link][1], links[link][2]
            found.setdefault((kind, src, slot), [])
    out = []
    for (kind, src, slot) in found:
        moved = [lid for lid in nodes[src]["outputs"][slot]["links"] or []
                 if kind == "model" or DECODE_RE.match(nodes[links[lid][3]]["type"])]
        out.append((kind, src, slot, moved))
    return out


def _new_node(nid: int, node_type: str, values: dict, info: dict, mode: int) -> dict:
    """A node as build_workflows.build writes one: sockets for the non-widget inputs, widget values in order."""
    sockets, widgets = [], []
    for inp in info[node_type]["inputs"]:
        if inp["widget"]:
            widgets.append(values[inp["name"]])
            widgets += ["fixed"] * int(inp["control_after_generate"]) + ["image"] * int(inp["upload"])
        else:
            sockets.append({"name": inp["name"], "type": inp["type"], "link": None})
    w, h = min_node_size(info, node_type)
    return {"id": nid, "type": node_type, "pos": [0, 0], "size": [max(w, widget_text_width(info, node_type, values)), h],
            "flags": {}, "order": 0, "mode": mode, "inputs": sockets,
            "outputs": [{"name": o, "type": o, "links": [], "slot_index": s} for s, o in enumerate(info[node_type]["outputs"])],
            "properties": {"Node name for S&R": node_type}, "widgets_values": widgets}


def _fix_noise_controls(ui: dict, info: dict) -> None:
    """Set every noise widget's "control after generate" to fixed (the value after each such widget's value)."""
    for n in ui["nodes"]:
        spec = info.get(n["type"])
        if spec is None or not isinstance(n.get("widgets_values"), list):
            continue
        pos = 0
        for w in (i for i in spec["inputs"] if i["widget"]):
            if w["control_after_generate"] and pos + 1 < len(n["widgets_values"]):
                n["widgets_values"][pos + 1] = "fixed"
            pos += 1 + int(w["control_after_generate"]) + int(w["upload"])


# ---------------------------------------------------------------------------------------------- the layout

def _group_box(g: dict) -> tuple:
    x, y, w, h = g["bounding"]
    return x, y, x + w, y + h


def _grow(box: tuple, by: float) -> tuple:
    return box[0] - by, box[1] - by, box[2] + by, box[3] + by


def _meets(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _within(a: tuple, b: tuple) -> bool:
    return b[0] <= a[0] and b[1] <= a[1] and a[2] <= b[2] and a[3] <= b[3]


def open_column(ui: dict, x: float, width: float, y0: float, y1: float) -> None:
    """Move every node and group whose top-left is at or right of ``x`` (and between ``y0`` and ``y1``) right by
    ``width``; a group there that spans ``x`` grows by ``width`` (what was inside it stays inside)."""
    for n in ui["nodes"]:
        if n["pos"][0] >= x and y0 <= n["pos"][1] < y1:
            n["pos"] = [n["pos"][0] + width, n["pos"][1]]
    for g in ui.get("groups", []):
        gx, gy, gw, gh = g["bounding"]
        if y0 <= gy < y1:
            if gx >= x:
                g["bounding"] = [gx + width, gy, gw, gh]
            elif gx + gw > x:
                g["bounding"] = [gx, gy, gw + width, gh]


def free_spot(size: tuple, anchor: tuple, obstacles: list, inside: tuple = None) -> list:
    """The ``pos`` nearest ``anchor`` for a node of body ``size`` whose box (title bar and badges included), grown by
    :data:`MARGIN`, meets none of ``obstacles`` (and lies within ``inside`` when given)."""
    w, h = size
    top = TITLE_HEIGHT + BADGE_HEIGHT
    xs, ys = {anchor[0]}, {anchor[1]}
    for o in obstacles + ([inside] if inside else []):
        xs |= {o[2] + MARGIN, o[0] - MARGIN - w, o[0] + MARGIN}
        ys |= {o[3] + MARGIN + top, o[1] - MARGIN - h, o[1] + MARGIN + top}
    best = None
    for x in xs:
        for y in ys:
            box = _grow((x, y - top, x + w, y + h), MARGIN)
            if inside and not _within(box, inside):
                continue
            if any(_meets(box, o) for o in obstacles):
                continue
            d = math.hypot(x - anchor[0], y - anchor[1])
            if best is None or d < best[0]:
                best = (d, [x, y])
    if best is None:
        raise RuntimeError(f"no free spot for a {w}x{h} node near {anchor}")
    return best[1]


def _anchor(where, size: tuple, boxes: dict) -> tuple:
    """``(x, y)`` for a placement spec (see :class:`Recipe`)."""
    if isinstance(where[0], (int, float)):
        return where
    side, ref = where
    x0, y0, x1, y1 = boxes[ref]
    w, h = size
    top = TITLE_HEIGHT + BADGE_HEIGHT
    return {"below": (x0, y1 + MARGIN + top), "above": (x0, y0 - MARGIN - h), "left": (x0 - MARGIN - w, y0 + top),
            "right": (x1 + MARGIN, y0 + top)}[side]


def _note_height(text: str, width: int) -> int:
    """Height a MarkdownNote needs to show ``text`` at ``width``, with room to spare (the frontend's markdown takes
    about 5 px a character and 17 px a line at zoom 1)."""
    per_line = max(20, (width - 30) // 5)
    lines = sum(max(1, math.ceil(len(par) / per_line)) for par in text.split("\n"))
    return 60 + 17 * lines


# ---------------------------------------------------------------------------------------------- build

def build(name: str, info: dict, template: dict = None):
    """``(ui, api)`` of the template-based workflow ``name`` (the template read from the package unless given)."""
    recipe = TEMPLATE_WORKFLOWS[name]
    tpl = template if template is not None else load_template(recipe.template)
    if (tpl.get("definitions") or {}).get("subgraphs"):
        raise NotImplementedError(f"{recipe.template} uses subgraphs: pick a template without them")
    unknown = sorted({n["type"] for n in tpl["nodes"]} - set(info) - {"Note", "MarkdownNote", "PrimitiveNode", "Reroute"})
    if unknown:
        raise KeyError(f"{recipe.template}: node types missing from the recorded stock node table: {unknown}")
    ui = copy.deepcopy(tpl)
    ui["id"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"patchray/workflows/{name}"))
    ui["revision"] = 0
    _fix_noise_controls(ui, info)
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {l[0]: l for l in ui["links"]}
    next_node, next_link = ui["last_node_id"] + 1, ui["last_link_id"] + 1

    def link(src: dict, slot: int, dst: dict, dslot: int) -> None:
        nonlocal next_link
        ltype = src["outputs"][slot]["type"]
        ui["links"].append([next_link, src["id"], slot, dst["id"], dslot, ltype])
        src["outputs"][slot]["links"] = (src["outputs"][slot].get("links") or []) + [next_link]
        dst["inputs"][dslot]["link"] = next_link
        next_link += 1

    cluster = _new_node(next_node, "PatchRayCluster", CLUSTER_VALUES, info, 0)
    next_node += 1
    added = {"cluster": cluster}
    cuts = splices(ui)
    for kind, src, slot, moved in sorted(cuts, key=lambda c: (c[0] != "model", c[1])):
        node_type, values = ("PatchRayParallelModel", MODEL_VALUES) if kind == "model" else ("PatchRayParallelVAE", VAE_VALUES)
        new = _new_node(next_node, node_type, values, info, _mode_for([nodes[links[l][3]] for l in moved]))
        next_node += 1
        added[f"{kind}@{src}"] = new
        out = nodes[src]["outputs"][slot]
        out["links"] = [l for l in out["links"] if l not in moved]
        for lid in moved:  # the consumers now read the Parallel node; their links keep their ids
            links[lid][1], links[lid][2] = new["id"], 0
            new["outputs"][0]["links"].append(lid)
        link(nodes[src], slot, new, 0)
        link(cluster, 0, new, 1)
    note_h = max(min_node_size(info, "MarkdownNote")[1], _note_height(recipe.note, NOTE_WIDTH))
    note = {"id": next_node, "type": "MarkdownNote", "pos": [0, 0], "size": [NOTE_WIDTH, note_h], "flags": {}, "order": 0, "mode": 0, "inputs": [], "outputs": [], "properties": {},
            "widgets_values": [recipe.note], "color": "#432", "bgcolor": "#653"}
    added["note"] = note
    missing = set(recipe.place) - set(added)
    if missing:
        raise KeyError(f"{name}: the recipe places {sorted(missing)}, the template gives {sorted(added)}")

    # layout: open the recipe's columns, then place each added node (the recipe's order first, then the rest)
    before = set(overlaps(ui, margin=10))
    for col in recipe.columns:
        open_column(ui, *col)
    if not set(overlaps(ui, margin=10)) <= before:
        raise RuntimeError(f"{name}: the columns opened make the template's nodes overlap")
    links = {l[0]: l for l in ui["links"]}
    groups = {g["title"]: g for g in ui.get("groups", [])}
    boxes = {n["id"]: node_box(n) for n in ui["nodes"]}
    boxes.update({f"group:{t}": _group_box(g) for t, g in groups.items()})
    obstacles = [node_box(n) for n in ui["nodes"]]
    # not in the recipe: a Parallel node below the first node it feeds, the Cluster left of the first Parallel Model
    # (or VAE), the note left of the Cluster
    parallel = [r for r in added if "@" in r]
    defaults = {r: ("below", links[added[r]["outputs"][0]["links"][0]][3]) for r in parallel}
    defaults.update(cluster=("left", parallel[0]), note=("left", "cluster"))
    order = list(recipe.place) + [r for r in parallel + ["cluster", "note"] if r not in recipe.place]
    for role in order:
        n = added[role]
        inside = groups[recipe.inside[role]] if role in recipe.inside else None
        where = recipe.place.get(role, defaults[role])
        spot = _anchor(where, n["size"], boxes)
        if not isinstance(where[0], (int, float)):  # a spot near the anchor; an (x, y) is taken as it is (checked below)
            frame = _group_box(inside) if inside else None
            # groups are obstacles, but for the one the node goes in and those around that one
            blocked = obstacles + [_group_box(g) for g in ui.get("groups", [])
                                   if frame is None or not _within(frame, _group_box(g))]
            spot = free_spot(n["size"], spot, blocked, frame)
        n["pos"] = [round(spot[0]), round(spot[1])]
        box = node_box(n)
        if inside and not _within(box, _group_box(inside)):
            raise RuntimeError(f"{name}: {role} at {n['pos']} is not inside group {recipe.inside[role]!r}")
        if any(_meets(_grow(box, MARGIN / 2), o) for o in obstacles):
            raise RuntimeError(f"{name}: {role} at {n['pos']} overlaps a node")
        if not inside and any(_meets(box, _group_box(g)) for g in ui.get("groups", [])):
            raise RuntimeError(f"{name}: {role} at {n['pos']} reaches into a group")
        obstacles.append(box)
        boxes[role] = box
    for order_i, n in enumerate(added.values()):
        n["order"] = len(ui["nodes"]) + order_i
        ui["nodes"].append(n)
    ui["last_node_id"] = next_node
    ui["last_link_id"] = next_link - 1
    ui.setdefault("extra", {})["ds"] = _view(ui)
    api = ui_to_api_graph(ui, info)
    for v in api.values():
        v["_meta"] = {"title": v["class_type"]}
    return ui, api


def _view(ui: dict) -> dict:
    """The canvas view a workflow opens at: all of it, in a 1600 x 1100 window (less the frontend's side and top
    bars), at most at the scale 1."""
    boxes = [node_box(n) for n in ui["nodes"]] + [_group_box(g) for g in ui.get("groups", [])]
    x0, y0 = min(b[0] for b in boxes), min(b[1] for b in boxes)
    x1, y1 = max(b[2] for b in boxes), max(b[3] for b in boxes)
    scale = math.floor(min(1.0, 1400 / (x1 - x0), 900 / (y1 - y0)) * 100) / 100
    return {"scale": scale, "offset": [round(80 / scale - x0), round(60 / scale - y0)]}


def write_all(info: dict, names=None) -> list:
    """Build and write each template workflow; returns the paths written."""
    written = []
    for name in names or TEMPLATE_WORKFLOWS:
        ui, api = build(name, info)
        (OUT / f"{name}.json").write_text(json.dumps(ui, indent=1) + "\n")
        (OUT / f"{name}.api.json").write_text(json.dumps(api, indent=1) + "\n")
        written += [f"workflows/{name}.json", f"workflows/{name}.api.json"]
    return written
