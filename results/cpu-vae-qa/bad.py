import json, sys, time
import qa

def cl(n): return {"class_type": "PatchRayCluster", "inputs": {"num_ranks": n, "device": "cpu", "address": "", "gpu_ids": ""}}
def dec(lat, vae, mode="row", prec="fp32", n="6", balance="equal"):
    return {"class_type": "PatchRayVAEDecode", "inputs": {"samples": lat, "vae": vae, "cluster": [n, 0], "mode": mode, "precision": prec, "gn_sync": False, "balance": balance}}
def prev(x): return {"class_type": "PreviewImage", "inputs": {"images": x}}
V = lambda name: {"class_type": "VAELoader", "inputs": {"vae_name": name}}

CASES = {
 "sd_latent_into_wan": {"1": V("wan_2.1_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "sd3_latent_into_sdxl": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "video_latent_into_sdxl": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 256, "height": 256, "length": 9, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "wan22_latent_into_wan21": {"1": V("wan_2.1_vae.safetensors"), "2": {"class_type": "Wan22ImageToVideoLatent", "inputs": {"width": 256, "height": 256, "length": 9, "batch_size": 1, "vae": ["1", 0]}}, "6": cl(2), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "rows_lt_ranks": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 16, "batch_size": 1}}, "6": cl(3), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "rows_lt_ranks_auto": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 16, "batch_size": 1}}, "6": cl(3), "7": dec(["2", 0], ["1", 0], mode="auto"), "8": prev(["7", 0])},
 "huge_latent": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 16384, "height": 16384, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "huge_video": {"1": V("wan_2.1_vae.safetensors"), "2": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 1920, "height": 1088, "length": 481, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "huge_encode": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyImage", "inputs": {"width": 8192, "height": 8192, "batch_size": 1, "color": 0}}, "6": cl(2),
                 "7": {"class_type": "PatchRayVAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["1", 0], "cluster": ["6", 0], "precision": "fp32"}}, "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "huge"}}},
 "ok_after_errors": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0]), "8": prev(["7", 0])},
 "bf16": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0], prec="bf16"), "8": prev(["7", 0])},
 "fp16": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0], prec="fp16"), "8": prev(["7", 0])},
 "fp16_encode": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyImage", "inputs": {"width": 128, "height": 128, "batch_size": 1, "color": 0}}, "6": cl(2),
                 "7": {"class_type": "PatchRayVAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["1", 0], "cluster": ["6", 0], "precision": "fp16"}}, "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "f16"}}},
 "speed_balance": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 200, "batch_size": 1}}, "6": cl(2), "7": dec(["2", 0], ["1", 0], balance="speed"), "8": prev(["7", 0])},
 "planner_frames_kl": {"2": {"class_type": "PatchRayTilePlanner", "inputs": {"family": "kl", "width": 1024, "height": 1024, "frames": 5, "ranks": 2, "choice": "balanced"}}, "8": prev(["2", 1])},
 "planner_64": {"2": {"class_type": "PatchRayTilePlanner", "inputs": {"family": "ltx_video", "width": 16384, "height": 16384, "frames": 1, "ranks": 64, "choice": "fine"}}, "8": prev(["2", 1])},
 "tile_plan_wrong_ranks": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 264, "height": 184, "batch_size": 1}}, "6": cl(2),
     "3": {"class_type": "PatchRayTilePlanner", "inputs": {"family": "kl", "width": 264, "height": 184, "frames": 1, "ranks": 3, "choice": "balanced"}},
     "7": dict(dec(["2", 0], ["1", 0], mode="tile-runs"), inputs=dict(dec(["2", 0], ["1", 0], mode="tile-runs")["inputs"], plan=["3", 0])), "8": prev(["7", 0])},

 "plan_kl_on_wan22": {"1": V("wan2.2_vae.safetensors"), "2": {"class_type": "Wan22ImageToVideoLatent", "inputs": {"width": 480, "height": 336, "length": 5, "batch_size": 1, "vae": ["1", 0]}}, "6": cl(2),
     "3": {"class_type": "PatchRayTilePlanner", "inputs": {"family": "kl", "width": 480, "height": 336, "frames": 1, "ranks": 2, "choice": "balanced"}},
     "7": dict(dec(["2", 0], ["1", 0], mode="tile-runs"), inputs=dict(dec(["2", 0], ["1", 0], mode="tile-runs")["inputs"], plan=["3", 0])), "8": prev(["7", 0])},
 "plan_auto": {"1": V("sdxl_vae.safetensors"), "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 264, "height": 184, "batch_size": 1}}, "6": cl(2),
     "3": {"class_type": "PatchRayTilePlanner", "inputs": {"family": "kl", "width": 264, "height": 184, "frames": 1, "ranks": 2, "choice": "balanced"}},
     "7": dict(dec(["2", 0], ["1", 0], mode="auto"), inputs=dict(dec(["2", 0], ["1", 0], mode="auto")["inputs"], plan=["3", 0])), "8": prev(["7", 0])},
}
names = sys.argv[1:] or list(CASES)
for name in names:
    t0 = time.monotonic()
    r = qa.run(CASES[name], timeout=900)
    dt = time.monotonic() - t0
    if "refused" in r: print(f"{name}: REFUSED at /prompt {json.dumps(r['refused'])[:600]} ({dt:.1f}s)")
    elif r["ok"]:
        outs = {k: (list(v.keys())) for k, v in (r["outputs"] or {}).items()}
        notes = {k: v.get("text") for k, v in (r["outputs"] or {}).items() if v.get("text")}
        print(f"{name}: OK {dt:.1f}s outputs={outs} notes={notes}")
    else: print(f"{name}: ERROR {dt:.1f}s {r['errors']}")
    sys.stdout.flush()
