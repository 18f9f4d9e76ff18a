"""Write workflows/<name>.json (UI format, what users drag in) and workflows/<name>.api.json (API format).

Both forms come from one description per workflow below, so they agree by construction; the tests in
tests/nodes/test_workflows.py check that independently (UI -> API conversion, link types, known node types).
The ``template_*`` workflows are ComfyUI's own templates with the PatchRay nodes added: template_workflows.py makes
them from the installed ``comfyui-workflow-templates`` package (without it this script says so and exits 1 after
writing the others). Run: ``python tests/comfyui/build_workflows.py``.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workflow_tools import ROOT, TITLE_HEIGHT, min_node_size, node_info, widget_text_width  # noqa: E402

OUT = ROOT / "workflows"

CLUSTER = ("PatchRayCluster", {"num_ranks": 2, "device": "auto", "address": "", "gpu_ids": ""})


def _nodes_sdxl():
    return {
        1: ("CheckpointLoaderSimple", {"ckpt_name": "sd_xl_base_1.0.safetensors"}),
        2: ("CLIPTextEncode", {"text": "a lighthouse on a rocky coast at dawn, volumetric light, highly detailed", "clip": (1, 1)}),
        3: ("CLIPTextEncode", {"text": "blurry, low quality", "clip": (1, 1)}),
        4: ("EmptyLatentImage", {"width": 1024, "height": 1024, "batch_size": 1}),
        5: ("PatchRayKSampler", {"model": (1, 0), "seed": 42, "steps": 25, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
                                 "positive": (2, 0), "negative": (3, 0), "latent_image": (4, 0), "denoise": 1.0, "cluster": (7, 0),
                                 "preset": "otil", "warmup_steps": -1, "refresh_every": -1, "k_ratio": 0.25, "block_size": 8,
                                 "parallelism": "auto", "sequence_attention": "auto"}),
        6: ("VAELoader", {"vae_name": "sdxl_vae.safetensors"}),
        7: CLUSTER,
        8: ("PatchRayVAEDecode", {"samples": (5, 0), "vae": (6, 0), "cluster": (7, 0), "mode": "auto", "precision": "auto", "gn_sync": False}),
        9: ("SaveImage", {"images": (8, 0), "filename_prefix": "PatchRay_sdxl"}),
    }


def _nodes_flux():
    return {
        1: ("LoadImage", {"image": "example.png"}),
        2: ("ImageScale", {"image": (1, 0), "upscale_method": "lanczos", "width": 1024, "height": 1024, "crop": "center"}),
        3: ("VAELoader", {"vae_name": "ae.safetensors"}),
        4: ("VAEEncode", {"pixels": (2, 0), "vae": (3, 0)}),
        5: CLUSTER,
        6: ("PatchRayTilePlanner", {"family": "kl", "width": 1024, "height": 1024, "frames": 1, "ranks": 2, "choice": "balanced"}),
        7: ("PatchRayVAEDecode", {"samples": (4, 0), "vae": (3, 0), "cluster": (5, 0), "mode": "tile-runs", "precision": "auto",
                                  "gn_sync": True, "plan": (6, 0)}),
        8: ("SaveImage", {"images": (7, 0), "filename_prefix": "PatchRay_flux"}),
        9: ("PreviewImage", {"images": (6, 1)}),
    }


def _nodes_wan():
    return {
        1: ("LoadImage", {"image": "example.png"}),
        2: ("ImageScale", {"image": (1, 0), "upscale_method": "lanczos", "width": 832, "height": 480, "crop": "center"}),
        3: ("RepeatImageBatch", {"image": (2, 0), "amount": 17}),
        4: ("VAELoader", {"vae_name": "wan_2.1_vae.safetensors"}),
        5: CLUSTER,
        6: ("PatchRayVAEEncode", {"pixels": (3, 0), "vae": (4, 0), "cluster": (5, 0), "precision": "auto"}),
        7: ("PatchRayVAEDecode", {"samples": (6, 0), "vae": (4, 0), "cluster": (5, 0), "mode": "row", "precision": "auto", "gn_sync": False}),
        8: ("SaveAnimatedWEBP", {"images": (7, 0), "filename_prefix": "PatchRay_wan", "fps": 16.0, "lossless": False, "quality": 85, "method": "default"}),
    }


def _nodes_topology():
    return {
        1: CLUSTER,
        2: ("PatchRayTopologyProbe", {"measure": True, "cluster": (1, 0)}),
        3: ("PreviewImage", {"images": (2, 0)}),
    }


def _nodes_bench():
    return {
        1: CLUSTER,
        2: ("PatchRayBenchmark", {"cluster": (1, 0), "family": "kl", "shape": "auto", "size": "auto", "half": "decoder", "iters": 2}),
        3: ("PreviewImage", {"images": (2, 1)}),
    }


def _video_round_trip(vae_loader: tuple, vae_slot: int, width: int, height: int, frames: int, prefix: str, fps: float):
    """Image -> frames -> PatchRay encode -> PatchRay decode (auto mode) -> animated WEBP, with a stock VAE loader.

    The encode stands in for a sampler: users connect their sampler's LATENT to the decode's ``samples``.
    """
    return {
        1: ("LoadImage", {"image": "example.png"}),
        2: ("ImageScale", {"image": (1, 0), "upscale_method": "lanczos", "width": width, "height": height, "crop": "center"}),
        3: ("RepeatImageBatch", {"image": (2, 0), "amount": frames}),
        4: vae_loader,
        5: CLUSTER,
        6: ("PatchRayVAEEncode", {"pixels": (3, 0), "vae": (4, vae_slot), "cluster": (5, 0), "precision": "auto"}),
        7: ("PatchRayVAEDecode", {"samples": (6, 0), "vae": (4, vae_slot), "cluster": (5, 0), "mode": "auto", "precision": "auto",
                                  "gn_sync": False}),
        8: ("SaveAnimatedWEBP", {"images": (7, 0), "filename_prefix": prefix, "fps": fps, "lossless": False, "quality": 85,
                                 "method": "default"}),
    }


def _nodes_wan22():
    # Wan 2.2 TI2V 5B's own size and length (ComfyUI's template): 1280x704, 121 frames at 24 fps
    return _video_round_trip(("VAELoader", {"vae_name": "wan2.2_vae.safetensors"}), 0, 1280, 704, 121, "PatchRay_wan22", 24.0)


def _nodes_hunyuan_video():
    # HunyuanVideo's template size and length: 848x480, 73 frames at 24 fps
    return _video_round_trip(("VAELoader", {"vae_name": "hunyuan_video_vae_bf16.safetensors"}), 0, 848, 480, 73,
                             "PatchRay_hunyuan_video", 24.0)


def _nodes_ltxv():
    # LTX-Video's VAE ships inside its checkpoint: the checkpoint loader's third output; template size 768x512, 97 frames
    return _video_round_trip(("CheckpointLoaderSimple", {"ckpt_name": "ltx-video-2b-v0.9.safetensors"}), 2, 768, 512, 97,
                             "PatchRay_ltxv", 24.0)


_VIDEO_NOTE_TAIL = (
    "\n\n*Load Image -> Repeat* and **Distributed VAE Encode** stand in for a sampler: connect your sampler's LATENT to "
    "the decode's `samples`. Mode *auto* decodes in exact row mode (each rank a band of rows, halos and statistics "
    "exchanged) unless the GPUs' links favour whole tiles (*tile-runs*); if a rank runs out of memory the node retries in row-tiled mode and says so on the node. A VAE this "
    "PatchRay version cannot shard is decoded by ComfyUI's own decode, with a note on the node listing what PatchRay covers."
)

NOTES = {
    "sdxl_otil_txt2img": (
        "## PatchRay: SDXL text-to-image, OTIL patch-parallel sampling and a distributed decode\n\n"
        "**PatchRay Distributed KSampler** runs ComfyUI's own sampler on every rank of **PatchRay Cluster** (one rank per GPU); "
        "each rank's UNet computes one band of latent rows. Preset *otil*: 4 exact warm-up steps, then stale neighbour data "
        "and only the top-k most-changed latent blocks exchanged per step, refreshed every 10 steps. *full_sync* gives the "
        "stock KSampler's result exactly. **Distributed VAE Decode** then decodes on the same ranks (mode *auto*: exact row "
        "decoding when the GPU links allow it, else tiles).\n\n"
        "Files: `models/checkpoints/sd_xl_base_1.0.safetensors`, `models/vae/sdxl_vae.safetensors`."
    ),
    "flux_distributed_decode": (
        "## PatchRay: FLUX.1 VAE, tiled distributed decode\n\n"
        "**Tile Planner** plans tiles for 1024x1024 on 2 ranks (preview: each rank's tiles in its colour) and feeds the plan "
        "to **Distributed VAE Decode** in *tile-runs* mode with GroupNorm sync. Replace *Load Image -> VAE Encode* by your FLUX "
        "sampler's LATENT.\n\nFile: `models/vae/ae.safetensors`."
    ),
    "wan_video_row_decode": (
        "## PatchRay: Wan 2.1 video VAE, row-sharded encode and decode\n\n"
        "17 frames at 832x480 are encoded and decoded in *row* mode: each rank holds a band of rows; halos, GroupNorm "
        "statistics and attention are exchanged, so the result equals the single-GPU decode. Replace the encode by your Wan "
        "sampler's LATENT.\n\nFile: `models/vae/wan_2.1_vae.safetensors`."
    ),
    "topology_probe": (
        "## PatchRay: GPU topology probe\n\n"
        "Shows how the GPUs are connected (NVLink / PCIe switch / host bridge / cross-socket), whether peer-to-peer works, "
        "measured copy bandwidths, the cluster check, and advice (NCCL settings, decode mode, OTIL preset)."
    ),
    "vae_benchmark": (
        "## PatchRay: VAE decode benchmark\n\n"
        "Benchmarks the single-device decode, row mode and tile plans on the cluster's ranks. The report JSON and chart are "
        "saved to `output/patchray/`; the table shows on the node, the chart in Preview Image.\n\n"
        "*shape* and *size* on **auto** fit the device: with CPU ranks a quick suite (192x192, the tiny model: seconds); "
        "with GPU ranks the full kl decoder at 1024x1024. Set them (e.g. `1920x1080`, *full*) to measure your own case; "
        "the progress bar counts the cases."
    ),
}

NOTES.update({
    "wan22_video_decode": (
        "## PatchRay: Wan 2.2 video VAE, distributed decode\n\n"
        "Wan 2.2's VAE (48 latent channels, 16x spatial, used by the TI2V 5B model) at 1280x704, 121 frames, on the ranks "
        "of **PatchRay Cluster**. **Meant for GPU ranks**: on CPU ranks (device *cpu*, or *auto* on a machine without "
        "GPUs) it fits in memory but encodes and decodes for hours at this size; to try it on CPU, lower *amount* on "
        "**Repeat Image Batch** (e.g. 5 frames) and the size on **Image Scale** (e.g. 320x176)." + _VIDEO_NOTE_TAIL + "\n\n"
        "**Download** [wan2.2_vae.safetensors](https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/"
        "split_files/vae/wan2.2_vae.safetensors) and put it in `ComfyUI/models/vae/wan2.2_vae.safetensors`."
    ),
    "hunyuan_video_decode": (
        "## PatchRay: HunyuanVideo VAE, distributed decode\n\n"
        "HunyuanVideo's 3-D VAE (16 latent channels, 8x spatial, 4x temporal) at 848x480, 73 frames. It decodes the whole "
        "clip at once (as ComfyUI's own decode does), so it needs far more memory than the other video VAEs: above 30 GiB "
        "per rank at this size on 2 ranks (estimated from H200 measurements); on smaller GPUs the row-tiled retry takes "
        "over. **Meant for GPU ranks**: on CPU ranks (device *cpu*, or *auto* on a machine without GPUs) this size needs "
        "about 122 GiB of the machine's memory for the decode (50 GiB for the encode), counted from ComfyUI's own "
        "estimate, and the nodes refuse it before any rank starts, "
        "naming the frame count that fits (lower *amount* on **Repeat Image Batch**, or the size on **Image Scale**)."
        + _VIDEO_NOTE_TAIL + "\n\n"
        "**Download** [hunyuan_video_vae_bf16.safetensors](https://huggingface.co/Comfy-Org/HunyuanVideo_repackaged/resolve/"
        "main/split_files/vae/hunyuan_video_vae_bf16.safetensors) and put it in "
        "`ComfyUI/models/vae/hunyuan_video_vae_bf16.safetensors`."
    ),
    "ltxv_video_decode": (
        "## PatchRay: LTX-Video VAE, distributed decode\n\n"
        "LTX-Video's VAE (128 latent channels, 32x spatial, 8x temporal) at 768x512, 97 frames. Its VAE ships inside the "
        "model checkpoint: **Load Checkpoint**'s VAE output feeds the PatchRay nodes." + _VIDEO_NOTE_TAIL + "\n\n"
        "**Download** [ltx-video-2b-v0.9.safetensors](https://huggingface.co/Lightricks/LTX-Video/resolve/main/"
        "ltx-video-2b-v0.9.safetensors) (or a later LTX-Video checkpoint, then pick it in Load Checkpoint: 0.9.5 and later "
        "shard too; 0.9.1's VAE, which adds fresh noise inside its decoder, is decoded by ComfyUI's own decode) and put it "
        "in `ComfyUI/models/checkpoints/`."
    ),
})

WORKFLOWS = {
    "sdxl_otil_txt2img": _nodes_sdxl,
    "flux_distributed_decode": _nodes_flux,
    "wan_video_row_decode": _nodes_wan,
    "topology_probe": _nodes_topology,
    "vae_benchmark": _nodes_bench,
    "wan22_video_decode": _nodes_wan22,
    "hunyuan_video_decode": _nodes_hunyuan_video,
    "ltxv_video_decode": _nodes_ltxv,
}


#: space between nodes: horizontally, and vertically below a node's body before the next one's title bar
GAP_X, GAP_Y = 60, 50


def layout(ui_nodes: list, links: list, note: dict) -> int:
    """Place nodes left to right by dependency depth, stacked in columns; the note above them, as wide as they are.

    Sizes come from :func:`workflow_tools.min_node_size` (what the frontend needs to show every widget and panel), so
    nothing is enlarged by the frontend into a neighbour; the test in tests/nodes/test_workflows.py checks it.
    """
    by_id = {n["id"]: n for n in ui_nodes}
    depth = {nid: 0 for nid in by_id}
    for _ in range(len(by_id)):  # longest path from a source; links point from earlier to later columns
        for _lid, src, _slot, dst, _dslot, _t in links:
            depth[dst] = max(depth[dst], depth[src] + 1)
    columns = {}
    for nid in sorted(by_id, key=lambda i: (depth[i], by_id[i]["order"])):
        columns.setdefault(depth[nid], []).append(by_id[nid])
    top = 40 + TITLE_HEIGHT + note["size"][1] + GAP_Y + TITLE_HEIGHT
    x = 40
    for d in sorted(columns):
        y = top
        for n in columns[d]:
            n["pos"] = [x, y]
            y += n["size"][1] + GAP_Y + TITLE_HEIGHT
        x += max(n["size"][0] for n in columns[d]) + GAP_X
    note["pos"] = [40, 40 + TITLE_HEIGHT]
    note["size"][0] = max(720, min(1400, x - GAP_X - 40))
    return x  # the layout's right edge
# ------------------------------------------------------------------------------ Distributed KSampler on DiTs


def _nodes_flux_txt2img():
    return {
        1: ("UNETLoader", {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}),
        2: ("DualCLIPLoader", {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors", "type": "flux", "device": "default"}),
        3: ("CLIPTextEncode", {"text": "a lighthouse on a rocky coast at dawn, volumetric light, highly detailed", "clip": (2, 0)}),
        4: ("FluxGuidance", {"conditioning": (3, 0), "guidance": 3.5}),
        5: ("CLIPTextEncode", {"text": "", "clip": (2, 0)}),
        6: ("EmptySD3LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}),
        7: CLUSTER,
        8: ("PatchRayKSampler", {"model": (1, 0), "seed": 42, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                                 "positive": (4, 0), "negative": (5, 0), "latent_image": (6, 0), "denoise": 1.0, "cluster": (7, 0),
                                 "preset": "full_sync", "warmup_steps": -1, "refresh_every": -1, "k_ratio": 0.25, "block_size": 8,
                                 "parallelism": "auto", "sequence_attention": "auto"}),
        9: ("VAELoader", {"vae_name": "ae.safetensors"}),
        10: ("PatchRayVAEDecode", {"samples": (8, 0), "vae": (9, 0), "cluster": (7, 0), "mode": "auto", "precision": "auto", "gn_sync": False}),
        11: ("SaveImage", {"images": (10, 0), "filename_prefix": "PatchRay_flux_txt2img"}),
    }


def _nodes_wan_txt2video(unet, vae, latent, steps, cfg, shift, fps):
    return {
        1: ("UNETLoader", {"unet_name": unet, "weight_dtype": "default"}),
        2: ("ModelSamplingSD3", {"model": (1, 0), "shift": shift}),
        3: ("CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "default"}),
        4: ("CLIPTextEncode", {"text": "a red fox running through fresh snow in a pine forest, morning light, cinematic", "clip": (3, 0)}),
        5: ("CLIPTextEncode", {"text": "blurry, static, low quality, distorted", "clip": (3, 0)}),
        6: ("VAELoader", {"vae_name": vae}),
        7: latent,
        8: CLUSTER,
        9: ("PatchRayKSampler", {"model": (2, 0), "seed": 42, "steps": steps, "cfg": cfg, "sampler_name": "uni_pc", "scheduler": "simple",
                                 "positive": (4, 0), "negative": (5, 0), "latent_image": (7, 0), "denoise": 1.0, "cluster": (8, 0),
                                 "preset": "full_sync", "warmup_steps": -1, "refresh_every": -1, "k_ratio": 0.25, "block_size": 8,
                                 "parallelism": "auto", "sequence_attention": "auto"}),
        10: ("PatchRayVAEDecode", {"samples": (9, 0), "vae": (6, 0), "cluster": (8, 0), "mode": "row", "precision": "auto", "gn_sync": False}),
        11: ("SaveAnimatedWEBP", {"images": (10, 0), "filename_prefix": "PatchRay_wan_txt2video", "fps": fps, "lossless": False, "quality": 85, "method": "default"}),
    }


def _nodes_wan21_txt2video():
    latent = ("EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": 81, "batch_size": 1})
    return _nodes_wan_txt2video("wan2.1_t2v_14B_fp16.safetensors", "wan_2.1_vae.safetensors", latent, 30, 6.0, 8.0, 16.0)


def _nodes_wan22_txt2video():
    latent = ("Wan22ImageToVideoLatent", {"vae": (6, 0), "width": 1280, "height": 704, "length": 121, "batch_size": 1})
    return _nodes_wan_txt2video("wan2.2_ti2v_5B_fp16.safetensors", "wan2.2_vae.safetensors", latent, 30, 5.0, 8.0, 24.0)


def _nodes_wan22_14b_txt2video():
    """Wan 2.2 14B text-to-video: the high-noise expert runs the first half of the schedule, the low-noise expert the
    second, each on a Distributed KSampler (Advanced), as ComfyUI's own template chains two KSampler (Advanced)."""
    def advanced(model, add_noise, start, end, leftover, latent):
        return ("PatchRayKSamplerAdvanced", {
            "model": model, "add_noise": add_noise, "noise_seed": 42, "steps": 20, "cfg": 3.5, "sampler_name": "euler",
            "scheduler": "simple", "positive": (5, 0), "negative": (6, 0), "latent_image": latent, "start_at_step": start,
            "end_at_step": end, "return_with_leftover_noise": leftover, "cluster": (9, 0), "preset": "full_sync",
            "warmup_steps": -1, "refresh_every": -1, "k_ratio": 0.25, "block_size": 8, "parallelism": "auto",
            "sequence_attention": "auto", "sharding": "auto"})

    return {
        1: ("UNETLoader", {"unet_name": "wan2.2_t2v_high_noise_14B_fp16.safetensors", "weight_dtype": "fp8_e4m3fn"}),
        2: ("UNETLoader", {"unet_name": "wan2.2_t2v_low_noise_14B_fp16.safetensors", "weight_dtype": "fp8_e4m3fn"}),
        3: ("ModelSamplingSD3", {"model": (1, 0), "shift": 8.0}),
        4: ("ModelSamplingSD3", {"model": (2, 0), "shift": 8.0}),
        5: ("CLIPTextEncode", {"text": "a red fox running through fresh snow in a pine forest, morning light, cinematic", "clip": (7, 0)}),
        6: ("CLIPTextEncode", {"text": "blurry, static, low quality, distorted", "clip": (7, 0)}),
        7: ("CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "default"}),
        8: ("EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": 81, "batch_size": 1}),
        9: CLUSTER,
        10: advanced((3, 0), "enable", 0, 10, "enable", (8, 0)),
        11: advanced((4, 0), "disable", 10, 10000, "disable", (10, 0)),
        12: ("VAELoader", {"vae_name": "wan_2.1_vae.safetensors"}),
        13: ("PatchRayVAEDecode", {"samples": (11, 0), "vae": (12, 0), "cluster": (9, 0), "mode": "row", "precision": "auto", "gn_sync": False}),
        14: ("SaveAnimatedWEBP", {"images": (13, 0), "filename_prefix": "PatchRay_wan22_14b_txt2video", "fps": 16.0, "lossless": False, "quality": 85, "method": "default"}),
    }


_DIT_SAMPLER_NOTE = (
    "**PatchRay Distributed KSampler** runs ComfyUI's own sampler on every rank of **PatchRay Cluster**. *parallelism* "
    "*auto* picks, per run: *batch* when the batch divides over the ranks; *cfg* (cond on one rank, uncond on the other, "
    "one exchange per step) when cfg > 1 on 2 ranks, *cfg+sequence* on 4, 6, 8; else *sequence* (each rank a band of latent "
    "rows, all frames, as tokens; attention over every token by *sequence_attention*: *gathered* K/V, *overlapped* (the "
    "same gather while the rank attends to its own keys), *ring* (the K/V one peer at a time, each attended while the "
    "next travels), *ulysses* (all-to-all over heads), or *auto*, which picks per layer and on NCCL hides the gather: "
    "overlapped at 2 ranks, ring from 3; the node's text names the mode that ran). Every mode gives the stock "
    "KSampler's result (fp32: within 1e-5)."
)
DIT_NOTES = {
    "flux_txt2img_distributed": (
        "## PatchRay: FLUX.1 dev text-to-image, Distributed KSampler and Distributed VAE Decode\n\n" + _DIT_SAMPLER_NOTE +
        " FLUX dev is guidance-distilled (cfg 1, **FluxGuidance** 3.5): there is no uncond to split, so *auto* runs *sequence* over "
        "all ranks. fp8 weights: set the loader's *weight_dtype* to fp8_e4m3fn. **Distributed VAE Decode** then decodes on the "
        "same ranks.\n\nFiles: `models/diffusion_models/flux1-dev.safetensors`, `models/text_encoders/clip_l.safetensors`, "
        "`models/text_encoders/t5xxl_fp16.safetensors`, `models/vae/ae.safetensors`."
    ),
    "wan21_txt2video_distributed": (
        "## PatchRay: Wan 2.1 text-to-video (14B), Distributed KSampler and Distributed VAE Decode\n\n" + _DIT_SAMPLER_NOTE +
        " With cfg 6 on 2 ranks *auto* is *cfg*; on 4 ranks *cfg+sequence*. **Distributed VAE Decode** in *row* mode decodes the "
        "81 frames with each rank holding a band of rows (exact).\n\nFiles: `models/diffusion_models/wan2.1_t2v_14B_fp16.safetensors` "
        "(or `wan2.1_t2v_1.3B_fp16.safetensors`), `models/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors`, "
        "`models/vae/wan_2.1_vae.safetensors`."
    ),
    "wan22_txt2video_distributed": (
        "## PatchRay: Wan 2.2 5B text-to-video, Distributed KSampler and Distributed VAE Decode\n\n" + _DIT_SAMPLER_NOTE +
        " **Wan22ImageToVideoLatent** makes the 48-channel latent (connect a start image for image-to-video: the first frame is "
        "then kept and the model gets per-frame timesteps, which the sequence split keeps). **Distributed VAE Decode** shards the "
        "Wan 2.2 VAE in *row* mode (exact).\n\nFiles: "
        "`models/diffusion_models/wan2.2_ti2v_5B_fp16.safetensors`, `models/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors`, "
        "`models/vae/wan2.2_vae.safetensors`."
    ),
    "wan22_14b_txt2video_distributed": (
        "## PatchRay: Wan 2.2 14B text-to-video (two experts), Distributed KSampler (Advanced) and Distributed VAE Decode\n\n"
        "Wan 2.2 14B is two models: a high-noise expert for the first steps and a low-noise expert for the rest. Two "
        "**PatchRay Distributed KSampler (Advanced)** nodes chain them as two stock KSampler (Advanced) nodes would: the "
        "first adds the noise, runs steps 0-9 of 20 and returns the leftover noise; the second adds none and runs steps "
        "10-19. " + _DIT_SAMPLER_NOTE + " With cfg 3.5 on 2 ranks *auto* is *cfg*; on 4 ranks *cfg+sequence*. The ranks keep "
        "one model, so every prompt ships each expert to them once. The loaders cast the fp16 files to fp8 "
        "(*weight_dtype* fp8_e4m3fn; PatchRay refuses ComfyUI's *scaled* fp8 files), and *sharding* *auto* splits the "
        "experts' blocks over the ranks when a whole one does not fit a card. The 14B models use the Wan 2.1 VAE, which "
        "**Distributed VAE Decode** shards in *row* mode (exact).\n\nFiles: "
        "`models/diffusion_models/wan2.2_t2v_high_noise_14B_fp16.safetensors`, "
        "`models/diffusion_models/wan2.2_t2v_low_noise_14B_fp16.safetensors`, "
        "`models/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors`, `models/vae/wan_2.1_vae.safetensors`."
    ),
}
DIT_WORKFLOWS = {
    "flux_txt2img_distributed": _nodes_flux_txt2img,
    "wan21_txt2video_distributed": _nodes_wan21_txt2video,
    "wan22_txt2video_distributed": _nodes_wan22_txt2video,
    "wan22_14b_txt2video_distributed": _nodes_wan22_14b_txt2video,
}
NOTES.update(DIT_NOTES)
WORKFLOWS.update(DIT_WORKFLOWS)


#: widgets every workflow leaves at their defaults, filled in for every node of the type
WIDGET_DEFAULTS = {
    "PatchRayVAEDecode": {"balance": "equal"},
    "PatchRayVAEEncode": {"balance": "equal"},
    "PatchRayKSampler": {"balance": "equal", "sharding": "none"},
    "PatchRayKSamplerAdvanced": {"balance": "equal", "sharding": "none"},
}


def build(name: str, nodes: dict, info: dict):
    nodes = {nid: (t, {**WIDGET_DEFAULTS.get(t, {}), **values}) for nid, (t, values) in nodes.items()}
    api, ui_nodes, links = {}, [], []
    out_links = {}
    note_id = max(nodes) + 1
    for order, (nid, (t, values)) in enumerate(sorted(nodes.items())):
        spec = info[t]
        api_inputs, sockets, widgets = {}, [], []
        for inp in spec["inputs"]:
            v = values.get(inp["name"])
            if isinstance(v, tuple):
                src, slot = v
                link_id = len(links) + 1
                ltype = info[nodes[src][0]]["outputs"][slot]
                links.append([link_id, src, slot, nid, None, ltype])
                out_links.setdefault((src, slot), []).append(link_id)
                api_inputs[inp["name"]] = [str(src), slot]
            elif v is not None:
                api_inputs[inp["name"]] = v
            if inp["widget"]:
                if inp["name"] not in values:
                    raise KeyError(f"{name}: node {nid} ({t}) lacks a value for widget {inp['name']!r}")
                widgets.append(v)
                if inp["control_after_generate"]:
                    widgets.append("fixed")
                if inp["upload"]:
                    widgets.append("image")
            else:
                link = links[-1][0] if isinstance(v, tuple) else None
                if link is not None:
                    links[-1][4] = len(sockets)
                if link is not None or not inp["optional"] or t.startswith("PatchRay"):
                    sockets.append({"name": inp["name"], "type": inp["type"], "link": link})
        api[str(nid)] = {"class_type": t, "inputs": api_inputs, "_meta": {"title": t}}
        ui_nodes.append({
            "id": nid, "type": t, "pos": [0, 0],
            "size": [max(min_node_size(info, t)[0], widget_text_width(info, t, api_inputs)), min_node_size(info, t)[1]],
            "flags": {}, "order": order,
            "mode": 0, "inputs": sockets,
            "outputs": [{"name": o, "type": o, "links": [], "slot_index": s} for s, o in enumerate(spec["outputs"])],
            "properties": {"Node name for S&R": t}, "widgets_values": widgets,
        })
    for n in ui_nodes:
        for o in n["outputs"]:
            o["links"] = out_links.get((n["id"], o["slot_index"]), [])
    note = {"id": note_id, "type": "MarkdownNote", "pos": [0, 0], "size": [720, 260], "flags": {}, "order": len(ui_nodes),
            "mode": 0, "inputs": [], "outputs": [], "properties": {}, "widgets_values": [NOTES[name]],
            "color": "#432", "bgcolor": "#653"}
    right = layout(ui_nodes, links, note)
    ui_nodes.append(note)
    ui = {"id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"patchray/workflows/{name}")), "revision": 0, "last_node_id": note_id, "last_link_id": len(links), "nodes": ui_nodes,
          "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": min(0.8, round(1500 / right, 2)), "offset": [0, 0]}}, "version": 0.4}
    return ui, api


def main() -> int:
    info = node_info()
    OUT.mkdir(exist_ok=True)
    for name, fn in WORKFLOWS.items():
        ui, api = build(name, fn(), info)
        (OUT / f"{name}.json").write_text(json.dumps(ui, indent=1) + "\n")
        (OUT / f"{name}.api.json").write_text(json.dumps(api, indent=1) + "\n")
        print(f"workflows/{name}.json, workflows/{name}.api.json")
    # ComfyUI's own templates with the PatchRay nodes added (template_workflows.py), read from the installed
    # comfyui-workflow-templates package
    import template_workflows

    try:
        for ui_path, api_path in zip(*[iter(template_workflows.write_all(info))] * 2):
            print(f"{ui_path}, {api_path}")
    except template_workflows.TemplatesMissing as exc:
        print(f"the template workflows were not written: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
