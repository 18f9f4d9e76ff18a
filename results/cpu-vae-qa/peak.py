import sys, resource, torch, time
sys.path.insert(0, "/work/main/.comfyui"); ARGS = sys.argv[:]; sys.argv = [sys.argv[0], "--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import comfy.sd, comfy.utils, psutil
name, shape = ARGS[1], eval(ARGS[2])
vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file("/tmp/qavae/base/models/vae/" + name))
z = torch.randn(shape)
torch.set_num_threads(1)
p = psutil.Process()
base = p.memory_info().rss
import threading
peak = [base]; stop = [False]
def mon():
    while not stop[0]:
        peak[0] = max(peak[0], p.memory_info().rss); time.sleep(0.02)
t = threading.Thread(target=mon); t.start()
with torch.no_grad():
    fsm = vae.first_stage_model.float()
    zz = z.float()
    out = fsm.decode(zz)
stop[0] = True; t.join()
est = vae.memory_used_decode(shape, torch.float32)
print(name, shape, "peak over base GiB %.2f" % ((peak[0] - base) / 2**30), "comfy estimate GiB %.2f" % (est / 2**30), "out px", tuple(out.shape))
