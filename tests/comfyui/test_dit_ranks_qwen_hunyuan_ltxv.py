"""Opt-in: sequence-, CFG- and batch-parallel sampling of Qwen-Image, HunyuanVideo / HunyuanImage 2.1 and LTX-Video
equals ComfyUI's stock sampling (the rank side, as ``test_dit_ranks.py`` does for FLUX.1 and Wan).

Runs ``dit_ranks_qwen_hunyuan_ltxv.py`` with ComfyUI's Python on 2, 3 and 4 gloo CPU ranks: ComfyUI's own classes, loaded through
its stock detection where that allows a small model (see that file), every weight seeded non-constant; odd token rows,
odd frame counts, text padding masks (HunyuanImage 2.1, LTX-Video), per-token timesteps (LTX-Video image-to-video, keyframe guides) and
first-frame modulation (HunyuanVideo image-to-video "v2").

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -k dit_ranks_qwen_hunyuan_ltxv
"""

import pytest

from .rank_harness import comfyui_marks, run_rank_script

pytestmark = comfyui_marks()

STEPS = 3  # three steps; euler, euler_ancestral and dpmpp_2m call the model once per step
#: 7 text tokens (every conditioning of dit_ranks_qwen_hunyuan_ltxv.py) over 2 and 3 sequence ranks, by hand
TEXT_SPLIT = {2: [4, 3], 3: [3, 2, 2], 4: [2, 2, 2, 1]}
# a masked prompt and an unmasked one cannot be batched (HunyuanImage 2.1 case): ComfyUI calls the model twice a step
CALLS_PER_STEP = {"hyimage": 2}
LAYERS = 2  # attention layers whose K/V are exchanged (Qwen-Image 2 blocks; HunyuanVideo 1 double + 1 single; LTX 2)
# modulation layers computed once across the sequence ranks: Qwen-Image 2 blocks x (image, text); HunyuanVideo and
# HunyuanImage one double-stream block (image, text) and one single-stream block; LTX-Video none (one shared table)
MODULATION_LAYERS = {"qwen": 4, "hunyuan": 3, "hunyuani2v": 3, "hunyuani2vc": 3, "hyimage": 3}

RUNS = {
    2: ["qwen-seq", "qwen-seq-ulysses", "qwen-cfg", "qwen-batch", "hunyuan-seq", "hunyuan-seq-ulysses", "hunyuan-cfg",
        "hunyuan-batch", "hunyuani2v-seq", "hunyuani2vc-seq", "hyimage-seq", "hyimage-seq-ulysses", "ltxv-seq", "ltxv-seq-ulysses",
        "ltxv-cfg", "ltxv-batch", "ltxvi2v-seq", "ltxvi2v-seq-ulysses", "ltxvkf-seq", "ltxvkf-seq-ulysses"],
    3: ["qwen-seq", "qwen-seq-ulysses", "hunyuan-seq", "hunyuan-seq-ulysses", "hunyuani2v-seq", "hyimage-seq",
        "hunyuani2vc-seq", "ltxv-seq", "ltxvi2v-seq", "ltxvkf-seq", "ltxv-batch"],
    4: ["qwen-cfgseq", "hunyuan-cfgseq", "ltxv-cfgseq", "ltxvi2v-seq-ulysses", "qwen-seq", "hunyuan-seq"],
}


@pytest.mark.parametrize("ranks", sorted(RUNS))
def test_qwen_hunyuan_ltxv_equal_the_stock_sampler(tmp_path, ranks):
    report = run_rank_script("dit_ranks_qwen_hunyuan_ltxv.py", tmp_path, ranks, RUNS[ranks], timeout=1500)
    for name in RUNS[ranks]:
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: {rec['layout']} ({rec['groups']} x {rec['seq']}), relative L2 {rec['rel_l2']:.2e}, collectives {rec['comm_calls']}")
        requested = name.split("-")[1]
        mode = {"seq": "sequence", "cfg": "cfg", "cfgseq": "cfg+sequence", "batch": "batch"}[requested]
        assert rec["layout"] == mode, (name, rec)
        # joint-attention families split their 7 text tokens over the sequence ranks (first 7 % n ranks one more);
        # HunyuanImage's masked positive prompt keeps its text whole ([]), its unmasked negative splits it
        if mode in ("sequence", "cfg+sequence"):
            fam = name.split("-")[0]
            want = {"ltxv": [[]], "ltxvi2v": [[]], "ltxvkf": [[]], "hyimage": [[], TEXT_SPLIT[rec["seq"]]]}
            assert rec["text_sizes"] == want.get(fam, [TEXT_SPLIT[rec["seq"]]]), (name, rec["text_sizes"])
            shared, layers = rec["modulation_shared"]
            assert layers == MODULATION_LAYERS.get(fam, 0), (name, rec["modulation_shared"])
            assert shared == (rec["calls"] if layers else 0), (name, rec["modulation_shared"])  # once per model call
        # fp32: sharding only reorders sums (attention over gathered keys in rank-major order, per-row GEMMs on fewer
        # rows). A wrong band, a RoPE or timestep left uncut, or a first-frame boundary left global gives > 1e-2.
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)
        assert rec["calls"] == STEPS * CALLS_PER_STEP.get(name.split("-")[0], 1), (name, rec)
        calls = rec["comm_calls"]
        assert calls.get("all_gather", 0) >= STEPS, (name, calls)
        if name.endswith("ulysses"):  # two all-to-alls per exchanged attention layer per step
            assert calls.get("all_to_all_single", 0) >= STEPS * LAYERS * 2, (name, calls)
        elif mode in ("sequence", "cfg+sequence"):
            assert calls["all_gather"] >= STEPS * (LAYERS + 1), (name, calls)  # the layers' K/V + the output gather
    per_rank = report["calls_per_rank"]
    assert all(r == per_rank[0] for r in per_rank)


HIDDEN = ["qwen-seq-ring", "qwen-seq-overlapped", "hunyuan-seq-ring", "hyimage-seq-overlapped", "ltxv-seq-ring",
          "ltxvkf-seq-overlapped"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_overlapped_and_ring_on_qwen_hunyuan_ltxv_equal_the_stock_sampler(tmp_path, ranks):
    """sequence_attention overlapped and ring on Qwen-Image, HunyuanVideo, HunyuanImage 2.1 and LTX-Video (keyframe
    guides included): exact like gathered; a call with an attention mask (HunyuanImage 2.1's padded prompt) runs
    gathered, the others the mode picked."""
    report = run_rank_script("dit_ranks_qwen_hunyuan_ltxv.py", tmp_path, ranks, HIDDEN, timeout=1500)
    for name in HIDDEN:
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: relative L2 {rec['rel_l2']:.2e}, attention {rec['attention_modes']}, collectives {rec['comm_calls']}")
        assert rec["layout"] == "sequence" and rec["seq"] == ranks, rec
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)
        mode = name.rsplit("-", 1)[1]
        want = {mode, "gathered"} if name.startswith("hyimage") else {mode}
        assert set(rec["attention_modes"]) == want, (name, rec["attention_modes"])
