"""Record ComfyUI's stock node types from a running server's /object_info into tests/fixtures/comfy_stock_nodes.json.

Usage: start ComfyUI (``python main.py --cpu --listen 127.0.0.1 --port 8188``), then
``python tests/comfyui/record_stock_nodes.py http://127.0.0.1:8188``. Custom nodes are left out. The workflow tests
use the record to check that shared workflows only use stock node types, with the right input names and link types.
"""

import json
import sys
import urllib.request
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "comfy_stock_nodes.json"


WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _type(spec):
    t = spec[0]
    return "COMBO" if isinstance(t, list) else str(t)


def record(base: str) -> dict:
    with urllib.request.urlopen(base.rstrip("/") + "/object_info", timeout=60) as r:
        info = json.load(r)
    with urllib.request.urlopen(base.rstrip("/") + "/system_stats", timeout=60) as r:
        version = json.load(r)["system"].get("comfyui_version")
    nodes = {}
    for name, d in sorted(info.items()):
        if d.get("python_module", "").startswith("custom_nodes"):
            continue
        # a list in declaration order: UI-format workflows store widget values by position
        inputs = []
        for section in ("required", "optional"):
            for k, spec in (d["input"].get(section) or {}).items():
                opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                control = bool(opts.get("control_after_generate")) or (k in ("seed", "noise_seed") and _type(spec) == "INT")
                entry = {"name": k, "type": _type(spec), "optional": section == "optional",
                         "widget": _type(spec) in WIDGET_TYPES and not opts.get("forceInput"),
                         "control_after_generate": control,
                         # upload combos get a frontend-only "upload" widget value after theirs
                         "upload": any(opts.get(u) for u in ("image_upload", "video_upload", "audio_upload", "animated_image_upload"))}
                inputs.append({key: v for key, v in entry.items() if v is not False})  # absent flag = false
        nodes[name] = {"inputs": inputs, "outputs": [str(o) if not isinstance(o, list) else "COMBO" for o in d["output"]],
                       "output_node": bool(d.get("output_node"))}
    return {"comfyui_version": version, "source": "/object_info of a stock server (custom nodes excluded)", "nodes": nodes}


if __name__ == "__main__":
    data = record(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8188")
    OUT.write_text(json.dumps(data, separators=(",", ":")).replace('},"', '},\n"') + "\n")
    print(f"{len(data['nodes'])} stock node types of ComfyUI {data['comfyui_version']} -> {OUT}")
