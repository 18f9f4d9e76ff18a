#!/usr/bin/env python3
"""Extract sampling-related facts from ComfyUI's bundled workflow templates.

ComfyUI ships its template library as the PyPI package
``comfyui-workflow-templates`` (ComfyUI 0.3.64 pins 0.1.95).  In that version
the UI-format workflow files (``{"nodes": [...], "links": [...], ...}``) live
directly in ``comfyui_workflow_templates/templates/`` next to ``index.json``
(plus translated ``index.<lang>.json`` files and ``.webp`` thumbnails).  Newer
releases split the files into sub-packages; pass ``--templates DIR`` (may be
repeated) to point the script at any folder of template ``.json`` files.

For every template the script records:

* name (file stem) and, when ``index.json`` lists it, its category, title,
  media type and the index's own ``models`` tags;
* sampling nodes (KSampler, KSamplerAdvanced, SamplerCustom,
  SamplerCustomAdvanced, any other ``*Sampler*`` node that is not a sampler
  selector), sampler selectors (KSamplerSelect, Sampler<Name>), guiders and
  sigma/scheduler nodes, with the guider/sampler/sigmas feeding each custom
  sampler traced through the links;
* diffusion-model loaders with file names, UNETLoader ``weight_dtype`` and
  fp8_scaled / fp8 / gguf flags; text-encoder loaders; VAE loaders and the
  VAE encode/decode node types;
* conditioning / model-patch nodes (ControlNet, ReferenceLatent, inpaint,
  area/mask, style model, model patches, Wan*ToVideo, LoRA, ModelSampling*,
  CFG tweaks, torch.compile, ...);
* a best-effort model family guessed from the loader file names
  (``FAMILY_TABLE`` below), falling back to the index's ``models`` tags;
* whether the template is API-only (paid API nodes, no local model).

Nodes inside subgraphs (``definitions.subgraphs[*].nodes``) are included.
Every node carries an ``active`` flag: False when it, or the subgraph
instance that contains it, is bypassed (mode 4) or muted (mode 2).  Template
authors often ship alternative paths (e.g. a 4-step LoRA variant) bypassed,
so the summary gives counts over all nodes and over active nodes only.

Usage::

    python tools/template_facts.py --out /tmp/template_facts.json
    python tools/template_facts.py --templates path/to/templates --out facts.json
    python tools/template_facts.py --index-only --out facts.json   # skip files not in index.json

Only the standard library is needed (plus the installed template package when
``--templates`` is not given).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.resources
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

# ---------------------------------------------------------------------------
# Node classification tables
# ---------------------------------------------------------------------------

#: Node types that run a sampling loop.
SAMPLING_NODES = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced")

#: Node types that only *choose* a sampler (they output a SAMPLER object).
SAMPLER_SELECT_RE = re.compile(r"^(KSamplerSelect|Sampler(?!Custom)\w+)$")

GUIDER_RE = re.compile(r"Guider")
SIGMA_RE = re.compile(r"(Scheduler$|Sigma)")

#: Loaders that produce the diffusion MODEL.  Core + common custom loaders.
MODEL_LOADER_RE = re.compile(
    r"^(CheckpointLoader\w*|ImageOnlyCheckpointLoader|unCLIPCheckpointLoader|"
    r"UNETLoader|UnetLoaderGGUF\w*|DiffusionModelLoader\w*|\w*ModelLoader(KJ)?)$"
)
#: Loaders named "*ModelLoader" that do not load a diffusion model.
NOT_DIFFUSION_LOADERS = {"UpscaleModelLoader", "StyleModelLoader", "DownloadAndLoadSAM2Model"}

TEXT_ENCODER_LOADER_RE = re.compile(r"^(CLIPLoader|DualCLIPLoader|TripleCLIPLoader|QuadrupleCLIPLoader)\w*$")
VAE_LOADER_RE = re.compile(r"^VAELoader\w*$")
VAE_CODEC_RE = re.compile(r"^VAE(Decode|Encode)\w*$")

#: Conditioning / model-patch groups: (label, regex on node type).
#: A node type may fall into several groups.
PATCH_GROUPS: list[tuple[str, re.Pattern[str]]] = [
    ("controlnet", re.compile(r"controlnet|T2IAdapter", re.I)),
    ("reference_latent", re.compile(r"^ReferenceLatent$|ReferenceLatentMethod")),
    ("inpaint_conditioning", re.compile(r"^InpaintModelConditioning$")),
    ("inpaint_other", re.compile(r"Inpaint(?!ModelConditioning)|^SetLatentNoiseMask$")),
    ("area_mask", re.compile(r"^ConditioningSet(Area\w*|Mask)$")),
    ("style_model", re.compile(r"^StyleModel\w*$|StyleReference")),
    ("model_patch", re.compile(r"^ModelPatchLoader$|^QwenImageDiffsynthControlnet$")),
    ("wan_to_video", re.compile(r"^Wan\w*ToVideo\w*$")),
    ("lora", re.compile(r"^LoraLoader\w*$")),
    ("model_sampling", re.compile(r"^ModelSampling\w*$")),
    ("cfg_tweak", re.compile(r"^(CFGNorm|CFGZeroStar|SkipLayerGuidance\w*|VideoLinearCFGGuidance|"
                             r"LatentApplyOperationCFG|PerpNeg\w*|RescaleCFG|FluxGuidance)$")),
    ("guider", GUIDER_RE),
    ("torch_compile", re.compile(r"TorchCompile")),
    ("cache", re.compile(r"(EasyCache|TeaCache|FirstBlockCache|\w*Cache)$")),
    ("gligen", re.compile(r"GLIGEN")),
    ("clip_vision", re.compile(r"^CLIPVision\w*$|^unCLIPConditioning$")),
    ("instruct_pix2pix", re.compile(r"InstructPixToPix")),
    ("differential_diffusion", re.compile(r"^DifferentialDiffusion$")),
    ("flux_kontext_local", re.compile(r"^FluxKontext(ImageScale|MultiReferenceLatentMethod)$")),
]

#: Paid API nodes (comfy_api_nodes).  Careful: FluxKontextImageScale and
#: FluxKontextMultiReferenceLatentMethod are local nodes and must not match.
API_NODE_RE = re.compile(
    r"^(OpenAI\w*|Kling\w*|Luma\w*|Minimax\w*|Moonvalley\w*|Pika\w*|Pixverse\w*|Recraft\w*|"
    r"Rodin3D\w*|Runway\w*|Stability\w*|Tripo\w*|Veo\w*|Vidu\w*|ByteDance\w*|Gemini\w*|"
    r"Ideogram\w*|FluxPro\w*|FluxKontext(Pro|Max)\w*|\w+Api)$"
)

#: Diffusion-model family guessed from a loader file name (lower-cased).
#: First match wins, so specific patterns come before general ones.
#: Columns: regex, family, modality.
FAMILY_TABLE: list[tuple[str, str, str]] = [
    (r"hunyuan3d|hunyuan_3d",                       "Hunyuan3D 2.x",     "3d"),
    (r"hunyuan_video|hunyuanvideo",                 "HunyuanVideo",      "video"),
    (r"wan2[._]2.*(ti2v|fun_\w+)_5b|wan2[._]2.*_5b", "Wan 2.2 5B",        "video"),
    (r"wan2[._]2|wan2_2",                           "Wan 2.2 14B",       "video"),
    (r"wan2[._]1.*1\.3b|wan2_1.*1\.3b",             "Wan 2.1 1.3B",      "video"),
    (r"wan2[._]1|wan2_1|wan_2\.1",                  "Wan 2.1 14B",       "video"),
    (r"humo",                                       "HuMo (Wan 2.1-based)", "video"),
    (r"ltx-?video|ltxv",                            "LTX-Video",         "video"),
    (r"mochi",                                      "Mochi",             "video"),
    (r"cosmos",                                     "Cosmos",            "video"),
    (r"^svd",                                       "SVD",               "video"),
    (r"stable_zero123",                             "Stable Zero123",    "3d"),
    (r"ace_step",                                   "ACE-Step",          "audio"),
    (r"stable[-_]audio",                            "Stable Audio",      "audio"),
    (r"chroma",                                     "Chroma",            "image"),
    (r"flux1?[-._].*kontext",                       "FLUX.1 Kontext",    "image"),
    (r"flux",                                       "FLUX.1",            "image"),
    (r"hidream",                                    "HiDream",           "image"),
    (r"qwen_image",                                 "Qwen-Image",        "image"),
    (r"omnigen2",                                   "OmniGen2",          "image"),
    (r"lumina|neta",                                "Lumina 2",          "image"),
    (r"sd3\.5|sd3_5",                               "SD3.5",             "image"),
    (r"sd3",                                        "SD3",               "image"),
    (r"sd_xl|sdxl",                                 "SDXL",              "image"),
    (r"v1-5|sd15|sd1\.5|sd-v1",                     "SD1.5",             "image"),
    (r"v2-1|512-inpainting|sd21|sd2\.",             "SD2.x",             "image"),
    (r"lotus",                                      "Lotus depth",       "image"),
]

#: Fallback when no loader file name matched: the index.json ``models`` tags.
INDEX_FAMILY_TABLE: dict[str, str] = {
    "SD1.5": "SD1.5", "SDXL": "SDXL", "SD3.5": "SD3.5", "Flux": "FLUX.1",
    "Wan2.1": "Wan 2.1", "Wan2.2": "Wan 2.2", "Qwen-Image": "Qwen-Image",
    "HiDream": "HiDream", "Chroma": "Chroma", "OmniGen": "OmniGen2",
    "LTXV": "LTX-Video", "Mochi": "Mochi", "Hunyuan Video": "HunyuanVideo",
    "Hunyuan3D": "Hunyuan3D 2.x", "NetaYume Lumina": "Lumina 2", "SVD": "SVD",
    "ACE-Step": "ACE-Step", "Stable Audio": "Stable Audio", "HuMo": "HuMo (Wan 2.1-based)",
    "Stable Zero123": "Stable Zero123",
}

#: Index category titles whose templates are paid-API workflows.
API_CATEGORY = "CLOSED SOURCE MODELS"

#: Output nodes that mean the template produces a video.
VIDEO_OUTPUT_RE = re.compile(r"^(SaveVideo|CreateVideo|SaveAnimatedWEBP|SaveAnimatedPNG|SaveWEBM|VHS_VideoCombine)$")

INACTIVE_MODES = {2, 4}  # 2 = never (muted), 4 = bypass

# ---------------------------------------------------------------------------
# Locating and loading templates
# ---------------------------------------------------------------------------


def default_template_dirs() -> list[Path]:
    """Return the template folder(s) of the installed comfyui_workflow_templates package.

    Tries the package's own ``get_templates_path()`` helper, then
    ``importlib.resources.files(pkg) / "templates"``, for the monolithic package
    and for the split sub-packages of newer releases.
    """
    dirs: list[Path] = []
    for pkg in ("comfyui_workflow_templates", "comfyui_workflow_templates_core"):
        try:
            mod = importlib.import_module(pkg)
        except ImportError:
            continue
        candidates = []
        getter = getattr(mod, "get_templates_path", None)
        if callable(getter):
            candidates.append(getter())
        candidates.append(importlib.resources.files(pkg) / "templates")
        candidates.append(Path(mod.__file__).parent / "templates")
        for cand in candidates:
            if cand and Path(str(cand)).is_dir():
                path = Path(str(cand)).resolve()
                if path not in dirs:
                    dirs.append(path)
                break
    return dirs


def load_index(dirs: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """Read ``index.json`` (English only) from the template folders.

    Returns a mapping template name -> index metadata (category, title, ...).
    """
    meta: dict[str, dict[str, Any]] = {}
    for d in dirs:
        index_file = d / "index.json"
        if not index_file.is_file():
            continue
        for cat in json.loads(index_file.read_text(encoding="utf-8")):
            for tpl in cat.get("templates", []):
                meta[tpl["name"]] = {
                    "category": cat.get("category") or cat.get("title"),
                    "category_title": cat.get("title"),
                    "category_type": cat.get("type"),
                    "title": tpl.get("title"),
                    "media_type": tpl.get("mediaType"),
                    "index_models": tpl.get("models", []),
                    "vram": tpl.get("vram"),
                }
    return meta


def iter_template_files(dirs: Iterable[Path]) -> Iterator[Path]:
    """Yield every workflow ``.json`` file, skipping index/schema files."""
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            if path.name.startswith("index"):
                continue
            yield path


# ---------------------------------------------------------------------------
# Graph walking
# ---------------------------------------------------------------------------


def normalise_link(link: Any) -> dict[str, Any] | None:
    """Return a link as a dict (root graphs store lists, subgraphs store dicts)."""
    if isinstance(link, dict):
        return link
    if isinstance(link, list) and len(link) >= 5:
        return {"id": link[0], "origin_id": link[1], "origin_slot": link[2],
                "target_id": link[3], "target_slot": link[4]}
    return None


def collect_graphs(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the root graph and every subgraph with an effective ``active`` flag.

    Each entry: ``{"name", "nodes", "links", "active"}``.  A subgraph is active
    if at least one active, non-bypassed instance of it exists in an active
    graph (nested subgraphs are resolved recursively).
    """
    subgraphs = {sg["id"]: sg for sg in (workflow.get("definitions") or {}).get("subgraphs") or []}
    active_defs: set[str] = set()

    def visit(nodes: list[dict[str, Any]], graph_active: bool, stack: tuple[str, ...]) -> None:
        for node in nodes:
            sg = subgraphs.get(node.get("type"))
            if sg is None or sg["id"] in stack:
                continue
            node_active = graph_active and node.get("mode", 0) not in INACTIVE_MODES
            if node_active:
                active_defs.add(sg["id"])
            visit(sg.get("nodes", []), node_active, stack + (sg["id"],))

    visit(workflow.get("nodes", []), True, ())
    graphs = [{"name": "root", "nodes": workflow.get("nodes", []),
               "links": workflow.get("links", []), "active": True}]
    for sg_id, sg in subgraphs.items():
        graphs.append({"name": sg.get("name") or sg_id, "nodes": sg.get("nodes", []),
                       "links": sg.get("links", []), "active": sg_id in active_defs})
    return graphs


def trace_input(node: dict[str, Any], input_name: str, graph: dict[str, Any]) -> str | None:
    """Return the type of the node feeding ``input_name`` of ``node``.

    Follows Reroute nodes; returns ``"<subgraph input>"`` when the link comes
    from the enclosing subgraph's input, or None when unconnected.
    """
    by_id = {n.get("id"): n for n in graph["nodes"]}
    links = {}
    for raw in graph["links"] or []:
        link = normalise_link(raw)
        if link:
            links[link["id"]] = link
    link_id = next((i.get("link") for i in node.get("inputs") or [] if i.get("name") == input_name), None)
    for _ in range(16):  # bounded Reroute chain
        link = links.get(link_id)
        if link is None:
            return None
        origin = by_id.get(link["origin_id"])
        if origin is None:
            return "<subgraph input>" if link["origin_id"] == -10 else None
        if origin.get("type") != "Reroute":
            return origin.get("type")
        link_id = next((i.get("link") for i in origin.get("inputs") or []), None)
    return None


def widget_list(node: dict[str, Any]) -> list[Any]:
    """Return a node's widgets_values as a list (some nodes store a dict)."""
    values = node.get("widgets_values")
    if isinstance(values, dict):
        return list(values.values())
    return list(values or [])


# ---------------------------------------------------------------------------
# Per-node classification
# ---------------------------------------------------------------------------


def is_sampling_node(node_type: str) -> bool:
    """True for nodes that run a sampling loop (not selectors)."""
    if node_type in SAMPLING_NODES:
        return True
    return "Sampler" in node_type and not SAMPLER_SELECT_RE.match(node_type)


def sampler_settings(node: dict[str, Any]) -> dict[str, Any]:
    """Parse the well-known widget layouts of the core sampling nodes."""
    w = widget_list(node)
    t = node.get("type")
    try:
        if t == "KSampler":  # seed, control, steps, cfg, sampler, scheduler, denoise
            return {"steps": w[2], "cfg": w[3], "sampler_name": w[4], "scheduler": w[5], "denoise": w[6]}
        if t == "KSamplerAdvanced":  # add_noise, seed, control, steps, cfg, sampler, scheduler, start, end, ret
            return {"steps": w[3], "cfg": w[4], "sampler_name": w[5], "scheduler": w[6],
                    "start_at_step": w[7], "end_at_step": w[8]}
        if t == "SamplerCustom":  # add_noise, seed, control, cfg
            return {"cfg": w[3]}
    except IndexError:
        pass
    return {}


def model_file_flags(filename: str, weight_dtype: str | None, loader_type: str) -> dict[str, bool]:
    """Precision flags for a diffusion-model file."""
    low = filename.lower()
    scaled = "fp8_scaled" in low or bool(re.search(r"fp8_e4m3fn_scaled|fp8_e5m2_scaled", low))
    return {
        "fp8_scaled": scaled,
        "fp8_in_name": "fp8" in low and not scaled,
        "fp8_weight_dtype": bool(weight_dtype and weight_dtype.startswith("fp8")),
        "gguf": low.endswith(".gguf") or "gguf" in loader_type.lower(),
    }


def guess_family(filename: str) -> tuple[str, str]:
    """Return (family, modality) for a model file name, or ("unknown", "")."""
    low = filename.lower()
    for pattern, family, modality in FAMILY_TABLE:
        if re.search(pattern, low):
            return family, modality
    return "unknown", ""


# ---------------------------------------------------------------------------
# Per-template analysis
# ---------------------------------------------------------------------------


def analyse_template(path: Path, index_meta: dict[str, Any] | None) -> dict[str, Any]:
    """Extract all facts for one template file."""
    workflow = json.loads(path.read_text(encoding="utf-8"))
    graphs = collect_graphs(workflow)
    subgraph_ids = {sg["id"] for sg in (workflow.get("definitions") or {}).get("subgraphs") or []}

    nodes: list[tuple[dict[str, Any], dict[str, Any], bool]] = []
    for g in graphs:
        for n in g["nodes"]:
            if n.get("type") in subgraph_ids:
                continue  # the instance itself; its contents are walked separately
            active = g["active"] and n.get("mode", 0) not in INACTIVE_MODES
            nodes.append((n, g, active))

    def entry(n: dict[str, Any], g: dict[str, Any], active: bool) -> dict[str, Any]:
        return {"type": n.get("type"), "id": n.get("id"), "graph": g["name"], "active": active}

    samplers, selectors, guiders, sigmas = [], [], [], []
    model_loaders, text_encoders, vae_loaders = [], [], []
    vae_codecs: set[str] = set()
    patches: dict[str, set[str]] = collections.defaultdict(set)
    patches_active: dict[str, set[str]] = collections.defaultdict(set)
    api_nodes: set[str] = set()
    video_out = False

    for n, g, active in nodes:
        t = n.get("type") or ""
        if is_sampling_node(t):
            e = entry(n, g, active)
            e["settings"] = sampler_settings(n)
            if t == "SamplerCustomAdvanced":
                e["guider"] = trace_input(n, "guider", g)
            if t in ("SamplerCustom", "SamplerCustomAdvanced"):
                e["sampler"] = trace_input(n, "sampler", g)
                e["sigmas"] = trace_input(n, "sigmas", g)
            samplers.append(e)
        elif SAMPLER_SELECT_RE.match(t):
            selectors.append(entry(n, g, active) | {"widgets": widget_list(n)})
        if GUIDER_RE.search(t):
            guiders.append(entry(n, g, active))
        if SIGMA_RE.search(t):
            sigmas.append(entry(n, g, active) | {"widgets": widget_list(n)})
        if MODEL_LOADER_RE.match(t) and t not in NOT_DIFFUSION_LOADERS:
            w = widget_list(n)
            fname = str(w[0]) if w else ""
            dtype = str(w[1]) if t == "UNETLoader" and len(w) > 1 else None
            family, modality = guess_family(fname)
            model_loaders.append(entry(n, g, active) | {
                "file": fname, "weight_dtype": dtype, "family": family, "modality": modality,
                **model_file_flags(fname, dtype, t)})
        if TEXT_ENCODER_LOADER_RE.match(t):
            w = widget_list(n)
            files = [str(x) for x in w if isinstance(x, str) and re.search(r"\.(safetensors|gguf|bin|pt)$", x)]
            kind = next((str(x) for x in w if isinstance(x, str) and x not in files and x != "default"), None)
            text_encoders.append(entry(n, g, active) | {"files": files, "clip_type": kind})
        if VAE_LOADER_RE.match(t):
            w = widget_list(n)
            vae_loaders.append(entry(n, g, active) | {"file": str(w[0]) if w else ""})
        if VAE_CODEC_RE.match(t):
            vae_codecs.add(t)
        for label, rx in PATCH_GROUPS:
            if rx.search(t) and not API_NODE_RE.match(t):
                patches[label].add(t)
                if active:
                    patches_active[label].add(t)
        if API_NODE_RE.match(t):
            api_nodes.add(t)
        if VIDEO_OUTPUT_RE.match(t) and active:
            video_out = True

    has_local_model = bool(model_loaders)
    api_only = bool(api_nodes) and not has_local_model and not samplers

    # Family: from active diffusion-model loaders first, then any loader, then
    # (for local templates only) the index's model tags.
    fams = [m["family"] for m in model_loaders if m["active"] and m["family"] != "unknown"] or \
           [m["family"] for m in model_loaders if m["family"] != "unknown"]
    family_source = "loader_filename"
    if not fams and api_only:
        fams, family_source = ["API"], "api_nodes"
    elif not fams and index_meta:
        fams = [INDEX_FAMILY_TABLE[m] for m in index_meta.get("index_models", []) if m in INDEX_FAMILY_TABLE]
        family_source = "index_models" if fams else "none"
    elif not fams:
        family_source = "none"
    families = list(dict.fromkeys(fams))
    category = (index_meta or {}).get("category")

    return {
        "name": path.stem,
        "file": path.name,
        "in_index": index_meta is not None,
        **{k: (index_meta or {}).get(k) for k in
           ("category", "category_title", "category_type", "title", "media_type", "index_models", "vram")},
        "has_subgraphs": len(graphs) > 1,
        "samplers": samplers,
        "sampler_types": sorted({s["type"] for s in samplers}),
        "active_sampler_types": sorted({s["type"] for s in samplers if s["active"]}),
        "sampler_selectors": selectors,
        "guiders": guiders,
        "sigma_nodes": sigmas,
        "model_loaders": model_loaders,
        "text_encoder_loaders": text_encoders,
        "vae_loaders": vae_loaders,
        "vae_codec_types": sorted(vae_codecs),
        "patch_nodes": {k: sorted(v) for k, v in sorted(patches.items())},
        "patch_nodes_active": {k: sorted(v) for k, v in sorted(patches_active.items())},
        "families": families or ["unknown"],
        "family_source": family_source,
        "unknown_model_files": sorted({m["file"] for m in model_loaders if m["family"] == "unknown"}),
        "api_nodes": sorted(api_nodes),
        "api_only": api_only,
        "api_category": category == API_CATEGORY,
        "video_output": video_out,
    }


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------


def build_summary(templates: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate counts over all templates (``all`` = any node, ``active`` = non-bypassed)."""
    def names(pred) -> list[str]:
        return sorted(t["name"] for t in templates if pred(t))

    def any_loader(t, key, active_only=False) -> bool:
        return any(m[key] for m in t["model_loaders"] if m["active"] or not active_only)

    sampling = [t for t in templates if t["samplers"]]
    sampler_type_counts = collections.Counter(s for t in templates for s in t["sampler_types"])
    sampler_type_counts_active = collections.Counter(s for t in templates for s in t["active_sampler_types"])
    sampler_node_instances = collections.Counter(s["type"] for t in templates for s in t["samplers"])
    family_counts = collections.Counter(f for t in sampling for f in t["families"])

    custom = []
    for t in templates:
        cs = [s for s in t["samplers"] if s["type"] in ("SamplerCustom", "SamplerCustomAdvanced")]
        if cs:
            custom.append({
                "name": t["name"], "families": t["families"],
                "nodes": sorted({s["type"] + ("" if s["graph"] == "root" else f" [subgraph {s['graph']}]")
                                 for s in cs}),
                "guider": sorted({s.get("guider") or "built-in CFG (SamplerCustom)" for s in cs}),
                "sigmas": sorted({str(s.get("sigmas")) for s in cs}),
                "also_ksampler": any(s["type"].startswith("KSampler") for s in t["samplers"]),
            })

    def patch(label, active_only=False):
        key = "patch_nodes_active" if active_only else "patch_nodes"
        return names(lambda t: label in t[key])

    return {
        "total_templates": len(templates),
        "not_in_index": names(lambda t: not t["in_index"]),
        "with_sampler_node": len(sampling),
        "with_active_sampler_node": sum(1 for t in templates if t["active_sampler_types"]),
        "with_sampler_node_in_index": sum(1 for t in sampling if t["in_index"]),
        "templates_per_sampler_type": dict(sampler_type_counts.most_common()),
        "templates_per_sampler_type_active": dict(sampler_type_counts_active.most_common()),
        "sampler_node_instances": dict(sampler_node_instances.most_common()),
        "sampling_templates_per_family": dict(family_counts.most_common()),
        "family_from_index_fallback": names(lambda t: t["samplers"] and t["family_source"] == "index_models"),
        "unknown_model_files": sorted({f for t in templates for f in t["unknown_model_files"]}),
        "samplercustom_templates": custom,
        "fp8_scaled": names(lambda t: any_loader(t, "fp8_scaled")),
        "fp8_scaled_active": names(lambda t: any_loader(t, "fp8_scaled", True)),
        "fp8_in_name_not_scaled": names(lambda t: any_loader(t, "fp8_in_name")),
        "fp8_in_name_not_scaled_active": names(lambda t: any_loader(t, "fp8_in_name", True)),
        "fp8_weight_dtype": names(lambda t: any_loader(t, "fp8_weight_dtype")),
        "fp8_any": names(lambda t: any(any_loader(t, k) for k in ("fp8_scaled", "fp8_in_name", "fp8_weight_dtype"))),
        "gguf": names(lambda t: any_loader(t, "gguf")),
        "controlnet": patch("controlnet"),
        "controlnet_loader": names(lambda t: "ControlNetLoader" in t["patch_nodes"].get("controlnet", [])),
        "controlnet_active": patch("controlnet", True),
        "reference_latent": patch("reference_latent"),
        "reference_latent_active": patch("reference_latent", True),
        "inpaint_conditioning": patch("inpaint_conditioning"),
        "inpaint_other": patch("inpaint_other"),
        "area_mask": patch("area_mask"),
        "style_model": patch("style_model"),
        "style_model_apply": names(lambda t: "StyleModelApply" in t["patch_nodes"].get("style_model", [])),
        "model_patch_loader": names(lambda t: "ModelPatchLoader" in t["patch_nodes"].get("model_patch", [])),
        "wan_to_video_types": sorted({x for t in templates for x in t["patch_nodes"].get("wan_to_video", [])}),
        "api_only": len(names(lambda t: t["api_only"])),
        "api_category": len(names(lambda t: t["api_category"])),
        "api_only_mismatch_vs_category": names(lambda t: t["api_only"] != t["api_category"]),
        "video": {
            "index_category_video_local": len(names(lambda t: t["category_title"] == "Video")),
            "index_category_video_api": len(names(lambda t: t["category_title"] == "Video API")),
            "sampling_with_video_output": len(names(lambda t: t["samplers"] and t["video_output"])),
            "sampling_with_video_output_names": names(lambda t: t["samplers"] and t["video_output"]),
        },
    }


def print_summary(s: dict[str, Any]) -> None:
    """Print a compact human-readable version of the summary."""
    def line(label, items):
        items = list(items)
        print(f"{label} ({len(items)}): {', '.join(items)}")

    print(f"templates: {s['total_templates']}  (not in index.json: {s['not_in_index']})")
    print(f"with a sampling node: {s['with_sampler_node']}  (active/non-bypassed: "
          f"{s['with_active_sampler_node']}; listed in index: {s['with_sampler_node_in_index']})")
    print("templates per sampler type:", s["templates_per_sampler_type"])
    print("  active only:", s["templates_per_sampler_type_active"])
    print("  node instances:", s["sampler_node_instances"])
    print("sampling templates per family:", s["sampling_templates_per_family"])
    print("  family taken from index tags:", s["family_from_index_fallback"])
    print("  unknown model files:", s["unknown_model_files"])
    print(f"SamplerCustom/SamplerCustomAdvanced ({len(s['samplercustom_templates'])}):")
    for c in s["samplercustom_templates"]:
        extra = " (+KSampler)" if c["also_ksampler"] else ""
        print(f"  {c['name']:45s} {'/'.join(c['families']):18s} {'+'.join(c['nodes'])}{extra}"
              f"  guider={','.join(c['guider'])} sigmas={','.join(c['sigmas'])}")
    line("fp8_scaled model file", s["fp8_scaled"])
    print(f"  fp8_scaled on an active loader: {len(s['fp8_scaled_active'])}")
    line("fp8 in model file name (not scaled)", s["fp8_in_name_not_scaled"])
    print(f"  fp8 (not scaled) on an active loader: {len(s['fp8_in_name_not_scaled_active'])}")
    line("UNETLoader weight_dtype fp8*", s["fp8_weight_dtype"])
    print(f"any fp8 diffusion model: {len(s['fp8_any'])}")
    line("GGUF", s["gguf"])
    line("ControlNet (any controlnet-type node)", s["controlnet"])
    line("  of which with ControlNetLoader", s["controlnet_loader"])
    print(f"  ControlNet active: {len(s['controlnet_active'])}")
    line("ReferenceLatent", s["reference_latent"])
    print(f"  ReferenceLatent active: {len(s['reference_latent_active'])}")
    line("InpaintModelConditioning", s["inpaint_conditioning"])
    line("other inpaint nodes", s["inpaint_other"])
    line("ConditioningSetArea*/Mask", s["area_mask"])
    line("StyleModelApply", s["style_model_apply"])
    line("ModelPatchLoader", s["model_patch_loader"])
    print("Wan*ToVideo types:", s["wan_to_video_types"])
    print(f"API-only: {s['api_only']} (index 'CLOSED SOURCE MODELS': {s['api_category']}; "
          f"mismatches: {s['api_only_mismatch_vs_category']})")
    v = s["video"]
    print(f"video: index Video={v['index_category_video_local']}, Video API={v['index_category_video_api']}, "
          f"sampling templates with a video output={v['sampling_with_video_output']}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--templates", action="append", type=Path,
                    help="template folder (repeatable); default: the installed package's folder")
    ap.add_argument("--out", type=Path, required=True, help="write the JSON facts here")
    ap.add_argument("--index-only", action="store_true",
                    help="skip .json files that index.json does not list (0.1.95 ships two stray copies)")
    ap.add_argument("--quiet", action="store_true", help="do not print the summary")
    args = ap.parse_args(argv)

    dirs = args.templates or default_template_dirs()
    if not dirs:
        ap.error("comfyui_workflow_templates is not installed; pass --templates DIR")
    index = load_index(dirs)
    templates = [analyse_template(p, index.get(p.stem)) for p in iter_template_files(dirs)
                 if not (args.index_only and index and p.stem not in index)]
    summary = build_summary(templates)
    package_version = None
    try:
        from importlib.metadata import version
        package_version = version("comfyui-workflow-templates")
    except Exception:  # not installed / --templates only
        pass
    args.out.write_text(json.dumps({
        "package_version": package_version,
        "template_dirs": [str(d) for d in dirs],
        "summary": summary,
        "templates": templates,
    }, indent=1, ensure_ascii=False), encoding="utf-8")
    if not args.quiet:
        print_summary(summary)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
