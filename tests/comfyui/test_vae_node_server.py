"""Opt-in: the VAE decode node inside a real ComfyUI server: progress on ComfyUI's progress channel, the fallback
note, and the video-decode workflows checked against the server's /object_info (and run where their files exist).

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -q -k vae_node_server
"""

import asyncio
import json
import uuid

import pytest

from .test_comfyui_server import COMFYUI_DIR, ROOT, _cpu_sized, _get, _run, server  # noqa: F401  (server: the fixture)

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
]

VIDEO_DECODES = {
    "wan22_video_decode": ("vae", "wan2.2_vae.safetensors"),
    "hunyuan_video_decode": ("vae", "hunyuan_video_vae_bf16.safetensors"),
    "ltxv_video_decode": ("checkpoints", "ltx-video-2b-v0.9.safetensors"),
}
_FILE_INPUTS = {"vae_name", "ckpt_name", "image"}


@pytest.mark.parametrize("name", list(VIDEO_DECODES))
def test_video_decode_workflows_use_the_servers_node_names_and_inputs(server, name):  # noqa: F811
    url, _ = server
    info = json.loads(_get(url + "/object_info")[1])
    api = json.loads((ROOT / "workflows" / f"{name}.api.json").read_text())
    for nid, node in api.items():
        spec = info.get(node["class_type"])
        assert spec is not None, f"{name}: node {nid}: the server has no {node['class_type']}"
        declared = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
        for key, value in node["inputs"].items():
            assert key in declared, f"{name}: {node['class_type']} has no input {key!r}"
            options = declared[key][0]
            if isinstance(options, list) and not isinstance(value, list) and key not in _FILE_INPUTS:
                assert value in options, f"{name}: {node['class_type']}.{key}={value!r} not in {options}"
        for key in spec["input"].get("required", {}):
            assert key in node["inputs"], f"{name}: {node['class_type']} lacks required input {key!r}"


@pytest.mark.parametrize("name", list(VIDEO_DECODES))
def test_video_decode_workflow_completes_where_its_file_exists(server, name):  # noqa: F811
    url, base = server
    folder, filename = VIDEO_DECODES[name]
    if not (base / "models" / folder / filename).exists():
        pytest.skip(f"no {folder}/{filename} among the test's model files")
    api = _cpu_sized(json.loads((ROOT / "workflows" / f"{name}.api.json").read_text()))
    outputs = _run(url, api)["outputs"]
    for nid, node in api.items():
        if node["class_type"] == "SaveAnimatedWEBP":
            assert outputs.get(nid, {}).get("images"), f"{name}: no video written"


def _progress_prompt():
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": "sdxl_vae.safetensors"}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}},
        "3": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": 2, "device": "cpu", "address": "", "gpu_ids": ""}},
        "4": {"class_type": "PatchRayVAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0], "cluster": ["3", 0],
                                                            "mode": "row", "precision": "fp32", "gn_sync": False}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["4", 0]}},
    }


async def _queue_and_listen(url: str, prompt: dict, timeout_s: float = 600):
    """Queue ``prompt`` with a websocket open; return the progress messages and the prompt's outcome events."""
    import aiohttp

    client = uuid.uuid4().hex
    progress, events = [], []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={client}") as ws:
            async with session.post(url + "/prompt", json={"prompt": prompt, "client_id": client}) as r:
                body = await r.json()
                assert r.status == 200 and not body.get("node_errors"), body
            pid = body["prompt_id"]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while loop.time() < deadline:
                msg = await ws.receive(timeout=deadline - loop.time())
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                kind, payload = data.get("type"), data.get("data", {})
                if payload.get("prompt_id") not in (None, pid):
                    continue
                if kind == "progress":
                    progress.append(payload)
                elif kind in ("execution_success", "execution_error", "execution_interrupted"):
                    events.append(kind)
                    break
    return progress, events


def test_the_decode_node_advances_comfyuis_progress_bar_per_stage(server):  # noqa: F811
    url, _ = server
    _run(url, _progress_prompt())  # cluster up and weights on the ranks: the timed run below is the decode alone
    prompt = _progress_prompt()
    prompt["2"]["inputs"].update(width=512, height=512)  # a few seconds on CPU ranks: several polls of rank 0
    progress, events = asyncio.run(_queue_and_listen(url, prompt))
    assert events == ["execution_success"], events
    ours = [(p["value"], p["max"]) for p in progress if p.get("node") == "4"]
    # stages as rank 0 finished them (more than start and end), never going back, then the bar filled
    assert len(ours) > 2, ours
    fractions = [v / m for v, m in ours]
    assert fractions[-1] == 1.0 and 0 < fractions[0] < 1
    assert [v for v, _ in ours[:-1]] == sorted(v for v, _ in ours[:-1])


def test_an_unsupported_vae_completes_with_the_note_on_the_node(server):  # noqa: F811
    """A VAE PatchRay leaves to ComfyUI (a latent-preview TAESD decoder, written here with random weights)."""
    import subprocess

    from .test_comfyui_server import PYTHON

    url, base = server
    approx = base / "models" / "vae_approx"
    script = (
        "import sys, torch; comfy_dir, out = sys.argv[1:3]; sys.path.insert(0, comfy_dir); sys.argv = sys.argv[:1] + ['--cpu'];"
        "import comfy.options; comfy.options.enable_args_parsing();"
        "from comfy.taesd.taesd import Encoder, Decoder; from safetensors.torch import save_file;"
        "g = torch.Generator().manual_seed(0);"
        "[save_file({k: torch.randn(v.shape, generator=g) * 0.05 for k, v in m().state_dict().items()}, f'{out}/{n}.safetensors')"
        " for n, m in (('taesd_encoder', Encoder), ('taesd_decoder', Decoder))]"
    )
    approx.mkdir(parents=True, exist_ok=True)
    subprocess.run([PYTHON, "-c", script, COMFYUI_DIR, str(approx)], check=True, timeout=300, cwd=str(base))
    prompt = _progress_prompt()
    prompt["1"]["inputs"]["vae_name"] = "taesd"
    prompt["2"]["inputs"].update(width=64, height=64)
    outputs = _run(url, prompt)["outputs"]
    note = " ".join(outputs["4"]["text"])
    assert "cannot shard" in note and "used ComfyUI's own single-device decode" in note and "PatchRay shards:" in note
    assert outputs["5"]["images"]
