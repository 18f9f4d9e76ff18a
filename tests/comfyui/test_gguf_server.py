"""Opt-in: a GGUF model of the ComfyUI-GGUF pack through PatchRay Parallel Model in a real ComfyUI server.

The pack's ``Unet Loader (GGUF)`` (the pack linked into the server's custom_nodes from ``GGUF_DIR``) loads a small
Wan 2.1 written as Q8_0 and Q4_K GGUF files (``gguf_models.py``); ``LoraLoaderModelOnly`` and ``ModelSamplingSD3``
follow; the stock KSampler on that MODEL and the stock KSampler on the Parallel Model of it run in one prompt, the
latter on 2 CPU ranks through Ray (the skeleton, the pack's classes by value, the quantized bytes in parts, the LoRA's
patches). ``sharding=blocks`` is refused by name before any rank starts.

    GGUF_DIR=/path/to/ComfyUI-GGUF COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python \\
        pytest tests/comfyui/test_gguf_server.py
"""

import os
import subprocess
from pathlib import Path

import pytest

from .test_comfyui_server import COMFYUI_DIR, PYTHON, ROOT, _install_test_conditioning_node, _latent, _run, serve

GGUF_DIR = os.environ.get("GGUF_DIR")

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
    pytest.mark.skipif(not GGUF_DIR or not os.path.isfile(os.path.join(GGUF_DIR or "", "ops.py")),
                       reason="set GGUF_DIR to a checkout of the ComfyUI-GGUF pack (city96/ComfyUI-GGUF) to run the GGUF tests"),
]

#: fp32 compute on CPU ranks, the same GGML layers dequantizing the same bytes per call: the splits reorder sums only
#: (measured ~7e-7 at the rank level, tests/comfyui/test_gguf_ranks.py); a wrong weight or a dropped LoRA gives > 1e-2
BOUND = 1e-5


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    if subprocess.run([PYTHON, "-c", "import gguf"], capture_output=True).returncode:
        pytest.skip("ComfyUI's Python lacks the gguf package (the ComfyUI-GGUF pack's dependency): pip install gguf")
    base = tmp_path_factory.mktemp("comfy_gguf_base")
    (base / "custom_nodes").mkdir()
    os.symlink(ROOT, base / "custom_nodes" / "PatchRay")
    os.symlink(os.path.realpath(GGUF_DIR), base / "custom_nodes" / "ComfyUI-GGUF")
    _install_test_conditioning_node(base / "custom_nodes")
    subprocess.run([PYTHON, str(Path(__file__).with_name("gguf_models.py")), COMFYUI_DIR, str(base / "models")],
                   check=True, timeout=600, cwd=str(base))
    with serve(base) as (url, _proc):
        yield url, base


def _graph(qtype, parallelism, *, lora, sharding="none", ranks=2):
    from .gguf_models import FILES, LORA

    api = {
        "1": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": FILES[qtype]}},
        "2": {"class_type": "ModelSamplingSD3", "inputs": {"shift": 8.0, "model": ["12" if lora else "1", 0]}},
        "3": {"class_type": "PatchRayTestConditioning", "inputs": {"seed": 1, "tokens": 9, "width": 4096, "pooled": 0}},
        "4": {"class_type": "PatchRayTestConditioning", "inputs": {"seed": 2, "tokens": 6, "width": 4096, "pooled": 0}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 48, "height": 72, "length": 9, "batch_size": 1}},
        "7": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": ranks, "device": "cpu", "address": "", "gpu_ids": ""}},
        "20": {"class_type": "PatchRayParallelModel", "inputs": {
            "model": ["2", 0], "cluster": ["7", 0], "preset": "full_sync", "warmup_steps": -1, "refresh_every": -1,
            "k_ratio": 0.25, "block_size": 8, "parallelism": parallelism, "sequence_attention": "auto",
            "balance": "equal", "sharding": sharding}},
    }
    if lora:
        api["12"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "strength_model": 1.0, "lora_name": LORA}}
    common = {"seed": 5, "steps": 3, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
              "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}
    api["6"] = {"class_type": "KSampler", "inputs": dict(common, model=["2", 0])}
    api["8"] = {"class_type": "KSampler", "inputs": dict(common, model=["20", 0])}
    api["9"] = {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "stock"}}
    api["10"] = {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": "parallel"}}
    return api


@pytest.mark.parametrize("qtype, parallelism, lora", [
    ("Q8_0", "sequence", False),
    ("Q4_K", "cfg", True),
    ("Q4_K", "sequence", True),
])
def test_the_stock_ksampler_on_a_parallel_gguf_model_equals_it_on_the_gguf_model(gguf_server, qtype, parallelism, lora):
    url, base = gguf_server
    entry = _run(url, _graph(qtype, parallelism, lora=lora))
    stock, ours = _latent(base, entry, "9"), _latent(base, entry, "10")
    rel = ((ours - stock).norm() / stock.norm()).item()
    print(f"GGUF {qtype} {parallelism}{' + LoRA' if lora else ''} on 2 ranks: KSampler on the Parallel Model vs stock {rel:.2e}")
    assert stock.shape == ours.shape and rel <= BOUND, rel


def test_sharding_blocks_is_refused_for_a_gguf_model_with_the_alternatives(gguf_server):
    url, base = gguf_server
    with pytest.raises(AssertionError, match="sharding=blocks cannot shard a GGUF model.*sharding=none.*fp8 or fp16"):
        _run(url, _graph("Q8_0", "sequence", lora=False, sharding="blocks"))
    log = (base / "server.log").read_text()
    assert "sharding=blocks cannot shard a GGUF model" in log
