"""One GPU, no ranks: how long the CPU takes to *issue* one whole call of a DiT in eager PyTorch (diffusers' own
forward, no PatchRay code in the path), against the GPU time of the same call.

Per transformer block (a call has more kernels than CUDA's launch queue holds, a block far fewer): a forward
pre-hook enqueues a GPU spin (``torch.cuda._sleep``, the benchmark's calibrated ``GpuSpin``) long enough that the
CPU issues the whole block before the GPU reaches it, and the host wall time from the block's start to its end is
its issue time (valid when the start event has not been reached then: ``queued``); the events around it give the
block's GPU time without launch gaps. Summed over the blocks. If the issue time is close to the GPU time, a rank computing 1/N of the tokens cannot run faster than its CPU
issues, which bounds eager sequence parallelism on a fast GPU.

    python3 results/h200/dit/issue_time.py --preset flux1_1024 --preset qwen_image_1328 --out issue_time.json
"""

import argparse
import json
import time

import torch

from patchray.distributed.bench.dit_models import PRESETS, build_random, make_inputs
from patchray.distributed.bench.turns import GpuSpin


def measure(name: str, iters: int = 3) -> dict:
    dev = torch.device("cuda")
    preset = PRESETS[name]
    model = build_random(preset, "full", dev, torch.bfloat16, seed=0)
    inp = make_inputs(preset, "full", dev, torch.bfloat16, seed=1)[0]
    blocks = [m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n.endswith("blocks")]
    blocks = [b for lst in blocks for b in lst]
    state = {}

    def pre(mod, args, kwargs):
        GpuSpin.enqueue(dev, 30.0)  # 30 ms of GPU spin: the CPU issues the block behind it
        state["start"] = torch.cuda.Event(enable_timing=True)
        state["start"].record()
        state["t0"] = time.perf_counter()

    def post(mod, args, kwargs, out):
        issued = (time.perf_counter() - state["t0"]) * 1e3
        queued = not state["start"].query()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        state["issue"] += issued
        state["gpu"] += state["start"].elapsed_time(end)
        state["queued"] &= queued

    handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(post, with_kwargs=True) for b in blocks]
    rec = {"preset": name, "blocks": len(blocks), "block_issue_ms": [], "block_gpu_ms": [], "all_queued": []}
    with torch.no_grad():
        GpuSpin.cycles_per_ms(dev)
        for i in range(iters + 1):
            state.update(issue=0.0, gpu=0.0, queued=True)
            model(**inp)
            torch.cuda.synchronize()
            if i:  # the first is a warm-up
                rec["block_issue_ms"].append(round(state["issue"], 2))
                rec["block_gpu_ms"].append(round(state["gpu"], 2))
                rec["all_queued"].append(state["queued"])
    for h in handles:
        h.remove()
    del model
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", action="append", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "records": []}
    for name in a.preset:
        r = measure(name)
        print(json.dumps(r), flush=True)
        out["records"].append(r)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
