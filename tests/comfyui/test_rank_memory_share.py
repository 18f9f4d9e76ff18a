"""Opt-in, real ComfyUI: a CPU rank's ComfyUI sizes its work to its share of the host's free memory.

ComfyUI's attention functions size their chunks from ``comfy.model_management.get_free_memory`` at every call; N CPU
ranks on one host each sized against all of it take N times the free memory together (measured before the change: a
Wan 2.1 1280x720x121 run on 3 CPU ranks drove the 24 GiB machine to Ray's 95% memory kill). ``ksampler_rank.prepare``
makes the figure the host's available memory / the ranks; GPU devices are left alone.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -k memory_share
"""

import json
import os
import subprocess

from .rank_harness import COMFYUI_DIR, PYTHON, ROOT, comfyui_marks

pytestmark = comfyui_marks()

_SCRIPT = r'''
import json, sys
sys.path.insert(0, sys.argv[1]); sys.argv = [sys.argv[0], "--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import psutil, torch
import comfy.model_management as mm
from patchray.nodes.bridge.ksampler_rank import share_host_memory

cpu = torch.device("cpu")
before = mm.get_free_memory(cpu)
share_host_memory(mm, 3)
share_host_memory(mm, 3)  # prepare() runs per call: applying it again must not divide again
shared, shared_pair, default_dev = mm.get_free_memory(cpu), mm.get_free_memory(cpu, True), mm.get_free_memory()
share_host_memory(mm, 1)
print(json.dumps({"before": before, "shared": shared, "pair": list(shared_pair), "default": default_dev,
                  "one": mm.get_free_memory(cpu), "available": psutil.virtual_memory().available}))
'''


def test_cpu_ranks_see_their_share_of_the_host_memory(tmp_path):
    importable = tmp_path / "imp"
    importable.mkdir()
    os.symlink(ROOT, importable / "patchray")
    proc = subprocess.run([PYTHON, "-c", _SCRIPT, COMFYUI_DIR], env=dict(os.environ, PYTHONPATH=str(importable)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    gib = 2**30
    # the host's available memory moves while other processes run: compared within 1 GiB of psutil's figure
    assert abs(got["before"] - got["available"]) < gib
    assert abs(got["shared"] * 3 - got["available"]) < gib, got
    assert abs(got["pair"][0] * 3 - got["available"]) < gib and abs(got["pair"][1] * 3 - got["available"]) < gib, got
    assert abs(got["default"] * 3 - got["available"]) < gib, got  # no device given: ComfyUI's own (cpu here)
    assert abs(got["one"] - got["available"]) < gib, got  # one rank: the whole host, the original function
