import qa, numpy as np, json
from PIL import Image
def P(vae, lat, n=2):
    return {"1": {"class_type": "VAELoader", "inputs": {"vae_name": vae}}, "2": lat,
            "3": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": n, "device": "cpu", "address": "", "gpu_ids": ""}},
            "4": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
            "5": {"class_type": "PatchRayVAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0], "cluster": ["3", 0], "mode": "row", "precision": "fp32", "gn_sync": False}},
            "6": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": "vbs"}},
            "7": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "vbp"}}}
cases = {
 "wan21_batch2": P("wan_2.1_vae.safetensors", {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 48, "length": 5, "batch_size": 2}}),
 "wan22_batch2": P("wan2.2_vae.safetensors", {"class_type": "Wan22ImageToVideoLatent", "inputs": {"width": 64, "height": 48, "length": 5, "batch_size": 2, "vae": ["1", 0]}}),
}
for name, api in cases.items():
    # a random latent: EmptyLatent is zeros; add noise through the stock 'LatentAdd'? zeros are fine for shape checks
    r = qa.run(api, timeout=900)
    if not r.get("ok"): print(name, r.get("errors") or r.get("refused")); continue
    o = r["outputs"]
    load = lambda nid: [np.asarray(Image.open(f"/tmp/qavae/base/output/{i['subfolder']}/{i['filename']}"), dtype=np.int16) for i in o[nid]["images"]]
    a, b = load("6"), load("7")
    print(name, "stock", len(a), a[0].shape, "ours", len(b), b[0].shape, "maxlev", max(int(np.abs(x - y).max()) for x, y in zip(a, b)) if len(a) == len(b) else "LEN MISMATCH", "notes", o.get("5"))
