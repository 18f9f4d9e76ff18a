"""Opt-in: the runtime exactness check on ComfyUI's own DiT classes passes every row of PatchRay's table and refuses a
row whose text block sits on the wrong side (the drift a newer ComfyUI's HunyuanVideo made: every length still
matches, only the check sees it). Runs ``exactness_ranks.py`` on 2 and 3 gloo CPU ranks.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui/test_exactness_check.py
"""

import pytest

from .rank_harness import comfyui_marks, run_rank_script

pytestmark = comfyui_marks()

JOINT = {"flux", "chroma", "qwen", "hunyuan", "hyimage", "sd3", "sd35m", "lumina2", "flux_bf16", "hunyuan_bf16"}  # text in the joint sequence


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_check_passes_the_table_and_refuses_a_flipped_text_block(tmp_path, ranks):
    cases = ["flux", "chroma", "wan21", "wan21i2v", "qwen", "hunyuan", "hyimage", "ltxv", "vace", "sd3", "sd35m", "lumina2", "flux_bf16",
             "hunyuan_bf16"]
    report = run_rank_script("exactness_ranks.py", tmp_path, ranks, cases, timeout=1500)
    per_rank = report["per_rank"]
    caught = 0
    for name in cases:
        rec = report["cases"][name]
        # computed in fp32 whatever the weights' dtype (bf16 rounding alone can exceed a wrong row's error): the split
        # reorders sums only (bound 1e-4; see distributed/sampling/exactness.py)
        assert rec["correct"]["dtype"] == "float32", (name, rec)
        assert rec["correct"]["error"] <= 1e-4 == rec["correct"]["bound"], (name, rec)
        caught += "exactness check" in rec.get("flipped", "")
        print(f"{name} ({rec['class']}) x{ranks}: table row {rec['correct']['error']:.1e}; flipped: "
              f"{rec.get('flipped', '-')[:90]}")
        if name in JOINT:
            # caught by the check, or refused loudly by the split itself: never a silent wrong result
            assert rec["flipped"] != "passed", (name, rec)
            if "exactness check" in rec["flipped"]:
                assert rec["class"] in rec["flipped"]
        # every rank reached the same verdict
        assert all(r[name].get("flipped", "-") == rec.get("flipped", "-") for r in per_rank), name
    assert caught >= 3, caught  # the check itself catches the flipped text of most joint rows
    # Wan VACE's row without its hint-stream hook: caught or refused, never a silent pass
    assert report["cases"]["vace"]["unhooked"] != "passed", report["cases"]["vace"]
    for name in ("flux_bf16", "hunyuan_bf16"):  # bf16 weights: caught in fp32 (in bf16, 5.7e-3 passed bound 5e-2)
        assert report["cases"][name]["weights"] == "bfloat16", report["cases"][name]
        assert "exactness check" in report["cases"][name]["flipped"], report["cases"][name]
