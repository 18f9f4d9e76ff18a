"""Opt-in: every shipped API workflow passes ComfyUI's own prompt validation (what POST /prompt runs before queueing),
with this pack loaded as a user installs it and the workflows' model files present by name (validate_workflows.py).

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -q -k workflows_validate
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-ComfyUI test"),
]

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("COMFYUI_PYTHON", sys.executable)
SCRIPT = Path(__file__).with_name("validate_workflows.py")


def _validate(*args):
    proc = subprocess.run([PYTHON, str(SCRIPT), COMFYUI_DIR, *args], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("workflows/")]
    return proc.returncode, lines, proc.stderr[-3000:]


def test_every_shipped_workflow_passes_comfyuis_prompt_validation_and_a_broken_copy_does_not(tmp_path):
    shipped = sorted(p.name for p in (ROOT / "workflows").glob("*.api.json"))
    # negative controls (the same run, so ComfyUI loads once): a required input removed, a V3 combo value outside its
    # options (ComfyUI 0.3.64 itself lets the latter through; the script checks it as the frontend would)
    missing = json.loads((ROOT / "workflows" / "hunyuan_video_decode.api.json").read_text())
    for node in missing.values():
        if node["class_type"] == "PatchRayVAEDecode":
            del node["inputs"]["vae"]
    combo = json.loads((ROOT / "workflows" / "wan22_txt2video_distributed.api.json").read_text())
    for node in combo.values():
        if node["class_type"] == "PatchRayKSampler":
            node["inputs"]["sampler_name"] = "no_such_sampler"
    broken = []
    for name, api in (("missing_input", missing), ("bad_combo", combo)):
        path = tmp_path / f"{name}.api.json"
        path.write_text(json.dumps(api))
        broken.append(str(path))
    rc, lines, err = _validate(*broken, *[n[: -len(".api.json")] for n in shipped])
    verdict = {ln.split(":")[0].split("/")[-1]: ln.split(": ", 1)[1] for ln in lines}
    assert set(verdict) == set(shipped) | {"missing_input.api.json", "bad_combo.api.json"}, (lines, err)
    for name in shipped:
        assert verdict[name].startswith("valid"), f"{name}: {verdict[name]}"
    assert "required_input_missing" in verdict["missing_input.api.json"], verdict["missing_input.api.json"]
    assert "no_such_sampler" in verdict["bad_combo.api.json"], verdict["bad_combo.api.json"]
    assert rc == 1  # the broken copies fail the run
