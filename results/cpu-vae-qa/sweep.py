import json, sys, time
import numpy as np
from PIL import Image
from safetensors.torch import load_file
import qa
BASE = "/tmp/qavae/base"

def case_prompt(vae, frames, w, h, ranks, mode="row", gn=False, batch=1, encode=True, precision="fp32", tag="c", planner=None, balance="equal"):
    api = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "2": {"class_type": "ImageScale", "inputs": {"image": ["1", 0], "upscale_method": "bilinear", "width": w, "height": h, "crop": "center"}},
        "10": {"class_type": "RepeatImageBatch", "inputs": {"image": ["2", 0], "amount": frames * batch}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["3", 0]}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["3", 0]}},
        "6": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": ranks, "device": "cpu", "address": "", "gpu_ids": ""}},
        "7": {"class_type": "PatchRayVAEDecode", "inputs": {"samples": ["4", 0], "vae": ["3", 0], "cluster": ["6", 0],
                                                            "mode": mode, "precision": precision, "gn_sync": gn, "balance": balance}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": f"stock_{tag}"}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": f"pr_{tag}"}},
    }
    if planner:
        api["20"] = {"class_type": "PatchRayTilePlanner", "inputs": dict(planner, ranks=ranks)}
        api["7"]["inputs"]["plan"] = ["20", 0]
    if encode:
        api["11"] = {"class_type": "PatchRayVAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["3", 0], "cluster": ["6", 0], "precision": precision}}
        api["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": f"stockenc_{tag}"}}
        api["13"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"prenc_{tag}"}}
    return api

def imgs(out, nid):
    return [np.asarray(Image.open(f"{BASE}/output/{i['subfolder']}/{i['filename']}"), dtype=np.int16) for i in out[nid]["images"]]

def lat(out, nid):
    i = out[nid]["latents"][0]
    return load_file(f"{BASE}/output/{i['subfolder']}/{i['filename']}")["latent_tensor"]

def check(api, r):
    if "refused" in r: return f"REFUSED {r['refused']}"
    if not r["ok"]: return f"ERROR {r['errors']} events={r['events']}"
    out = r["outputs"]; msg = [f"{r['dt']:.1f}s"]
    if "7" in out: msg.append(f"NOTE7={out['7']}")
    a, b = imgs(out, "8"), imgs(out, "9")
    if len(a) != len(b) or a[0].shape != b[0].shape:
        msg.append(f"SHAPE MISMATCH stock {len(a)}x{a[0].shape} ours {len(b)}x{b[0].shape}")
    else:
        d = max(int(np.abs(x - y).max()) for x, y in zip(a, b)); m = np.mean([np.abs(x - y).mean() for x, y in zip(a, b)])
        msg.append(f"dec n={len(a)} {a[0].shape} maxlev={d} meanlev={m:.3f}")
    if "13" in out:
        s, o = lat(out, "12"), lat(out, "13")
        if s.shape != o.shape: msg.append(f"ENC SHAPE stock {tuple(s.shape)} ours {tuple(o.shape)}")
        else: msg.append(f"enc {tuple(s.shape)} rel={((o - s).norm() / s.norm()).item():.2e}")
    return " ".join(msg)

if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    for c in cases:
        api = case_prompt(**c)
        r = qa.run(api, timeout=1200)
        print(json.dumps(c), "->", check(api, r), flush=True)
