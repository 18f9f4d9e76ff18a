"""Opt-in: LTX-Video 0.9.5+ (timestep-conditioned decoder) through PatchRay against ComfyUI's own VAE, in process.

ComfyUI's ``VideoVAE.decode`` mixes fresh noise from the global RNG into the latent before a timestep-conditioned
decode (``randn_like(x) * 0.025 + 0.975 * x``), so two stock decodes of one latent differ; through the server the
stock node and PatchRay's never see the same RNG state. Here, in ComfyUI's own Python, the VAE is loaded exactly as
the loaders do (``comfy.utils.load_torch_file`` + ``comfy.sd.VAE``, with the config the file carries), the global RNG is seeded the same
before the stock decode (``VAE.decode``, what VAE Decode calls) and before PatchRay's decode (the node's bridge call,
CPU ranks on an embedded Ray), and the two must agree within one 8-bit level; a negative control without the seed
must not. Run with ComfyUI's Python:

    COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/python -m pytest -q -s tests/comfyui/test_comfyui_ltx_decode_noise.py
"""

import json
import os
import sys
from pathlib import Path

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout (and run with its Python)"),
]

ROOT = Path(__file__).resolve().parents[2]
FRAMES, HEIGHT, WIDTH = 33, 160, 224  # 5 x 5 x 7 latent: odd rows, uneven bands at 2 and 3 ranks


@pytest.fixture(scope="module")
def comfy_vae(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ltx")
    (tmp / "pkg").mkdir()
    os.symlink(ROOT, tmp / "pkg" / "patchray")  # the pack as the importable package ``patchray``
    sys.path.insert(0, str(tmp / "pkg"))
    sys.path.insert(0, COMFYUI_DIR)
    saved_argv = sys.argv
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch
    from safetensors.torch import save_file

    import comfy.sd
    import comfy.utils

    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    sys.argv = saved_argv
    sys.path.insert(0, str(Path(__file__).parent))
    from make_layout_fixtures import _ltx_config
    from make_models import _init_varied

    # ComfyUI's version-2 (0.9.5 / 0.9.7 / 0.9.8) blocks with one resnet per stack, written with its config in the
    # file's metadata, the way LTX-Video files carry it: the full-size file (1.2 B parameters) would need ~20 GB for
    # the stock VAE plus three CPU ranks in fp32. Every block type, width and option of the released VAE is kept.
    config = _ltx_config(VideoVAE, 2)
    path = str(tmp / "ltxv_095_small_vae.safetensors")
    weights = _init_varied(VideoVAE(config=config), 10).state_dict()
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in weights.items()}, path,
              metadata={"config": json.dumps({"vae": config})})
    del weights
    sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    vae = comfy.sd.VAE(sd=sd, metadata=metadata)  # what ComfyUI's loaders do with a file that carries its config
    vae.throw_exception_if_invalid()
    yield vae, str(tmp / "pkg")
    from patchray.distributed.cluster import shutdown_cluster

    shutdown_cluster(stop_ray=True)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ltx_095_decode_and_encode_match_comfyui(comfy_vae, ranks):
    import torch

    from patchray.distributed.cluster import ClusterConfig
    from patchray.nodes.bridge import vae as bridge

    vae, pkg = comfy_vae
    assert vae.first_stage_model.timestep_conditioning and vae.latent_channels == 128  # ComfyUI's version 2
    cluster = ClusterConfig(num_ranks=ranks, device="cpu", extra_pythonpath=(pkg,))
    z = torch.randn((1, 128, (FRAMES - 1) // 8 + 1, HEIGHT // 32, WIDTH // 32), generator=torch.Generator().manual_seed(3))

    torch.manual_seed(11)
    stock = vae.decode(z)  # VAE Decode: vae.decode(samples["samples"]), then the frames become the batch
    stock = stock.reshape(-1, *stock.shape[-3:])
    torch.manual_seed(11)
    result = bridge.decode({"samples": z}, vae, cluster, mode="row", precision="fp32")
    assert result.note is None, result.note
    ours = result.value
    assert ours.shape == stock.shape == (FRAMES, HEIGHT, WIDTH, 3)
    diff = (ours - stock).abs().max().item()
    print(f"LTX-Video 0.9.5 {WIDTH}x{HEIGHT}x{FRAMES}, {ranks} ranks: max abs pixel difference {diff:.2e} ({diff * 255:.3f} levels)")
    assert diff <= 1 / 255
    # negative control: another noise draw moves pixels by far more than a level, so the match above is not vacuous
    other = bridge.decode({"samples": z}, vae, cluster, mode="row", precision="fp32").value
    assert (other - stock).abs().max().item() > 4 / 255

    pixels = (stock[:FRAMES] * 0.8 + 0.1).contiguous()
    stock_z = vae.encode(pixels)
    ours_z = bridge.encode(pixels, vae, cluster, precision="fp32").value["samples"]
    rel = ((ours_z - stock_z).norm() / stock_z.norm()).item()
    print(f"  encode: relative L2 to the stock VAE Encode {rel:.2e}")
    assert ours_z.shape == stock_z.shape and rel < 1e-4
