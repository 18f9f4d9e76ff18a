import sys, torch
sys.path.insert(0, "/work/main/.comfyui"); sys.argv = [sys.argv[0], "--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import comfy.sd, comfy.utils
cases = [("wan_2.1_vae.safetensors", (1,16,5,60,104), (17,3,480,832)), ("wan2.2_vae.safetensors", (1,48,31,44,80), (121,3,704,1280)),
         ("hunyuan_video_vae_bf16.safetensors", (1,16,19,60,106), (73,3,480,848)), ("ltxv_090_vae.safetensors", (1,128,13,16,24), (97,3,512,768)),
         ("ae.safetensors", (1,16,128,128), (1,3,1024,1024))]
for name, zs, ps in cases:
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file("/tmp/qavae/base/models/vae/" + name))
    enc_shape = (1, 3, ps[0], ps[2], ps[3]) if len(zs) == 5 else ps
    d = vae.memory_used_decode(zs, torch.float32) * zs[0]
    e = vae.memory_used_encode(enc_shape, torch.float32)
    print(name, "decode est GiB %.1f" % (d / 2**30), "encode est GiB %.1f" % (e / 2**30), "image GiB %.2f" % (ps[0]*ps[2]*ps[3]*12/2**30), flush=True)
    del vae
