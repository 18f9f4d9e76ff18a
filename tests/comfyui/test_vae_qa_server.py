"""Opt-in: a demanding first hour with the VAE nodes in a real ComfyUI server. Inputs that cannot work are refused
in the nodes' own terms (widget names, sizes width x height, never a command-line flag) before anything expensive,
and the next prompt on the same server works.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -q -k vae_qa_server
"""

import re
import time

import pytest

from .test_comfyui_server import COMFYUI_DIR, _run, server  # noqa: F401  (server: the fixture)

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
]

_FLAG = re.compile(r"--[a-z]")


def _cluster(n):
    return {"class_type": "PatchRayCluster", "inputs": {"num_ranks": n, "device": "cpu", "address": "", "gpu_ids": ""}}


def _decode(latent, mode="row", plan=None, precision="fp32"):
    inputs = {"samples": latent, "vae": ["1", 0], "cluster": ["6", 0], "mode": mode, "precision": precision, "gn_sync": False,
              "balance": "equal"}
    if plan:
        inputs["plan"] = plan
    return {"class_type": "PatchRayVAEDecode", "inputs": inputs}


def _prompt(vae, latent, decode, ranks=2, **extra):
    return {"1": {"class_type": "VAELoader", "inputs": {"vae_name": vae}}, "2": latent, "6": _cluster(ranks), "7": decode,
            "8": {"class_type": "PreviewImage", "inputs": {"images": ["7", 0]}}, **extra}


def _empty(width, height):
    return {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}}


def _refused(url, api, *parts):
    with pytest.raises(AssertionError) as info:
        _run(url, api)
    msg = str(info.value)
    assert not _FLAG.search(msg), msg
    for part in parts:
        assert part in msg, msg
    return msg


def test_refusals_read_in_the_nodes_terms_and_the_next_prompt_works(server):  # noqa: F811
    url, _ = server
    ok = _prompt("sdxl_vae.safetensors", _empty(128, 96), _decode(["2", 0]))
    _run(url, ok)  # cluster up: the refusals below are timed without its start
    # tile-runs on an image too small for two tile sizes: the planner's nearest size, as width x height
    _refused(url, _prompt("sdxl_vae.safetensors", _empty(200, 136), _decode(["2", 0], mode="tile-runs")),
             "mode 'tile-runs' cannot tile the 200x136 px image of 'samples'", "use mode 'row'", "at least 256x176 px")
    # the Tile Planner alone
    planner = {"class_type": "PatchRayTilePlanner", "inputs": {"family": "kl", "width": 200, "height": 136, "frames": 1, "ranks": 2,
                                                               "choice": "balanced"}}
    _refused(url, {"3": planner, "8": {"class_type": "PreviewImage", "inputs": {"images": ["3", 1]}}},
             "200x136 px cannot be tiled for 2 rank(s)", "set width to 256 and height to 176")
    # a plan of family kl (8 px per latent) wired to the Wan 2.2 VAE (16) at the same pixel size
    wan22 = {"class_type": "Wan22ImageToVideoLatent", "inputs": {"width": 480, "height": 336, "length": 5, "batch_size": 1, "vae": ["1", 0]}}
    planner = {"class_type": "PatchRayTilePlanner", "inputs": {"family": "kl", "width": 480, "height": 336, "frames": 1, "ranks": 2,
                                                               "choice": "balanced"}}
    _refused(url, _prompt("wan2.2_vae.safetensors", wan22, _decode(["2", 0], mode="tile-runs", plan=["3", 0]), **{"3": planner}),
             "'plan' was made for family kl (8 px per latent)", "set family on the PatchRay Tile Planner node to wan22")
    # an Empty Latent Image at the widgets' limit: ComfyUI's own estimate for its decode is 2.3 TB; refused at once
    t0 = time.monotonic()
    _refused(url, _prompt("sdxl_vae.safetensors", _empty(16384, 16384), _decode(["2", 0])),
             "'samples' is 1 image(s) of 16384x16384 px to decode", "GiB is free")
    assert time.monotonic() - t0 < 60  # the refusal itself is arithmetic; the bound covers loading the VAE on a busy machine
    # more ranks than latent rows (2 rows, 3 ranks)
    _refused(url, _prompt("sdxl_vae.safetensors", _empty(512, 16), _decode(["2", 0]), ranks=3),
             "'samples' has 2 latent rows, fewer than the 3 ranks", "num_ranks")
    _run(url, ok)  # and the server still decodes
