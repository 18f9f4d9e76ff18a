"""Opt-in: the Distributed KSampler refuses impossible requests in its widgets' words before any rank starts.

``refuse_before_ranks.py`` runs the real PatchRay Cluster node (3 CPU ranks) and Distributed KSampler with MODELs of
ComfyUI's own classes in a fresh process; the Cluster node starts nothing, so after the refusals Ray must never have
been started there (no Ray: no rank process). Seconds, no ranks.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -k refuse_before_ranks
"""

import json
import os
import subprocess

from .rank_harness import COMFYUI_DIR, PYTHON, ROOT, comfyui_marks

pytestmark = comfyui_marks()

#: case -> what the message must say: the widget to change and a value or choice that works (written by hand)
EXPECTED = {
    "cfg+sequence-on-3-ranks": ["parallelism=cfg+sequence", "the cluster has 3", "pick parallelism sequence", "num_ranks"],
    "sequence-on-an-uncovered-model": ["'s diffusion model CameraWanModel", "Wan Fun Camera: a camera adapter",
                                       "parallelism=cfg or batch", "sharding=blocks"],
    "latent-too-small-for-the-ranks": ["latent_image: 1 token rows", "3 sequence ranks", "num_ranks on the PatchRay Cluster node"],
    "stale-preset-with-ulysses": ["preset displaced", "sequence_attention=ulysses", "pick sequence_attention gathered or auto"],
    "unet-stale-preset-with-batch": ["preset displaced", "parallelism=batch", "pick preset full_sync"],
}


def test_impossible_requests_are_refused_without_starting_a_rank(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([PYTHON, str(ROOT / "tests" / "comfyui" / "refuse_before_ranks.py"), "--comfy", COMFYUI_DIR,
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    info = report["cluster_info"]
    assert info["started"] is False and info["num_ranks"] == 3 and info["device_kind"] == "cpu", info
    assert "they start when a PatchRay node first uses them" in report["cluster_summary"]
    assert set(report["cases"]) == set(EXPECTED)
    for name, words in EXPECTED.items():
        case = report["cases"][name]
        assert case["error"] in ("ValueError", "NotImplementedError"), (name, case)
        for w in words:
            assert w in case["message"], (name, w, case["message"])
        assert case["seconds"] < 5, (name, case)  # refused from the inputs, not after a rank start (15-25 s on CPU)
    assert report["ray_initialized"] is False and report["cluster_started"] is False, report
