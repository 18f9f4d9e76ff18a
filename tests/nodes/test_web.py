"""web/patchray.js: its panel heights match the sizes the shipped workflows give the nodes, and its formatting helpers
(run with Node.js where present) print sizes width x height and the same peak memory the chart draws."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JS = (ROOT / "web" / "patchray.js").read_text()
sys.path.insert(0, str(ROOT / "tests" / "comfyui"))
from workflow_tools import EXTRA_HEIGHT, MIN_WIDTH  # noqa: E402


def _panel_heights() -> dict:
    block = re.search(r"export const PANEL = \{(.*?)\};", JS, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"(\w+):\s*(\d+)", block)}


def test_every_panel_fits_the_height_the_workflows_give_it():
    panels = _panel_heights()
    assert panels, "no PANEL table in web/patchray.js"
    for node_type, height in panels.items():
        # the DOM widget's row: its minimum height plus 10 px of margins around it
        assert EXTRA_HEIGHT.get(node_type, 0) >= height + 10, node_type


def test_nodes_open_as_wide_as_the_workflows_make_them():
    block = re.search(r"export const WIDTH = \{(.*?)\};", JS, re.S).group(1)
    widths = {k: int(v) for k, v in re.findall(r"(\w+):\s*(\d+)", block)}
    assert widths and all(MIN_WIDTH[k] >= v for k, v in widths.items()), widths


def test_panels_wrap_text_instead_of_scrolling_it_sideways():
    assert "white-space:pre-wrap" in JS and "max-height:420px" not in JS


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_formatting_helpers(tmp_path):
    module = tmp_path / "patchray.mjs"
    # the module's one import (ComfyUI's app) replaced by a stand-in; nothing else changes
    module.write_text(JS.replace('import { app } from "../../scripts/app.js";', "const app = { registerExtension() {} };"))
    script = tmp_path / "run.mjs"
    script.write_text(
        "import { sizeLabel, peakGiB } from './patchray.mjs';\n"
        "console.log(JSON.stringify({\n"
        "  image: sizeLabel({height: 1080, width: 1920, frames: 1, label: '1080x1920x1'}),\n"
        "  video: sizeLabel({height: 480, width: 832, frames: 81}),\n"
        "  cpu: peakGiB({peak_memory: {metric: 'process_rss_peak', max_bytes: 423460864, max_gib: 0.3944}}),\n"
        "  gpu: peakGiB({peak_memory: {bytes: 3 * 2 ** 30}}),\n"
        "  none: peakGiB({status: 'skipped'}),\n"
        "}));\n"
    )
    out = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"image": "1920x1080", "video": "832x480x81", "cpu": "0.394", "gpu": "3.000", "none": "-"}


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_a_failed_or_cancelled_run_resets_only_that_patchray_nodes_panel(tmp_path):
    """A run that fails (or is cancelled) in a PatchRay node leaves no earlier run's result in its panel: the widgets
    as they are now did not produce it (e.g. the KSampler's 'sequence attention ring' after a refused ulysses)."""
    module = tmp_path / "patchray.mjs"
    module.write_text(JS.replace('import { app } from "../../scripts/app.js";', "const app = { registerExtension() {} };"))
    script = tmp_path / "run.mjs"
    script.write_text(
        "globalThis.document = { createElement: (tag) => ({ tag, style: {}, textContent: '', children: [],\n"
        "  appendChild(c) { this.children.push(c); }, replaceChildren(...c) { this.children = c; } }) };\n"
        "import { endedWithout } from './patchray.mjs';\n"
        "const panel = () => ({ name: 'patchray_view', element: { children: [{ textContent: 'sequence attention ring' }],\n"
        "  replaceChildren(...c) { this.children = c; } } });\n"
        "const ks = { id: 8, type: 'PatchRayKSampler', widgets: [panel()] };\n"
        "const other = { id: 9, type: 'KSampler', widgets: [panel()] };\n"
        "const text = (n) => n.widgets[0].element.children.map((c) => c.textContent).join(' ');\n"
        "const out = { unknown: endedWithout([ks, other], '12', 'execution_error'), stock: endedWithout([ks, other], '9', 'execution_error'),\n"
        "  stockText: text(other), failed: endedWithout([ks, other], '8', 'execution_error'), failedText: text(ks) };\n"
        "out.cancelled = endedWithout([ks], 8, 'execution_interrupted'); out.cancelledText = text(ks);\n"
        "console.log(JSON.stringify(out));\n"
    )
    out = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["unknown"] is False and got["stock"] is False and got["stockText"] == "sequence attention ring", got
    assert got["failed"] is True and "ring" not in got["failedText"] and "last run failed" in got["failedText"], got
    assert got["cancelled"] is True and "last run was cancelled" in got["cancelledText"], got
