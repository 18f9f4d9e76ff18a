"""Shared workflows: they parse, use only known node types, link outputs to inputs of the same type, and the
UI form (what users drag in) converts to exactly the API form (what /prompt takes)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "comfyui"))
from workflow_tools import VIRTUAL, min_node_size, node_info, overlaps, ui_to_api, widget_text_width  # noqa: E402

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


@pytest.fixture(scope="module")
def info():
    return node_info()


def _load(name):
    ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
    api = json.loads((ROOT / "workflows" / f"{name}.api.json").read_text())
    return ui, api


def test_every_workflow_has_both_forms():
    files = {p.name for p in (ROOT / "workflows").glob("*.json")}
    assert files == {f"{n}.json" for n in NAMES} | {f"{n}.api.json" for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_ui_form_is_consistent(name, info):
    ui, _ = _load(name)
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_node_id"] >= max(nodes)
    assert any(n["type"] in VIRTUAL for n in ui["nodes"]), "a note explains the workflow"
    for n in ui["nodes"]:
        assert n["type"] in info or n["type"] in VIRTUAL, f"unknown node type {n['type']}"
    assert any(info[n["type"]]["output_node"] for n in ui["nodes"] if n["type"] in info), "nothing would execute"
    for link_id, src, slot, dst, dst_slot, ltype in ui["links"]:
        src_type = info[nodes[src]["type"]]["outputs"][slot]
        target = nodes[dst]["inputs"][dst_slot]
        assert target["link"] == link_id
        declared = {i["name"]: i["type"] for i in info[nodes[dst]["type"]]["inputs"]}
        assert ltype == src_type == nodes[src]["outputs"][slot]["type"]
        assert declared[target["name"]] in (src_type, "*"), f"{name}: {src_type} wired into {nodes[dst]['type']}.{target['name']}"
        assert link_id in nodes[src]["outputs"][slot]["links"]
    listed = sorted(l for n in ui["nodes"] for o in n.get("outputs", []) for l in o["links"])
    assert listed == sorted(l[0] for l in ui["links"])


@pytest.mark.parametrize("name", NAMES)
def test_api_form_matches_the_ui_form(name, info):
    ui, api = _load(name)
    converted = ui_to_api(ui, info)
    assert {k: (v["class_type"], v["inputs"]) for k, v in converted.items()} == {
        k: (v["class_type"], v["inputs"]) for k, v in api.items()
    }


@pytest.mark.parametrize("name", NAMES)
def test_api_form_is_complete(name, info):
    _, api = _load(name)
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
    assert overlaps(ui, margin=10) == [], f"{name}: overlapping nodes (ids)"
    api = ui_to_api(ui, info)
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

    ui, api = build_workflows.build(name, build_workflows.WORKFLOWS[name](), info)
    shipped_ui, shipped_api = _load(name)
    assert json.loads(json.dumps(api)) == shipped_api
    assert json.loads(json.dumps(ui)) == shipped_ui


def test_the_dit_sampler_notes_name_every_sequence_attention_mode():
    from patchray.nodes.bridge.ksampler import ATTENTION_NAMES

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

