"""Peak host memory of a CPU rank's row-band decode of ComfyUI's Wan / HunyuanVideo VAEs, against the estimates (by hand).

For each VAE (ComfyUI's own classes, every weight random and non-constant, loaded through ``comfy.sd.VAE`` like the
stock VAE Loader) and each frame count: ComfyUI's ``memory_used_decode`` (what PatchRay's host-memory refusal reads),
PatchRay's own estimate (:func:`patchray.nodes.bridge.vae.decode_need`), and the measured peak of each of N spawned gloo
CPU ranks running the library's ``row_decode`` on its band (resident memory sampled every 2 ms during the decode,
minus the resident memory before it: weights, the latent and the process itself excluded; and the peak of the
bytes of tensors live at once, counted by a dispatch mode, which leaves out the allocator's slack), fp32.

    python tests/comfyui/vae_band_peak.py <ComfyUI dir> --vae wan21 --frames 1 5 9 17 --size 128 --ranks 2 [--dim 96]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GIB = 2**30


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _band_peak(ctx, family, config, state, z):
    """One rank: build the library model, decode its band, return the peak resident memory above the start."""
    import torch

    from patchray.distributed.vae.families import instantiate
    from patchray.distributed.vae.row import row_decode

    with torch.device("meta"):
        model = instantiate(family, config)
    model.load_state_dict(state, assign=True)
    model = model.float().eval()
    del state
    import gc

    gc.collect()
    base = _rss()
    peak = [base]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    from patchray.distributed.cluster.memory import _LiveBytes

    t0 = time.perf_counter()
    with _LiveBytes(1 << 62, ctx.rank) as live:  # the tensors' own bytes, live at once (no allocator slack)
        out = row_decode(model, z, ctx)
    seconds = time.perf_counter() - t0
    done.set()
    t.join()
    peak[0] = max(peak[0], _rss())
    return {"rank": ctx.rank, "peak_above_start": peak[0] - base, "live_tensor_peak": live.peak, "seconds": round(seconds, 2),
            "out_shape": list(out.shape) if out is not None else None}


def _build(name, dim):
    import torch

    import comfy.sd
    from make_models import _init_nonconstant

    if name == "wan21":
        import comfy.ldm.wan.vae as m

        model = m.WanVAE(dim=dim or 96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                         temperal_downsample=[False, True, True], dropout=0.0)
    elif name == "wan22":
        import comfy.ldm.wan.vae2_2 as m

        model = m.WanVAE(dim=dim or 160, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                         temperal_downsample=[False, True, True], dropout=0.0)
    else:
        raise ValueError(name)
    sd = {k: v.float() for k, v in _init_nonconstant(model, 7).state_dict().items()}
    vae = comfy.sd.VAE(sd=sd)
    if dim and vae.first_stage_model.state_dict()["decoder.conv1.weight"].shape != sd["decoder.conv1.weight"].shape:
        raise RuntimeError("ComfyUI rebuilt the VAE at its own width: use the full width")
    return vae


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("comfy_dir")
    p.add_argument("--vae", default="wan21", choices=["wan21", "wan22"])
    p.add_argument("--file", default="", help="a VAE file to load as the stock VAE Loader does (instead of --vae)")
    p.add_argument("--frames", type=int, nargs="+", default=[1, 5, 9, 17])
    p.add_argument("--size", type=int, default=128, help="width = height in pixels")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dim", type=int, default=0, help="the VAE's base width (0: ComfyUI's)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    link_dir = tempfile.mkdtemp(prefix="patchray_imp_")
    os.symlink(ROOT, os.path.join(link_dir, "patchray"))
    for path in (HERE, link_dir, args.comfy_dir):
        sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([link_dir, HERE] + [os.environ.get("PYTHONPATH", "")])
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch

    from patchray.distributed.spawn import run_ranks
    from patchray.nodes.bridge import convert as cv
    from patchray.nodes.bridge import vae as bridge_vae

    if args.file:
        import comfy.sd
        import comfy.utils

        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(args.file))
    else:
        vae = _build(args.vae, args.dim)
    spec = cv.vae_spec(vae)
    ratio = cv.spatial_ratio(spec)
    t_ratio = int(vae.upscale_index_formula[0])
    rows = []
    for frames in args.frames:
        lat_t = (frames - 1) // t_ratio + 1
        h = w = args.size // ratio
        z = torch.randn(1, spec_channels(spec), lat_t, h, w, generator=torch.Generator().manual_seed(0))
        comfy_est = int(vae.memory_used_decode(tuple(z.shape), torch.float32))
        row = {"vae": os.path.basename(args.file) or args.vae, "dim": args.dim or "comfyui", "frames": frames, "latent": list(z.shape), "ranks": args.ranks,
               "comfy_estimate_gib": round(comfy_est / GIB, 4)}
        need = getattr(bridge_vae, "decode_need", None)
        if need is not None:
            row["patchray_need_gib"] = round(need(vae, spec, z, torch.float32) / GIB, 4)
        res = run_ranks(_band_peak, args.ranks, spec.family, dict(spec.config), dict(spec.state_dict), cv.latent_to_library(spec, z),
                        timeout_s=1800.0)
        row["rank_peak_above_start_gib"] = [round(r["peak_above_start"] / GIB, 4) for r in res]
        row["sum_rank_peaks_gib"] = round(sum(r["peak_above_start"] for r in res) / GIB, 4)
        row["rank_live_tensor_peak_gib"] = [round(r["live_tensor_peak"] / GIB, 4) for r in res]
        row["sum_live_tensor_peaks_gib"] = round(sum(r["live_tensor_peak"] for r in res) / GIB, 4)
        row["seconds"] = [r["seconds"] for r in res]
        row["output_gib"] = round(frames * args.size * args.size * 3 * 4 / GIB, 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 0


def spec_channels(spec):
    from patchray.distributed.vae.api import latent_channels

    return latent_channels(spec)


if __name__ == "__main__":
    sys.exit(main())
