"""Shared workflows: they parse, use only known node types, link outputs to inputs of the same type, and the
UI form (what users drag in) converts to exactly the API form (what /prompt takes)."""

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "comfyui"))
from workflow_tools import (  # noqa: E402
    FRONTEND_ONLY, VIRTUAL, min_node_size, node_box, node_info, overlaps, ui_to_api, ui_to_api_graph, widget_text_width,
)
import template_workflows  # noqa: E402

NAMES = ["sdxl_otil_txt2img", "flux_distributed_decode", "wan_video_row_decode", "topology_probe", "vae_benchmark"]
#: every UI-format workflow shipped, whoever added it
SHIPPED = sorted(p.name[: -len(".json")] for p in (ROOT / "workflows").glob("*.json") if not p.name.endswith(".api.json"))
# video decodes: stock loader -> PatchRay decode, with the file users download (ComfyUI's own template names) and its folder
VIDEO_DECODES = {
    "wan22_video_decode": ("wan2.2_vae.safetensors", "models/vae/"),
    "hunyuan_video_decode": ("hunyuan_video_vae_bf16.safetensors", "models/vae/"),
    "ltxv_video_decode": ("ltx-video-2b-v0.9.safetensors", "models/checkpoints/"),
}
NAMES += list(VIDEO_DECODES)
MODEL_FILES = {"sd_xl_base_1.0.safetensors", "sdxl_vae.safetensors", "ae.safetensors", "wan_2.1_vae.safetensors"}
MODEL_FILES |= {f for f, _ in VIDEO_DECODES.values()}
# the Distributed KSampler on DiTs
NAMES += ["flux_txt2img_distributed", "wan21_txt2video_distributed", "wan22_txt2video_distributed",
          "wan22_14b_txt2video_distributed"]
MODEL_FILES |= {"wan2.2_vae.safetensors"}
# ComfyUI's own templates with the PatchRay nodes added (tests/comfyui/template_workflows.py), with the templates' files
TEMPLATE_NAMES = list(template_workflows.TEMPLATE_WORKFLOWS)
NAMES += TEMPLATE_NAMES
MODEL_FILES |= {"flux1-dev-fp8.safetensors", "sd_xl_refiner_1.0.safetensors", "qwen_image_vae.safetensors"}


@pytest.fixture(scope="module")
def info():
    return node_info()


def _load(name):
    ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
    api = json.loads((ROOT / "workflows" / f"{name}.api.json").read_text())
    return ui, api


def _needs_types(ui, info):
    """Skip (not fail) where the recorded stock node table lacks a node type the workflow uses: re-record it with
    tests/comfyui/record_stock_nodes.py from a ComfyUI that has it."""
    unknown = sorted({n["type"] for n in ui["nodes"]} - set(info) - FRONTEND_ONLY)
    if unknown:
        pytest.skip(f"tests/fixtures/comfy_stock_nodes.json has no record of {unknown}: re-record it "
                    "(tests/comfyui/record_stock_nodes.py)")


def _to_api(name, ui, info):
    """The frontend's conversion: the template workflows have bypassed and primitive nodes, which ui_to_api leaves aside."""
    return ui_to_api_graph(ui, info) if name in TEMPLATE_NAMES else ui_to_api(ui, info)


def _added(ui):
    """Ids of the nodes a template workflow adds to its template (given ids after the template's last)."""
    first = min(n["id"] for n in ui["nodes"] if n["type"].startswith("PatchRay"))
    return {n["id"] for n in ui["nodes"] if n["id"] >= first}


def _template(name):
    try:
        return template_workflows.load_template(template_workflows.TEMPLATE_WORKFLOWS[name].template)
    except template_workflows.TemplatesMissing as exc:
        pytest.skip(str(exc))


def test_every_workflow_has_both_forms():
    files = {p.name for p in (ROOT / "workflows").glob("*.json")}
    assert files == {f"{n}.json" for n in NAMES} | {f"{n}.api.json" for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_ui_form_is_consistent(name, info):
    ui, _ = _load(name)
    _needs_types(ui, info)
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_node_id"] >= max(nodes)
    assert ui["last_link_id"] >= max(l[0] for l in ui["links"]) and len({l[0] for l in ui["links"]}) == len(ui["links"])
    assert any(n["type"] in VIRTUAL for n in ui["nodes"]), "a note explains the workflow"
    for n in ui["nodes"]:
        assert n["type"] in info or n["type"] in FRONTEND_ONLY, f"unknown node type {n['type']}"
    assert any(info[n["type"]]["output_node"] for n in ui["nodes"] if n["type"] in info), "nothing would execute"
    for link_id, src, slot, dst, dst_slot, ltype in ui["links"]:
        # a primitive node's output takes the type of the widget it feeds
        src_type = info[nodes[src]["type"]]["outputs"][slot] if nodes[src]["type"] in info else nodes[src]["outputs"][slot]["type"]
        target = nodes[dst]["inputs"][dst_slot]
        assert target["link"] == link_id
        declared = {i["name"]: i["type"] for i in info[nodes[dst]["type"]]["inputs"]}
        assert ltype == src_type == nodes[src]["outputs"][slot]["type"]
        assert declared[target["name"]] in (src_type, "*"), f"{name}: {src_type} wired into {nodes[dst]['type']}.{target['name']}"
        assert link_id in nodes[src]["outputs"][slot]["links"]
    listed = sorted(l for n in ui["nodes"] for o in n.get("outputs", []) for l in o.get("links") or [])
    assert listed == sorted(l[0] for l in ui["links"])


@pytest.mark.parametrize("name", NAMES)
def test_api_form_matches_the_ui_form(name, info):
    ui, api = _load(name)
    _needs_types(ui, info)
    converted = _to_api(name, ui, info)
    assert {k: (v["class_type"], v["inputs"]) for k, v in converted.items()} == {
        k: (v["class_type"], v["inputs"]) for k, v in api.items()
    }


@pytest.mark.parametrize("name", NAMES)
def test_api_form_is_complete(name, info):
    ui, api = _load(name)
    _needs_types(ui, info)
    for nid, node in api.items():
        spec = info[node["class_type"]]
        for inp in spec["inputs"]:
            if not inp["optional"]:
                assert inp["name"] in node["inputs"], f"{name}: node {nid} lacks {inp['name']}"
            value = node["inputs"].get(inp["name"])
            if isinstance(value, list):
                src = api[value[0]]
                assert info[src["class_type"]]["outputs"][value[1]] in (inp["type"], "*") or inp["type"] == "*"
            elif "options" in inp and value is not None:
                assert value in inp["options"], f"{name}: {node['class_type']}.{inp['name']}={value!r}"
        for key in ("vae_name", "ckpt_name"):
            if key in node["inputs"]:
                assert node["inputs"][key] in MODEL_FILES


@pytest.mark.parametrize("name", SHIPPED)
def test_nothing_overlaps_when_the_workflow_opens(name, info):
    """Every node (title bar included) keeps clear of every other, notes included, at sizes that show all its widgets
    and panels: the frontend only grows a node that is smaller than it needs, which would push it over a neighbour."""
    ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
    _needs_types(ui, info)
    api = _to_api(name, ui, info)
    if name in TEMPLATE_NAMES:
        # a template's own nodes keep the template's places and sizes (the template's author chose them; the builder
        # checks that the columns it opens add no overlap among them): the nodes added must keep clear of everything
        added = _added(ui)
        assert [p for p in overlaps(ui, margin=10) if added & set(p)] == [], f"{name}: overlapping nodes (ids)"
        ui = dict(ui, nodes=[n for n in ui["nodes"] if n["id"] in added])
    else:
        assert overlaps(ui, margin=10) == [], f"{name}: overlapping nodes (ids)"
    for n in ui["nodes"]:
        need_w, need_h = min_node_size(info, n["type"])
        assert n["size"][0] >= need_w and n["size"][1] >= need_h, f"{name}: node {n['id']} ({n['type']}) is {n['size']}, needs {need_w}x{need_h}"
        # wide enough that no widget's label is cut to fit its value (a file name, a prefix)
        text_w = widget_text_width(info, n["type"], api.get(str(n["id"]), {}).get("inputs", {}))
        assert n["size"][0] >= text_w, f"{name}: node {n['id']} ({n['type']}) is {n['size'][0]} wide, its widgets' labels and values need {text_w}"


def test_the_overlap_check_sees_a_title_bar_under_a_node():
    a = {"id": 1, "pos": [0, 100], "size": [300, 200]}
    b = {"id": 2, "pos": [0, 340], "size": [300, 100]}  # its badges start at 290, its title bar at 310: inside a's body
    assert overlaps({"nodes": [a, b]}) == [(1, 2)]
    b["pos"] = [0, 360]
    assert overlaps({"nodes": [a, b]}) == [] and overlaps({"nodes": [a, b]}, margin=20) == [(1, 2)]


@pytest.mark.parametrize("name", list(VIDEO_DECODES))
def test_video_decode_workflows_load_the_vae_with_a_stock_loader_and_say_where_the_file_goes(name):
    ui, api = _load(name)
    filename, folder = VIDEO_DECODES[name]
    loaders = [n for n in api.values() if n["class_type"] in ("VAELoader", "CheckpointLoaderSimple")]
    assert [n["inputs"].get("vae_name", n["inputs"].get("ckpt_name")) for n in loaders] == [filename]
    decode = [n for n in api.values() if n["class_type"] == "PatchRayVAEDecode"]
    assert len(decode) == 1
    vae_src = api[decode[0]["inputs"]["vae"][0]]
    assert vae_src is loaders[0]
    note = next(n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "MarkdownNote")
    assert filename in note and folder in note and "https://huggingface.co/" in note


@pytest.mark.parametrize("name", NAMES)
def test_the_builder_writes_the_shipped_workflow(name, info):
    """tests/comfyui/build_workflows.py is where a workflow is changed: what it writes is what ships (a note edited in
    the shipped file only would be lost at the next regeneration)."""
    import build_workflows

    if name in TEMPLATE_NAMES:
        _needs_types(_template(name), info)
        ui, api = template_workflows.build(name, info)
    else:
        ui, api = build_workflows.build(name, build_workflows.WORKFLOWS[name](), info)
    shipped_ui, shipped_api = _load(name)
    assert json.loads(json.dumps(api)) == shipped_api
    assert json.loads(json.dumps(ui)) == shipped_ui


def test_the_dit_sampler_notes_name_every_sequence_attention_mode():
    from patchray.nodes.bridge.sampling_options import ATTENTION_NAMES

    for name in ("flux_txt2img_distributed", "wan21_txt2video_distributed", "wan22_txt2video_distributed",
                 "wan22_14b_txt2video_distributed"):
        ui, _ = _load(name)
        note = next(n for n in ui["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
        for mode in ATTENTION_NAMES:
            assert f"*{mode}*" in note, (name, mode)


def test_the_wan22_14b_workflow_chains_its_two_experts_like_the_stock_template():
    """High-noise expert: noise added, steps 0-9 of 20, leftover noise returned; low-noise expert: no noise added,
    steps 10 to the end on the first one's latent, denoised fully. Each expert loaded by its own loader."""
    _, api = _load("wan22_14b_txt2video_distributed")
    samplers = [n for n in api.values() if n["class_type"] == "PatchRayKSamplerAdvanced"]
    assert len(samplers) == 2
    first, second = sorted(samplers, key=lambda n: n["inputs"]["start_at_step"])
    f, g = first["inputs"], second["inputs"]
    assert (f["add_noise"], f["start_at_step"], f["end_at_step"], f["return_with_leftover_noise"]) == ("enable", 0, 10, "enable")
    assert (g["add_noise"], g["start_at_step"], g["return_with_leftover_noise"]) == ("disable", 10, "disable")
    assert g["end_at_step"] >= g["steps"] == f["steps"] == 20
    first_id = next(k for k, n in api.items() if n is first)
    assert g["latent_image"] == [first_id, 0]

    def unet(inputs):  # ModelSamplingSD3 -> UNETLoader
        return api[api[inputs["model"][0]]["inputs"]["model"][0]]["inputs"]["unet_name"]

    assert "high_noise" in unet(f) and "low_noise" in unet(g)



# ------------------------------------------------------------------- ComfyUI's own templates with the PatchRay nodes


def _remove_added(ui):
    """The workflow with the nodes it added deleted the way ComfyUI deletes them ("Keep all links when deleting nodes",
    on by default): what a Parallel Model / Parallel VAE fed is fed by what fed it."""
    ui = copy.deepcopy(ui)
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {l[0]: l for l in ui["links"]}
    added = _added(ui)
    for nid in sorted(added):
        n = nodes[nid]
        if n["type"] in ("PatchRayParallelModel", "PatchRayParallelVAE"):
            _, src, slot = links[n["inputs"][0]["link"]][:3]
            for lid in n["outputs"][0]["links"]:
                links[lid][1], links[lid][2] = src, slot
                nodes[src]["outputs"][slot]["links"].append(lid)
    gone = {l[0] for l in ui["links"] if l[1] in added or l[3] in added}
    ui["links"] = [l for l in ui["links"] if l[0] not in gone]
    ui["nodes"] = [n for n in ui["nodes"] if n["id"] not in added]
    for n in ui["nodes"]:
        for o in n.get("outputs") or []:
            o["links"] = sorted(x for x in o.get("links") or [] if x not in gone)
    return ui


def _seeds_as_in(node, info):
    """``node``'s widget values with every "control after generate" value read as the template's (the builder fixes them)."""
    values, pos = list(node.get("widgets_values") or []), 0
    for w in (i for i in info.get(node["type"], {"inputs": []})["inputs"] if i["widget"]):
        if w["control_after_generate"] and pos + 1 < len(values):
            values[pos + 1] = "<control>"
        pos += 1 + int(w["control_after_generate"]) + int(w["upload"])
    return values


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_without_the_patchray_nodes_a_template_workflow_is_its_template(name, info):
    """Deleting the added nodes gives the template back: the same prompt, and in the UI form the same nodes (sizes,
    titles, colours, modes, widget values but the seeds' control), links and groups, at the template's places (or
    moved right by a column the recipe opened)."""
    template = _template(name)
    _needs_types(template, info)
    ui, _ = _load(name)
    stripped = _remove_added(ui)
    assert ui_to_api_graph(stripped, info) == ui_to_api_graph(template, info)
    assert sorted(stripped["links"]) == sorted(template["links"])
    recipe = template_workflows.TEMPLATE_WORKFLOWS[name]
    shifts = {0} | {width for _x, width, _y0, _y1 in recipe.columns}
    mine, theirs = {n["id"]: n for n in stripped["nodes"]}, {n["id"]: n for n in template["nodes"]}
    assert mine.keys() == theirs.keys()

    def same(n):
        out = {k: v for k, v in n.items() if k not in ("pos", "widgets_values", "outputs")}
        return dict(out, widgets=_seeds_as_in(n, info), outputs=[dict(o, links=sorted(o.get("links") or [])) for o in n.get("outputs") or []])

    for nid, t in theirs.items():
        m = mine[nid]
        assert same(m) == same(t), nid
        assert m["pos"][1] == t["pos"][1] and m["pos"][0] - t["pos"][0] in shifts, (nid, m["pos"], t["pos"])
        if m["pos"][0] != t["pos"][0]:  # only what is right of an opened column moved
            assert any(t["pos"][0] >= x and y0 <= t["pos"][1] < y1 for x, _w, y0, y1 in recipe.columns), nid
    assert [g["title"] for g in stripped["groups"]] == [g["title"] for g in template["groups"]]
    for g, t in zip(stripped["groups"], template["groups"]):
        assert g["bounding"][1::2] == t["bounding"][1::2] or g["bounding"][1] == t["bounding"][1]
        assert g["bounding"][0] - t["bounding"][0] in shifts and g["bounding"][2] - t["bounding"][2] in shifts


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_every_sampler_and_decode_of_a_template_workflow_runs_on_the_cluster(name, info):
    """Every sampling node's MODEL (guiders included) comes from a Parallel Model, every VAE Decode's VAE from a
    Parallel VAE, bypassed groups included; all of them read the one Cluster; an added node runs where what it feeds
    runs and is bypassed with a bypassed group."""
    ui, api = _load(name)
    _needs_types(ui, info)
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {l[0]: l for l in ui["links"]}

    def source(node, name):
        link = next(i["link"] for i in node["inputs"] if i["name"] == name)
        return nodes[links[link][1]]

    clusters = [n for n in ui["nodes"] if n["type"] == "PatchRayCluster"]
    assert len(clusters) == 1 and clusters[0]["mode"] == 0
    samplers = [n for n in ui["nodes"] if template_workflows._is_sampling(n["type"]) and any(i["name"] == "model" for i in n["inputs"])]
    decodes = [n for n in ui["nodes"] if template_workflows.DECODE_RE.match(n["type"])]
    assert samplers and decodes
    for n in samplers:
        assert source(n, "model")["type"] == "PatchRayParallelModel", (n["id"], n["type"])
    for n in decodes:
        assert source(n, "vae")["type"] == "PatchRayParallelVAE", (n["id"], n["type"])
    for n in ui["nodes"]:
        if n["type"] in ("PatchRayParallelModel", "PatchRayParallelVAE"):
            assert source(n, "cluster") is clusters[0]
            fed = {nodes[links[l][3]]["mode"] for l in n["outputs"][0]["links"]}
            assert n["mode"] == (0 if 0 in fed else 4), (n["id"], fed)
            assert not source(n, n["inputs"][0]["name"])["type"].startswith("PatchRay")
    # the prompt: every active sampler samples a Parallel Model, every decode decodes with a Parallel VAE
    for nid, node in api.items():
        if template_workflows._is_sampling(node["class_type"]) and "model" in node["inputs"]:
            assert api[node["inputs"]["model"][0]]["class_type"] == "PatchRayParallelModel"
        if template_workflows.DECODE_RE.match(node["class_type"]):
            assert api[node["inputs"]["vae"][0]]["class_type"] == "PatchRayParallelVAE"


def test_the_added_nodes_show_their_defaults():
    """The Cluster, Parallel Model and Parallel VAE are added as a user drops them in: every widget at its default."""
    from patchray.nodes import NODES

    import build_workflows

    defaults = {}
    for cls in NODES:
        s = cls.define_schema()
        defaults[s.node_id] = {i.id: i.default for i in s.inputs if getattr(i, "default", None) is not None}
    assert template_workflows.CLUSTER_VALUES == defaults["PatchRayCluster"] == build_workflows.CLUSTER[1]
    assert template_workflows.MODEL_VALUES == defaults["PatchRayParallelModel"]
    if "PatchRayParallelVAE" in defaults:
        assert template_workflows.VAE_VALUES == defaults["PatchRayParallelVAE"]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_a_template_workflows_note_says_what_the_patchray_nodes_do_in_user_terms(name):
    ui, _ = _load(name)
    notes = [n for n in ui["nodes"] if n["type"] == "MarkdownNote" and n["id"] in _added(ui)]
    assert len(notes) == 1
    text = notes[0]["widgets_values"][0]
    for phrase in ("PatchRay Cluster", "PatchRay Parallel Model", "PatchRay Parallel VAE", "stock template back",
                   template_workflows.TEMPLATE_WORKFLOWS[name].title):
        assert phrase in text, phrase
    for word in ("issue", "session", "machine", "H100", "H200", "TODO"):
        assert word.lower() not in text.lower(), word


def test_the_wan22_14b_template_workflow_gives_each_expert_its_own_parallel_model():
    """Both expert chains (high noise: first KSampler (Advanced), low noise: second) of each group get their own
    Parallel Model, all on one Cluster outside the groups; the bypassed group's added nodes sit inside it."""
    ui, api = _load("template_wan22_14b_t2v_parallel")
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {l[0]: l for l in ui["links"]}

    def up(node, name="model"):
        return nodes[links[next(i["link"] for i in node["inputs"] if i["name"] == name)][1]]

    def unet(node):  # up the model chain to the loader
        while node["type"] != "UNETLoader":
            node = up(node)
        return node["widgets_values"][0]

    groups = {g["title"]: template_workflows._group_box(g) for g in ui["groups"]}
    for title, mode in (("Wan2.2 T2V fp8_scaled +  4 steps LoRA", 0), ("Wan2.2 T2V fp8_scaled", 4)):
        inside = [n for n in ui["nodes"] if template_workflows._within(node_box(n), groups[title])]
        samplers = sorted((n for n in inside if n["type"] == "KSamplerAdvanced"), key=lambda n: n["widgets_values"][7])
        assert len(samplers) == 2 and {n["mode"] for n in samplers} == {mode}
        first, second = samplers
        assert first["widgets_values"][7] == 0 and second["widgets_values"][0] == "disable"  # start at 0 / adds no noise
        models = [up(s) for s in samplers]
        assert [m["type"] for m in models] == ["PatchRayParallelModel"] * 2 and models[0] is not models[1]
        assert all(m in inside and m["mode"] == mode for m in models)
        assert "high_noise" in unet(models[0]) and "low_noise" in unet(models[1])
        assert {up(m, "cluster")["id"] for m in models} == {n["id"] for n in ui["nodes"] if n["type"] == "PatchRayCluster"}
        assert [n["mode"] for n in inside if n["type"] == "PatchRayParallelVAE"] == [mode]
    cluster = next(n for n in ui["nodes"] if n["type"] == "PatchRayCluster")
    assert not any(template_workflows._meets(node_box(cluster), box) for box in groups.values())
    assert sorted(n["class_type"] for n in api.values() if n["class_type"].startswith("PatchRay")) == [
        "PatchRayCluster", "PatchRayParallelModel", "PatchRayParallelModel", "PatchRayParallelVAE"]


def test_the_template_builder_says_when_the_templates_package_is_missing(monkeypatch):
    monkeypatch.setattr(template_workflows, "default_template_dirs", lambda: [])
    with pytest.raises(template_workflows.TemplatesMissing, match="pip install comfyui-workflow-templates==0.1.95"):
        template_workflows.load_template("flux_dev_checkpoint_example")
    monkeypatch.setattr(template_workflows, "default_template_dirs", lambda: [ROOT])
    monkeypatch.setattr(template_workflows, "installed_version", lambda: "0.9.9")
    with pytest.raises(template_workflows.TemplatesMissing, match="0.9.9 is installed"):
        template_workflows.load_template("flux_dev_checkpoint_example")


def _tiny_template():
    """A two-node template (UNETLoader -> KSampler, VAE decode) in the templates' UI form."""
    def node(nid, t, inputs, outputs, values, pos):
        return {"id": nid, "type": t, "pos": pos, "size": [300, 100], "flags": {}, "order": nid, "mode": 0,
                "inputs": [{"name": n, "type": ty, "link": l} for n, ty, l in inputs],
                "outputs": [{"name": ty, "type": ty, "links": ls, "slot_index": i} for i, (ty, ls) in enumerate(outputs)],
                "properties": {}, "widgets_values": values}
    return {"last_node_id": 5, "last_link_id": 3, "groups": [], "config": {}, "extra": {}, "version": 0.4, "links": [
        [1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 4, 0, "LATENT"], [3, 3, 0, 4, 1, "VAE"]], "nodes": [
        node(1, "UNETLoader", [], [("MODEL", [1])], ["flux1-dev.safetensors", "default"], [0, 0]),
        node(2, "KSampler", [("model", "MODEL", 1), ("positive", "CONDITIONING", None), ("negative", "CONDITIONING", None),
                             ("latent_image", "LATENT", None)], [("LATENT", [2])], [1, "randomize", 20, 1, "euler", "simple", 1], [400, 0]),
        node(3, "VAELoader", [], [("VAE", [3])], ["ae.safetensors"], [0, 200]),
        node(4, "VAEDecode", [("samples", "LATENT", 2), ("vae", "VAE", 3)], [("IMAGE", [])], [], [800, 0]),
    ]}


def test_the_template_builder_refuses_subgraphs_and_unrecorded_node_types(info, monkeypatch):
    recipe = template_workflows.Recipe(template="tiny", title="Tiny", note="PatchRay")
    monkeypatch.setitem(template_workflows.TEMPLATE_WORKFLOWS, "tiny", recipe)
    ui, api = template_workflows.build("tiny", info, _tiny_template())
    assert api["2"]["inputs"]["model"][0] != "1" and api[api["2"]["inputs"]["model"][0]]["class_type"] == "PatchRayParallelModel"
    assert api[api["4"]["inputs"]["vae"][0]]["class_type"] == "PatchRayParallelVAE"
    assert next(n for n in ui["nodes"] if n["id"] == 2)["widgets_values"][1] == "fixed"
    assert [p for p in overlaps(ui, margin=10) if _added(ui) & set(p)] == []
    with_subgraph = dict(_tiny_template(), definitions={"subgraphs": [{"id": "x", "nodes": []}]})
    with pytest.raises(NotImplementedError, match="subgraphs"):
        template_workflows.build("tiny", info, with_subgraph)
    unknown = _tiny_template()
    unknown["nodes"][0]["type"] = "SomeCustomLoader"
    with pytest.raises(KeyError, match="SomeCustomLoader"):
        template_workflows.build("tiny", info, unknown)
