"""The Distributed KSampler's impossible requests through the real nodes, in one fresh process, without any rank.

Runs with ComfyUI's Python: the PatchRay Cluster node (3 CPU ranks) hands its handle to the Distributed KSampler
with MODELs of ComfyUI's own classes (small FLUX.1, Wan Fun Camera and SD UNet, seeded random weights), each request one
the node must refuse from its inputs and the cluster's configured rank count. Prints, as JSON, each case's error
type and message and whether Ray was ever started in this process (no Ray: no rank process).

    python tests/comfyui/refuse_before_ranks.py --comfy /path/to/ComfyUI [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

#: name -> (model, latent shape, node widgets beyond the defaults below)
CASES = {
    "cfg+sequence-on-3-ranks": ("flux", (1, 16, 13, 10), {"parallelism": "cfg+sequence"}),
    "sequence-on-an-uncovered-model": ("camera", (1, 16, 5, 9, 6), {"parallelism": "sequence"}),
    "latent-too-small-for-the-ranks": ("flux", (1, 16, 2, 10), {"parallelism": "sequence"}),
    "stale-preset-with-ulysses": ("flux", (1, 16, 13, 10), {"parallelism": "sequence", "preset": "displaced",
                                                            "sequence_attention": "ulysses"}),
    "unet-stale-preset-with-batch": ("unet", (3, 4, 12, 10), {"parallelism": "batch", "preset": "displaced"}),
}


def _setup(comfy):
    link_dir = tempfile.mkdtemp(prefix="patchray_imp_")
    os.symlink(ROOT, os.path.join(link_dir, "patchray"))
    for p in (HERE, link_dir, comfy):
        sys.path.insert(0, p)
    saved, sys.argv = sys.argv, [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.model_management  # noqa: F401  (parses the arguments once)

    sys.argv = saved


def _model(kind):
    """(ModelPatcher, conditioning maker) of a small model of ComfyUI's own classes."""
    if kind != "camera":
        from dit_ranks import _model as dit_model

        mp, cond, _ = dit_model(kind)
        return mp, cond
    import comfy.supported_models as sm
    from rank_harness import patcher, random_model

    # Wan Fun Camera: a DiT with blocks for sharding and no sequence layout (its camera adapter adds a full-grid tensor)
    conf = sm.WAN21_Camera({"image_model": "wan2.1", "model_type": "camera", "dim": 192, "ffn_dim": 256, "num_heads": 6,
                            "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 64, "text_dim": 40, "in_dim": 36,
                            "out_dim": 16, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
                            "in_dim_control_adapter": 24})

    def cond(g, b=1):
        return [[torch.randn(b, 7, 40, generator=g), {}]]

    return patcher(random_model(conf)), cond


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy", required=True)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    _setup(os.path.abspath(args.comfy))
    from patchray.nodes.cluster import PatchRayCluster
    from patchray.nodes.ksampler import PatchRayKSampler

    t0 = time.monotonic()
    out = PatchRayCluster.execute(num_ranks=3, device="cpu", address="", gpu_ids="")
    handle = out.args[0]
    report = {"cluster_summary": out.ui.value, "cluster_info": json.loads(out.args[1]), "cases": {}}
    models = {}
    for name, (kind, shape, widgets) in CASES.items():
        if kind not in models:
            models[kind] = _model(kind)
        mp, cond = models[kind]
        g = torch.Generator().manual_seed(3)
        inputs = dict(model=mp, seed=1, steps=2, cfg=4.0, sampler_name="euler", scheduler="simple", positive=cond(g),
                      negative=cond(g), latent_image={"samples": torch.zeros(shape)}, denoise=1.0, cluster=handle)
        inputs.update(widgets)
        t = time.monotonic()
        try:
            PatchRayKSampler.execute(**inputs)
            report["cases"][name] = {"error": None}
        except Exception as exc:  # the report carries what the node raised, for the test to judge
            report["cases"][name] = {"error": type(exc).__name__, "message": str(exc), "seconds": round(time.monotonic() - t, 2)}
    ray = sys.modules.get("ray")
    report["ray_initialized"] = bool(ray is not None and ray.is_initialized())
    from patchray.distributed.cluster import registry

    report["cluster_started"] = registry._current is not None
    report["seconds"] = round(time.monotonic() - t0, 2)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
