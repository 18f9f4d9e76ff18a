"""Opt-in: PatchRay's nodes against the stock nodes on inputs the other real-server tests do not use, compared as
float tensors (a test-only node saves the IMAGE as float32; SaveImage would round it to 8 bits).

* Distributed VAE Decode / Encode vs VAE Decode / VAE Encode: a 37x29 latent batch of 2 different images (kl), video
  clips whose frames differ, batches of 2 clips (LatentBatch), frame counts 5 and 13, N = 2 and 3, for the KL, Wan 2.1,
  Wan 2.2, HunyuanVideo and LTX-Video 0.9.0 VAEs;
* Distributed KSampler (full_sync) vs KSampler: img2img at denoise 0.6, an inpainting latent (SetLatentNoiseMask), a
  latent batch of 3 on 2 ranks (batch and sequence), noise-dependent samplers (euler_ancestral, dpmpp_2m_sde), cfg 1,
  3 ranks on a 37x29 latent;
* the Cluster node's rank count changed between prompts: exactly the new count of rank processes stays.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -q -k node_parity
"""

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from .test_comfyui_server import COMFYUI_DIR, PYTHON, _get, _latent, _post, _run, server  # noqa: F401  (server: the fixture)

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
]


def _cluster(n):
    return {"class_type": "PatchRayCluster", "inputs": {"num_ranks": n, "device": "cpu", "address": "", "gpu_ids": ""}}


def _image(base, entry, nid):
    from safetensors.torch import load_file

    return load_file(str(base / "output" / entry["outputs"][nid]["tensors"][0]))["image"]


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _vae_prompt(vae, width, height, frames, batch, ranks, tag):
    """Clip A: the test image, its second half mirrored (frames differ); clip B: A inverted. Images (frames 1): a batch
    of the image and its inverted mirror. Stock and PatchRay encode each clip; both decoders take the stock latents."""
    api = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "2": {"class_type": "ImageScale", "inputs": {"image": ["1", 0], "upscale_method": "bilinear", "width": width, "height": height, "crop": "center"}},
        "3": {"class_type": "ImageFlip", "inputs": {"image": ["2", 0], "flip_method": "y-axis: horizontally"}},
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "6": _cluster(ranks),
    }
    if frames > 1:
        k = (frames + 1) // 2
        api["10"] = {"class_type": "RepeatImageBatch", "inputs": {"image": ["2", 0], "amount": k}}
        api["11"] = {"class_type": "RepeatImageBatch", "inputs": {"image": ["3", 0], "amount": frames - k}}
        api["12"] = {"class_type": "ImageBatch", "inputs": {"image1": ["10", 0], "image2": ["11", 0]}}
        api["13"] = {"class_type": "ImageInvert", "inputs": {"image": ["12", 0]}}
        clips = [["12", 0], ["13", 0]][:batch]
    else:
        api["14"] = {"class_type": "ImageInvert", "inputs": {"image": ["3", 0]}}
        api["12"] = {"class_type": "ImageBatch", "inputs": {"image1": ["2", 0], "image2": ["14", 0]}}
        clips = [["12", 0] if batch == 2 else ["2", 0]]
    latents = []
    for i, clip in enumerate(clips):
        api[f"2{i}0"] = {"class_type": "VAEEncode", "inputs": {"pixels": clip, "vae": ["4", 0]}}
        api[f"2{i}1"] = {"class_type": "PatchRayVAEEncode", "inputs": {"pixels": clip, "vae": ["4", 0], "cluster": ["6", 0], "precision": "fp32"}}
        api[f"2{i}2"] = {"class_type": "SaveLatent", "inputs": {"samples": [f"2{i}0", 0], "filename_prefix": f"parity_stock_{tag}_{i}"}}
        api[f"2{i}3"] = {"class_type": "SaveLatent", "inputs": {"samples": [f"2{i}1", 0], "filename_prefix": f"parity_ours_{tag}_{i}"}}
        api[f"2{i}4"] = {"class_type": "PatchRayTestSaveImageTensor", "inputs": {"images": clip, "prefix": f"parity_pixels_{tag}_{i}"}}
        latents.append([f"2{i}0", 0])
    if len(latents) == 2:
        api["30"] = {"class_type": "LatentBatch", "inputs": {"samples1": latents[0], "samples2": latents[1]}}
        latents = [["30", 0]]
    api["31"] = {"class_type": "VAEDecode", "inputs": {"samples": latents[0], "vae": ["4", 0]}}
    api["32"] = {"class_type": "PatchRayVAEDecode", "inputs": {"samples": latents[0], "vae": ["4", 0], "cluster": ["6", 0], "mode": "row",
                                                                "precision": "fp32", "gn_sync": False, "balance": "equal"}}
    api["33"] = {"class_type": "PatchRayTestSaveImageTensor", "inputs": {"images": ["31", 0], "prefix": f"parity_stock_{tag}"}}
    api["34"] = {"class_type": "PatchRayTestSaveImageTensor", "inputs": {"images": ["32", 0], "prefix": f"parity_ours_{tag}"}}
    return api, len(clips)


def _fp64_encode(base, vae, pixels_file):
    """ComfyUI's own VAE Encode of the saved pixels in fp64 (reference_encode.py, ComfyUI's Python)."""
    from safetensors.torch import load_file

    out = pixels_file.with_name(pixels_file.stem + "_fp64.safetensors")
    subprocess.run([PYTHON, str(Path(__file__).with_name("reference_encode.py")), COMFYUI_DIR, str(base / "models" / "vae" / vae),
                    str(pixels_file), "0", "0", "0", str(out)], check=True, timeout=900, cwd=str(base), env=dict(os.environ, OMP_NUM_THREADS="1"))
    return load_file(str(out))["latent"]


@pytest.mark.parametrize("vae, width, height, frames, batch, ranks", [
    ("sdxl_vae.safetensors", 296, 232, 1, 2, 3),   # a 37x29 latent, 2 images, 3 ranks: bands of 10/10/9 rows
    ("ae.safetensors", 296, 232, 1, 2, 2),
    ("wan_2.1_vae.safetensors", 104, 88, 5, 2, 2),  # 13x11 latent rows/columns, 2 clips of 5 frames
    ("wan_2.1_vae.safetensors", 104, 88, 13, 1, 3),
    ("wan2.2_vae.safetensors", 208, 176, 5, 1, 2),
    ("hunyuan_video_vae_bf16.safetensors", 104, 88, 5, 2, 2),
    ("hunyuan_video_vae_bf16.safetensors", 104, 88, 13, 1, 3),
    ("ltxv_090_vae.safetensors", 288, 160, 9, 2, 2),  # 9x5 latent, 2 clips of 9 frames
])
def test_vae_nodes_equal_the_stock_nodes(server, vae, width, height, frames, batch, ranks):  # noqa: F811
    url, base = server
    tag = f"{vae.split('.')[0]}_{width}x{height}x{frames}_b{batch}_n{ranks}"
    api, clips = _vae_prompt(vae, width, height, frames, batch, ranks, tag)
    entry = _run(url, api, timeout_s=900)
    out = entry["outputs"]
    assert "32" not in out or "text" not in out["32"], f"PatchRay fell back to the stock decode: {out['32']}"
    stock, ours = _image(base, entry, "33"), _image(base, entry, "34")
    assert stock.shape == ours.shape and stock.shape[0] == batch * frames
    rel, worst = _rel(ours, stock), (ours - stock).abs().max().item()
    print(f"{tag}: decode relative L2 {rel:.2e}, max abs {worst:.2e}")
    # fp32 both sides; row mode reorders sums only (halo convs, GroupNorm statistics merged in fp64, gathered K/V):
    # measured 1.1e-6 to 3.7e-6 relative, <= 1.9e-5 max abs; a wrong halo, band or batch item gives > 1e-2
    assert rel < 1e-5 and worst < 1 / 255, (rel, worst)
    for i in range(clips):
        stock_z, ours_z = _latent(base, entry, f"2{i}2"), _latent(base, entry, f"2{i}3")
        assert stock_z.shape == ours_z.shape
        rel = _rel(ours_z, stock_z)
        print(f"  encode {i}: relative L2 {rel:.2e}")
        if rel >= 1e-4:
            # the stock fp32 encode of the KL VAEs drifts from the exact result on these smooth images (measured
            # 3.4e-4 and 4.3e-4 from ComfyUI's own fp64 encode; PatchRay's 3.1e-6 to 3.3e-6): then the judge is that
            # fp64 encode of the same pixels
            ref = _fp64_encode(base, vae, base / "output" / f"parity_pixels_{tag}_{i}.safetensors")
            rel_exact, stock_exact = _rel(ours_z, ref), _rel(stock_z, ref)
            print(f"  encode {i} vs ComfyUI's fp64 encode: PatchRay {rel_exact:.2e}, stock fp32 {stock_exact:.2e}")
            assert rel_exact < 1e-4, (rel, rel_exact, stock_exact)


def _rank_processes():
    """This test process's descendants that are PatchRay rank actors (the server is its child, Ray the server's)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "_RankActor" in " ".join(p.cmdline() or [p.name()]):
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _decode_prompt(ranks, size, stock=True):
    api = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": "sdxl_vae.safetensors"}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "3": _cluster(ranks),
        "4": {"class_type": "PatchRayVAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0], "cluster": ["3", 0], "mode": "row",
                                                            "precision": "fp32", "gn_sync": False}},
        "5": {"class_type": "PatchRayTestSaveImageTensor", "inputs": {"images": ["4", 0], "prefix": f"ranks_ours_{ranks}_{size}"}},
    }
    if stock:
        api["6"] = {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}}
        api["7"] = {"class_type": "PatchRayTestSaveImageTensor", "inputs": {"images": ["6", 0], "prefix": f"ranks_stock_{size}"}}
    return api


def _wait_for(predicate, bound_s):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return predicate()


def test_a_new_rank_count_or_a_cancel_leaves_only_the_ranks_in_use(server):  # noqa: F811
    """The Cluster node's num_ranks changed between prompts (2, 3, 1, 2): each prompt decodes as the stock node does and
    exactly that many rank processes stay; Cancel during a decode stops every rank within a bound, and the next prompt
    (another rank count) starts its own and works."""
    url, base = server
    for ranks in (2, 3, 1, 2):
        entry = _run(url, _decode_prompt(ranks, 64))
        rel = _rel(_image(base, entry, "5"), _image(base, entry, "7"))
        assert rel < 1e-5, (ranks, rel)  # fp32 row decode vs the stock decode: measured 3.0e-6 to 3.8e-6
        # the old ranks are stopped before the new ones start (a bounded wait: Ray reaps exiting actors)
        assert _wait_for(lambda: len(_rank_processes()) == ranks, 30), (ranks, _rank_processes())
    status, body = _post(url + "/prompt", {"prompt": _decode_prompt(3, 1024, stock=False), "client_id": uuid.uuid4().hex})
    assert status == 200 and not body.get("node_errors"), body
    pid = body["prompt_id"]
    # the 1024x1024 decode takes minutes on CPU ranks: once three ranks are up it is running
    assert _wait_for(lambda: len(_rank_processes()) == 3, 120), _rank_processes()
    time.sleep(3)
    assert pid not in json.loads(_get(f"{url}/history/{pid}")[1]), "the decode finished before it could be cancelled"
    _post(url + "/interrupt", {})
    assert _wait_for(lambda: pid in json.loads(_get(f"{url}/history/{pid}")[1]), 60), "the cancelled prompt did not end"
    events = [m[0] for m in json.loads(_get(f"{url}/history/{pid}")[1])[pid]["status"]["messages"]]
    assert "execution_interrupted" in events, events
    assert _wait_for(lambda: not _rank_processes(), 30), f"rank processes left after Cancel: {_rank_processes()}"
    _run(url, _decode_prompt(2, 64))
    assert _wait_for(lambda: len(_rank_processes()) == 2, 30), _rank_processes()


def _sampler_prompt(tag, ranks, sampler, parallelism, batch=1, width=96, height=152, denoise=1.0, latent="empty", cfg=5.0):
    """The tiny SD1.x-class checkpoint (make_models.py) through KSampler and Distributed KSampler (full_sync) on the
    same latent: empty, an encoded image (img2img) or that with a noise mask (inpainting: SetLatentNoiseMask with the
    image's red channel, a soft mask)."""
    common = {"seed": 11, "steps": 4, "cfg": cfg, "sampler_name": sampler, "scheduler": "karras", "positive": ["4", 0],
              "negative": ["5", 0], "latent_image": ["6", 0], "denoise": denoise, "model": ["1", 0]}
    api = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd_xl_base_1.0.safetensors"}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red boat", "clip": ["1", 1]}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "7": {"class_type": "KSampler", "inputs": dict(common)},
        "8": _cluster(ranks),
        "10": {"class_type": "PatchRayKSampler", "inputs": dict(common, cluster=["8", 0], preset="full_sync", warmup_steps=-1,
                                                                refresh_every=-1, k_ratio=0.25, block_size=8, parallelism=parallelism)},
        "11": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"parity_stock_{tag}"}},
        "12": {"class_type": "SaveLatent", "inputs": {"samples": ["10", 0], "filename_prefix": f"parity_ours_{tag}"}},
    }
    if latent == "empty":
        api["6"] = {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": height, "batch_size": batch}}
        return api
    api["20"] = {"class_type": "LoadImage", "inputs": {"image": "example.png"}}
    api["21"] = {"class_type": "ImageScale", "inputs": {"image": ["20", 0], "upscale_method": "bilinear", "width": width, "height": height, "crop": "center"}}
    api["22"] = {"class_type": "RepeatImageBatch", "inputs": {"image": ["21", 0], "amount": batch}}
    api["25"] = {"class_type": "VAELoader", "inputs": {"vae_name": "sdxl_vae.safetensors"}}  # the checkpoint has none
    api["6"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["22", 0], "vae": ["25", 0]}}
    if latent == "inpaint":
        api["23"] = {"class_type": "ImageToMask", "inputs": {"image": ["21", 0], "channel": "red"}}
        api["24"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["6", 0], "mask": ["23", 0]}}
        api["7"]["inputs"]["latent_image"] = api["10"]["inputs"]["latent_image"] = ["24", 0]
    return api


@pytest.mark.parametrize("ranks, sampler, parallelism, batch, size, denoise, latent, cfg", [
    (2, "euler_ancestral", "sequence", 1, (104, 152), 0.6, "img2img", 5.0),
    (3, "dpmpp_2m_sde", "sequence", 1, (104, 152), 0.8, "inpaint", 5.0),
    (2, "euler_ancestral", "batch", 3, (96, 152), 1.0, "empty", 5.0),      # 3 latents on 2 ranks: 2 + 1
    (2, "dpmpp_2m_sde", "batch", 3, (104, 152), 0.6, "img2img", 5.0),
    (2, "dpmpp_2m_sde", "sequence", 3, (96, 152), 1.0, "empty", 5.0),
    (2, "euler_ancestral", "cfg", 3, (104, 152), 1.0, "inpaint", 5.0),
    (3, "dpmpp_2m_sde", "sequence", 1, (296, 232), 1.0, "empty", 5.0),    # a 37x29 latent: bands of 10/10/9 rows
    (2, "euler", "cfg", 1, (96, 152), 1.0, "empty", 1.0),                  # cfg 1: runs as sequence, with a note
])
def test_distributed_ksampler_equals_the_stock_ksampler(server, ranks, sampler, parallelism, batch, size, denoise, latent, cfg):  # noqa: F811
    url, base = server
    tag = f"{sampler}_{parallelism}_{ranks}_{batch}_{latent}_{denoise}_{size[0]}x{size[1]}_{cfg}"
    entry = _run(url, _sampler_prompt(tag, ranks, sampler, parallelism, batch, *size, denoise,
                                      "empty" if latent == "empty" else latent.replace("img2img", "img"), cfg))
    stock, ours = _latent(base, entry, "11"), _latent(base, entry, "12")
    assert stock.shape == ours.shape == (batch, 4, size[1] // 8, size[0] // 8)
    rel = _rel(ours, stock)
    print(f"{tag}: relative L2 to the stock KSampler {rel:.2e}")
    # fp32, the same noise (ComfyUI's sampler runs on every rank with the driver's seeded noise; ancestral and SDE
    # noise drawn from the same seed): only sums are reordered; this random-weight UNet's fp32 noise floor is ~1e-5
    # (test_comfyui_server.py); measured 2.8e-8 to 3.7e-7. A lost mask, a wrong batch share or band gives > 1e-2.
    assert rel < 1e-5, rel
    if cfg == 1.0 and parallelism == "cfg":
        assert "cfg = 1 has no unconditional prediction to split" in "\n".join(entry["outputs"]["10"]["text"])


def test_an_ltx_encode_of_a_frame_count_the_stock_encode_refuses_is_refused_too(server):  # noqa: F811
    """13 frames into the LTX-Video VAE: ComfyUI's own encoder raises (1 + 8k frames only); PatchRay refuses in the
    node's terms instead of encoding 9 of them, and the next prompt works."""
    url, _ = server

    def prompt(node, frames):
        return {
            "1": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
            "2": {"class_type": "ImageScale", "inputs": {"image": ["1", 0], "upscale_method": "bilinear", "width": 96, "height": 64, "crop": "center"}},
            "3": {"class_type": "RepeatImageBatch", "inputs": {"image": ["2", 0], "amount": frames}},
            "4": {"class_type": "VAELoader", "inputs": {"vae_name": "ltxv_090_vae.safetensors"}},
            "5": _cluster(2),
            "6": ({"class_type": "VAEEncode", "inputs": {"pixels": ["3", 0], "vae": ["4", 0]}} if node == "stock" else
                  {"class_type": "PatchRayVAEEncode", "inputs": {"pixels": ["3", 0], "vae": ["4", 0], "cluster": ["5", 0], "precision": "fp32"}}),
            "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"ltx_frames_{node}_{frames}"}},
        }

    with pytest.raises(AssertionError, match=r"1 \+ 8 \* x frames"):
        _run(url, prompt("stock", 13))
    with pytest.raises(AssertionError) as refused:
        _run(url, prompt("ours", 13))
    msg = str(refused.value)
    assert "'pixels' has 13 frame(s), but the LTX-Video 0.9.0 VAE encodes 1 + 8k frames" in msg and "give it 9 or 17 frames" in msg, msg
    _run(url, prompt("ours", 9))
