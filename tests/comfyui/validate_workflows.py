"""Queue-validate every shipped API workflow with ComfyUI's own prompt validation (run by hand or by the opt-in test).

ComfyUI's POST /prompt runs ``execution.validate_prompt`` and queues the prompt only if it passes: every node type
exists, every required input is present, links point at outputs of the right type, numbers are inside their ranges,
combo values (sampler names, schedulers, model files, images) are among the choices the server lists. This script
runs that same function in-process, after loading ComfyUI's nodes and this pack (linked into a private base directory's
``custom_nodes`` as a user installs it), without queueing anything: nothing executes, no cluster starts.

The workflows name model files a user downloads (``flux1-dev.safetensors`` ...). The private base directory holds an
empty file of each such name in the folder its loader lists (a loader's combo only lists names; validation never opens
the file), and the example image ComfyUI ships for ``LoadImage``.

Usage (ComfyUI's Python)::

    python tests/comfyui/validate_workflows.py <ComfyUI dir> [workflow names or paths of .api.json files ...]

Prints one line per workflow and exits 1 if any failed validation.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (node class, input) -> the models folder its combo lists
MODEL_FOLDERS = {
    ("CheckpointLoaderSimple", "ckpt_name"): "checkpoints",
    ("VAELoader", "vae_name"): "vae",
    ("UNETLoader", "unet_name"): "diffusion_models",
    ("CLIPLoader", "clip_name"): "text_encoders",
    ("DualCLIPLoader", "clip_name1"): "text_encoders",
    ("DualCLIPLoader", "clip_name2"): "text_encoders",
    ("LoraLoader", "lora_name"): "loras",
    ("LoraLoaderModelOnly", "lora_name"): "loras",
}


def _placeholders(workflows: dict) -> dict:
    """folder -> file names the workflows load (``LoadImage`` images under the key ``input``)."""
    files: dict = {}
    for name, api in workflows.items():
        for nid, node in api.items():
            for key, value in node["inputs"].items():
                folder = MODEL_FOLDERS.get((node["class_type"], key))
                if node["class_type"] == "LoadImage" and key == "image":
                    folder = "input"
                elif folder is None and isinstance(value, str) and value.endswith((".safetensors", ".ckpt", ".pt", ".gguf")):
                    raise KeyError(f"{name}: node {nid} {node['class_type']}.{key} loads {value!r}: add its folder to MODEL_FOLDERS")
                if folder:
                    files.setdefault(folder, set()).add(value)
    return files


def _v3_combo_errors(mappings, api) -> list:
    """Combo values outside their options on V3 nodes: ComfyUI 0.3.64's ``validate_inputs`` checks a combo only when
    its type is a list (V1 nodes); a V3 ``io.Combo`` arrives as ``("COMBO", {"options": [...]})`` and passes unchecked,
    while the frontend would show it as invalid. Checked here the way ``validate_inputs`` checks V1 combos."""
    errors = []
    for nid, node in api.items():
        spec = mappings[node["class_type"]].INPUT_TYPES()
        declared = {**spec.get("required", {}), **spec.get("optional", {})}
        for key, value in node["inputs"].items():
            entry = declared.get(key)
            if not entry or isinstance(value, list) or entry[0] != "COMBO" or len(entry) < 2:
                continue
            options = entry[1].get("options")
            if options is not None and value not in options:
                errors.append(f"node {nid} {node['class_type']}.{key} = {value!r} is not one of its options")
    return errors


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not (Path(argv[0]) / "main.py").exists():
        print(__doc__.split("\n\n")[-2], file=sys.stderr)
        return 2
    comfy_dir, wanted = Path(argv[0]).resolve(), argv[1:]
    files = [Path(w) for w in wanted if w.endswith(".api.json")]  # a path instead of a shipped workflow's name
    names = [w for w in wanted if not w.endswith(".api.json")]
    paths = files + sorted(p for p in (ROOT / "workflows").glob("*.api.json") if (not wanted or p.name[: -len(".api.json")] in names))
    workflows = {p.name[: -len(".api.json")]: json.loads(p.read_text()) for p in paths}
    base = Path(tempfile.mkdtemp(prefix="patchray-validate-"))
    try:
        (base / "custom_nodes").mkdir()
        os.symlink(ROOT, base / "custom_nodes" / "PatchRay")
        for folder, names in _placeholders(workflows).items():
            target = base / ("input" if folder == "input" else f"models/{folder}")
            target.mkdir(parents=True, exist_ok=True)
            for n in names:
                if folder == "input":
                    shutil.copy(comfy_dir / "input" / "example.png", target / n)
                else:
                    (target / n).write_bytes(b"")
        sys.argv = [sys.argv[0], "--cpu", "--base-directory", str(base), "--disable-api-nodes"]
        sys.path.insert(0, str(comfy_dir))
        os.chdir(comfy_dir)
        import comfy.options

        comfy.options.enable_args_parsing()
        # main.py imports ComfyUI's ``utils`` package first; later imports put comfy/ (with its utils.py) on sys.path
        import utils.install_util  # noqa: F401

        import execution
        import nodes

        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
        if "PatchRayVAEDecode" not in nodes.NODE_CLASS_MAPPINGS:
            print("the PatchRay nodes did not load", file=sys.stderr)
            return 1
        failed = 0
        for name, api in workflows.items():
            ok, error, good, node_errors = asyncio.run(execution.validate_prompt(f"validate-{name}", api, None))
            outputs = sorted(nid for nid, node in api.items() if getattr(nodes.NODE_CLASS_MAPPINGS[node["class_type"]], "OUTPUT_NODE", False) is True)
            # a prompt passes if ANY output validates; a shipped workflow must validate every one of its outputs
            combos = _v3_combo_errors(nodes.NODE_CLASS_MAPPINGS, api)
            complete = ok and sorted(good) == outputs and not node_errors and not combos
            failed += not complete
            detail = "" if complete else f": {error} {json.dumps(node_errors)[:1500]} {combos} (valid outputs {sorted(good)} of {outputs})"
            print(f"workflows/{name}.api.json: {'valid' if complete else 'INVALID'} ({len(api)} nodes, outputs {outputs}){detail}", flush=True)
        return 1 if failed else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
