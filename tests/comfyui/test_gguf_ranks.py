"""Opt-in: a GGUF model of the ComfyUI-GGUF pack (Q8_0 and the K-quant Q4_K) sampled by the Parallel Model's ranks
equals the same GGUF model sampled stock, sequence (gathered and ring attention), cfg and batch, with and without a
LoRA; the ranks hold the quantized
bytes and never import the pack.

Runs ``gguf_ranks.py`` with ComfyUI's Python on 2 gloo CPU ranks. Needs a checkout of the pack (``GGUF_DIR``) and the
``gguf`` package in ComfyUI's Python (the pack's dependency).

    GGUF_DIR=/path/to/ComfyUI-GGUF COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python \\
        pytest tests/comfyui/test_gguf_ranks.py
"""

import json
import os
import subprocess

import pytest

from .rank_harness import COMFYUI_DIR, PYTHON, ROOT, comfyui_marks

GGUF_DIR = os.environ.get("GGUF_DIR")

pytestmark = comfyui_marks() + [
    pytest.mark.skipif(not GGUF_DIR or not os.path.isfile(os.path.join(GGUF_DIR or "", "ops.py")),
                       reason="set GGUF_DIR to a checkout of the ComfyUI-GGUF pack (city96/ComfyUI-GGUF) to run the GGUF tests"),
]

CASES = ["q8-seq", "q8-cfg", "q4k-seq", "q4k-cfg", "q4k-seq-lora", "q8-cfg-lora", "q4k-seq-ring", "q4k-batch"]
LAYOUT = {"seq": "sequence", "cfg": "cfg", "batch": "batch"}
#: the blocks' quantized Linear weights of gguf_models.wan_state_dict: q, k, v, o of self and cross attention and
#: the two FFN layers in each of 2 blocks (20), plus the text and time embeddings, the time projection and the head;
#: their biases stay F32 GGML tensors
QUANTIZED = 26


def _run(tmp_path, ranks=2):
    if subprocess.run([PYTHON, "-c", "import gguf"], capture_output=True).returncode:
        pytest.skip("ComfyUI's Python lacks the gguf package (the ComfyUI-GGUF pack's dependency): pip install gguf")
    importable = tmp_path / "imp"
    importable.mkdir()
    os.symlink(ROOT, importable / "patchray")
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(importable), OMP_NUM_THREADS="1")
    proc = subprocess.run([PYTHON, str(ROOT / "tests" / "comfyui" / "gguf_ranks.py"), "--comfy", COMFYUI_DIR, "--gguf",
                           GGUF_DIR, "--ranks", str(ranks), "--cases", *CASES, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_gguf_models_on_the_ranks_equal_the_stock_sampler(tmp_path):
    report = _run(tmp_path)
    assert report["driver"]["file_types"] == {"Q4_K": ["F16", "F32", "Q4_K"], "Q8_0": ["F16", "F32", "Q8_0"]}
    for name in CASES:
        rec = report["cases"][name]
        qtype = "Q4_K" if name.startswith("q4k") else "Q8_0"
        print(f"{name} ({qtype}, {rec['layout']}): relative L2 {rec['rel_l2']:.2e} vs the stock KSampler on the same "
              f"GGUF MODEL; {rec['rank']['quantized_bytes']} quantized bytes on each rank"
              + (f"; the LoRA moves the stock result by {rec['lora_effect']:.2e}" if "lora_effect" in rec else ""))
        assert rec["patcher"] == "GGUFModelPatcher", rec  # loaded by the pack's own loader
        # fp32 compute on both sides, and the same GGML layers dequantizing the same bytes (then adding the same LoRA
        # patches) per call: the splits only reorder sums (attention over keys gathered in rank order, GEMMs over
        # fewer rows, the other CFG half from another rank), ~1e-6 after three steps. A weight dequantized from the
        # wrong bytes or type, or a LoRA dropped (see lora_effect, ~1e-1) or applied twice, gives > 1e-2.
        assert rec["rel_l2"] <= 1e-5, (name, rec)
        assert rec["calls"] == 3, rec
        assert rec["layout"] == LAYOUT[name.split("-")[1]], rec
        # the ranks hold the quantized weights as the driver does: same types, same bytes, nothing dequantized
        for r, per in enumerate(report["per_rank"]):
            got = per[name]
            assert not got["pack_imported_before"] and not got["pack_imported_after"], (r, got)  # classes by value
            assert got["rank"]["types"] == {qtype: QUANTIZED, "F32": QUANTIZED}, (r, got)
            assert got["rank"]["quantized_bytes"] == rec["driver"]["quantized_bytes"], (r, got, rec["driver"])
            assert got["block_linear_dtypes"] == ["torch.uint8"], (r, got)
        # what shipped: the quantized bytes plus the few small F32/F16 tensors, not a dequantized model (4x fp32 bytes)
        assert rec["shipped_bytes"] < 1.2 * rec["driver"]["quantized_bytes"], rec
        if name.endswith("lora"):
            # the LoRA's patches of the 20 quantized block weights travel and are attached on every rank, as the
            # pack's patcher attaches them (the bias difference ships patched); it changes the stock result
            assert rec["lora_keys"] == 21 and rec["ggml_patches"] == 20, rec
            assert all(per[name]["rank"]["patched"] == 20 for per in report["per_rank"]), report["per_rank"]
            assert rec["lora_effect"] > 1e-2, rec
        else:
            assert rec["ggml_patches"] == 0 and rec["rank"]["patched"] == 0, rec
        # weight sharding refused by name, with the alternatives; auto keeps the quantized model whole
        assert "sharding=none" in rec["blocks_refusal"] and "fp8 or fp16" in rec["blocks_refusal"], rec
        assert rec["auto_sharding"][0] == "none" and "GGUF" in rec["auto_sharding"][1], rec
