"""Opt-in: the Distributed KSampler's sequence-, CFG- and batch-parallel rank side equals ComfyUI's stock sampling.

Runs ``dit_ranks.py`` with ComfyUI's Python on 2, 3 and 4 gloo CPU ranks (ComfyUI's own Flux, Chroma, Wan 2.1 t2v and
i2v, Wan 2.2 5B and UNet classes, small widths, seeded non-constant weights; odd latent sizes, 5-frame videos) and
compares each final latent with ``comfy.sample.sample`` on the same ModelPatcher without PatchRay's wrappers.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -k dit_ranks
"""

import pytest

from .rank_harness import comfyui_marks, run_rank_script

pytestmark = comfyui_marks()

STEPS = 3  # dit_ranks.py samples 3 steps; euler, euler_ancestral and dpmpp_2m call the model once per step
#: 7 text tokens (every conditioning of dit_ranks.py) over 2, 3 and 4 sequence ranks, by hand
TEXT_SPLIT = {2: [4, 3], 3: [3, 2, 2], 4: [2, 2, 2, 1]}
# dit_ranks.py's Flux: one double-stream block (image and text modulation) and one single-stream block
FLUX_MODULATION_LAYERS = 3

RUNS = {
    2: ["flux-seq", "flux-seq-ulysses", "flux-cfg", "flux-batch", "wan21-seq", "wan21-seq-ulysses", "wan21-cfg",
        "wan21-batch", "wan21i2v-seq", "wan22-seq", "unet-cfg", "flux-replicated"],
    3: ["flux-seq", "flux-seq-ulysses", "chroma-seq", "wan21-seq", "wan22-seq", "flux-batch"],
    4: ["flux-cfgseq", "wan21-cfgseq", "unet-cfgseq", "flux-seq"],
}
#: Wan VACE (dit_ranks.py: two VACE blocks, each run once per control context, two contexts)
VACE_RUNS = {2: ["vace-seq", "vace-seq-ulysses"], 3: ["vace-seq", "vace-seq-ulysses"], 4: ["vace-cfgseq"]}
#: self-attentions per Wan VACE call: two video blocks, then two VACE blocks for each of two contexts
VACE_ATTENTIONS = 2 + 2 * 2
#: SD3 / SD3.5 Medium (dit_ranks.py: two joint blocks; SD3.5 Medium's first adds an image-only attention)
SD3_RUNS = {2: ["sd3-seq", "sd3-seq-ulysses", "sd35m-seq"], 3: ["sd3-seq", "sd35m-seq"], 4: ["sd3-cfgseq"]}
SD3_ATTENTIONS = {"sd3": 2, "sd35m": 3}
#: Lumina 2 (dit_ranks.py: two main layers with a joint attention; the refiners run whole on every rank)
LUMINA_RUNS = {2: ["lumina2-seq", "lumina2-seq-ulysses"], 3: ["lumina2-seq", "lumina2-seq-ulysses"], 4: ["lumina2-cfgseq"]}
LUMINA_ATTENTIONS = 2


@pytest.mark.parametrize("ranks", [2, 3])
def test_overlapped_and_ring_attention_equal_the_stock_sampler(tmp_path, ranks):
    """sequence_attention=overlapped (the K/V gather in flight behind the own keys' part, log-sum-exp merge) and ring
    (the K/V point to point, one peer per stage) on ComfyUI's Flux and WanModel: fp32, the same bound as gathered
    (only the order of sums differs)."""
    names = ["flux-seq-overlapped", "wan21-seq-overlapped", "flux-seq-ring", "wan21-seq-ring"]
    report = run_rank_script("dit_ranks.py", tmp_path, ranks, names, timeout=900)
    for name in names:
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: relative L2 {rec['rel_l2']:.2e}, collectives {rec['comm_calls']}")
        assert rec["layout"] == "sequence" and rec["seq"] == ranks, rec
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)
        mode = name.rsplit("-", 1)[1]
        assert set(rec["attention_modes"]) == {mode}, rec  # every self/joint attention call took the mode
        if mode == "ring":  # two attention layers, N - 1 point-to-point stages each; the output gathered once
            assert rec["comm_calls"].get("batch_isend_irecv", 0) >= STEPS * 2 * (ranks - 1), rec
        else:
            assert rec["comm_calls"].get("all_gather", 0) >= STEPS * 3, rec  # two attention layers + the output


@pytest.mark.parametrize("ranks", sorted(RUNS))
def test_every_parallelism_equals_the_stock_sampler(tmp_path, ranks):
    report = run_rank_script("dit_ranks.py", tmp_path, ranks, RUNS[ranks], timeout=900)
    for name in RUNS[ranks]:
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: {rec['layout']} ({rec['groups']} x {rec['seq']}), relative L2 {rec['rel_l2']:.2e}, collectives {rec['comm_calls']}")
        requested = name.split("-")[1]
        mode = {"seq": "sequence", "cfg": "cfg", "cfgseq": "cfg+sequence", "batch": "batch", "replicated": "replicated"}[requested]
        assert rec["layout"] == mode, (name, rec)
        # joint-attention families split their 7 text tokens over the sequence ranks (first 7 % n ranks one more)
        if mode in ("sequence", "cfg+sequence") and name.split("-")[0] in ("flux", "chroma"):
            assert rec["text_sizes"] == [TEXT_SPLIT[rec["seq"]]], (name, rec["text_sizes"])
        # FLUX.1's blocks' modulation layers (image and text of each double-stream block, one per single-stream block)
        # computed once across the sequence ranks on every model call; Chroma's blocks have none
        if mode in ("sequence", "cfg+sequence") and name.split("-")[0] == "flux":
            shared, layers = rec["modulation_shared"]
            assert layers == FLUX_MODULATION_LAYERS and shared == rec["calls"], (name, rec["modulation_shared"])
        elif name.split("-")[0] == "chroma":
            assert rec["modulation_shared"] == [0, 0], (name, rec["modulation_shared"])
        if mode == "replicated":  # nothing split, nothing exchanged: the stock result on every rank
            assert rec["rel_l2"] <= 1e-5 and "cfg = 1" in rec["note"], rec
            continue
        # fp32: sharding only reorders sums (attention over gathered keys in rank-major order, per-row GEMMs on fewer
        # rows); measured <= 1e-6 after three steps. A wrong band, a missed RoPE slice or a swapped uncond gives > 1e-2.
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)
        assert rec["calls"] == STEPS, (name, rec)
        calls = rec["comm_calls"]
        # the work was split: collectives ran every step (one CFG exchange, one batch gather, or the attention
        # layers' exchanges plus the output gather)
        assert calls.get("all_gather", 0) >= STEPS, (name, calls)
        if name.endswith("ulysses"):  # two attention layers, two all-to-alls each
            assert calls.get("all_to_all_single", 0) >= STEPS * 2 * 2, (name, calls)
        elif mode in ("sequence", "cfg+sequence") and not name.startswith("unet"):
            assert calls["all_gather"] >= STEPS * 3, (name, calls)  # two attention layers + the output gather
    # every rank made the same number of model calls
    per_rank = report["calls_per_rank"]
    assert all(r == per_rank[0] for r in per_rank)


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_advanced_samplers_two_halves_equal_the_stock_advanced_sampler(tmp_path, ranks):
    """The Distributed KSampler (Advanced)'s schedule on the ranks (Wan 2.2 14B's two experts run as two such
    halves): the first half adds the noise and stops after 2 of 3 steps with the leftover noise, the second adds none
    and runs the last step; a third run stops after 2 steps denoised fully. Each equals ComfyUI's sampler with the
    same start, end, noise and full-denoise inputs."""
    names = ["wan21-seq-first", "wan21-seq-second", "wan21-seq-first-full"]
    report = run_rank_script("dit_ranks.py", tmp_path, ranks, names, timeout=900)
    for name, calls in zip(names, (2, 1, 2)):
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: relative L2 {rec['rel_l2']:.2e}, {rec['calls']} model calls")
        assert rec["layout"] == "sequence" and rec["seq"] == ranks, rec
        assert rec["calls"] == calls, (name, rec)  # only this half's steps ran
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)  # fp32, the bound and argument of the test above



@pytest.mark.parametrize("ranks", sorted(VACE_RUNS))
def test_wan_vace_bands_its_hint_stream_with_the_video_and_equals_the_stock_sampler(tmp_path, ranks):
    """VaceWanModel: the VACE context's tokens (the hint stream) and the video tokens the VACE blocks read are cut to
    each rank's band (``wan_vace_hooks``); every VACE block's self-attention then exchanges K/V like the video's."""
    names = VACE_RUNS[ranks]
    report = run_rank_script("dit_ranks.py", tmp_path, ranks, names, timeout=900)
    for name in names:
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: {rec['layout']} ({rec['groups']} x {rec['seq']}), relative L2 {rec['rel_l2']:.2e}, "
              f"collectives {rec['comm_calls']}")
        assert rec["layout"] == ("cfg+sequence" if name.endswith("cfgseq") else "sequence"), rec
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)  # fp32: the bound and argument of the tests above
        calls = rec["comm_calls"]
        if name.endswith("ulysses"):  # two all-to-alls per self-attention, the VACE blocks' included
            assert calls.get("all_to_all_single", 0) >= rec["calls"] * VACE_ATTENTIONS * 2, (name, calls)
        elif not name.endswith("cfgseq"):  # one K/V gather per self-attention, the output gather
            assert calls.get("all_gather", 0) >= rec["calls"] * (VACE_ATTENTIONS + 1), (name, calls)


@pytest.mark.parametrize("ranks", sorted(SD3_RUNS))
def test_sd3_mmdit_equals_the_stock_sampler(tmp_path, ranks):
    """SD3's MMDiT (``OpenAISignatureMMDITWrapper``, whose forward calls no DIFFUSION_MODEL wrapper: the sequence
    wrapper sits around ``apply_model``): the image tokens cut at the first joint block's input (positions already
    added), the text whole on every rank and first in each joint attention; SD3.5 Medium's image-only attention too."""
    names = SD3_RUNS[ranks]
    report = run_rank_script("dit_ranks.py", tmp_path, ranks, names, timeout=900)
    for name in names:
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: {rec['layout']} ({rec['groups']} x {rec['seq']}), relative L2 {rec['rel_l2']:.2e}, "
              f"attention {rec['attention_modes']}, collectives {rec['comm_calls']}")
        assert rec["layout"] == ("cfg+sequence" if name.endswith("cfgseq") else "sequence"), rec
        # fp32: the bound and argument of the tests above (the text is whole and first on every rank, so the keys are
        # in the whole model's order: measured bit-identical)
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)
        # every attention of every call went through the sequence attention, in the mode asked for
        mode = "ulysses" if name.endswith("ulysses") else "gathered"
        if not name.endswith("cfgseq"):
            assert rec["attention_modes"] == {mode: rec["calls"] * SD3_ATTENTIONS[name.split("-")[0]]}, (name, rec)


@pytest.mark.parametrize("ranks", sorted(LUMINA_RUNS))
def test_lumina2_equals_the_stock_sampler(tmp_path, ranks):
    """Lumina 2's NextDiT (its transformer options arrive in ``**kwargs``): the image tokens cut at the first main
    layer's input with the text whole and first, the joint RoPE cut there too, the text and image refiners whole on
    every rank (scoped by path), the final layer's output gathered behind the text."""
    names = LUMINA_RUNS[ranks]
    report = run_rank_script("dit_ranks.py", tmp_path, ranks, names, timeout=900)
    for name in names:
        rec = report["cases"][name]
        print(f"{ranks} ranks {name}: {rec['layout']} ({rec['groups']} x {rec['seq']}), relative L2 {rec['rel_l2']:.2e}, "
              f"attention {rec['attention_modes']}, collectives {rec['comm_calls']}")
        assert rec["layout"] == ("cfg+sequence" if name.endswith("cfgseq") else "sequence"), rec
        assert rec["rel_l2"] <= 1e-5, (ranks, name, rec)  # fp32; the text whole and first: measured bit-identical
        if not name.endswith("cfgseq"):  # the main layers' attentions through the sequence attention, every call
            mode = "ulysses" if name.endswith("ulysses") else "gathered"
            assert rec["attention_modes"] == {mode: rec["calls"] * LUMINA_ATTENTIONS}, (name, rec)
