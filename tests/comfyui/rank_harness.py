"""Shared set-up of the opt-in rank harnesses: the rank scripts and the tests that launch them.

Rank side (imported as a top-level module by ``dit_ranks.py``, ``dit_ranks_qwen_hunyuan_ltxv.py``, ``shard_ranks.py`` and
``ksampler_ranks.py``, which run with ComfyUI's Python and have this folder on their import path): seeded random
weights, a small model of ComfyUI's own classes, the stock KSampler's result, one case sampled by the node's rank code
against it, the scripts' command line and report.

Test side (imported by ``test_dit_ranks.py``, ``test_dit_ranks_qwen_hunyuan_ltxv.py`` and ``test_shard_ranks.py``): the opt-in
marks and the launcher that runs a rank script on N gloo CPU ranks and returns its report.

No pytest import at module level: ``ksampler_ranks.py`` also runs on machines without pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
PYTHON = os.environ.get("COMFYUI_PYTHON", sys.executable)


# ------------------------------------------------------------------------------------------------ rank side


def init_random(module, seed):
    """Every parameter and buffer seeded random and non-constant (norm scales around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if not p.is_floating_point():
                continue
            if p.ndim > 1 and "modulation" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
            elif "norm" in name or name.endswith(("scale", "gamma")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


def random_model(conf):
    """``conf``'s (a ``comfy.supported_models`` config) BaseModel in fp32, its diffusion model seeded random (seed 7)."""
    conf.set_inference_dtype(torch.float32, None)
    base = conf.get_model({})
    init_random(base.diffusion_model, 7)
    return base


def patcher(base):
    """A ModelPatcher of ``base`` on ComfyUI's load and offload devices (what ComfyUI's loaders return)."""
    import comfy.model_management as mm
    import comfy.model_patcher

    return comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())


def sampling_inputs(latent, noise_mask, positive, negative, sampler, cfg, *, steps=3, scheduler="simple", **extra):
    """The KSampler's inputs as the node ships them to its ranks (seed 42, denoise 1), plus ``extra`` keys."""
    import comfy.sample

    return dict({
        "noise": comfy.sample.prepare_noise(latent, 42), "latent_image": latent, "noise_mask": noise_mask, "seed": 42,
        "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler, "denoise": 1.0,
        "positive": positive, "negative": negative, "model_options": {"transformer_options": {}}, "object_patches": {},
    }, **extra)


def stock_sample(mp, inputs):
    """The stock KSampler's call (KSampler (Advanced)'s where ``inputs`` has its schedule keys): ``comfy.sample.sample``
    on a clone of ``mp``, no PatchRay wrapper, one process."""
    import comfy.sample

    with torch.inference_mode():
        return comfy.sample.sample(mp.clone(), inputs["noise"], inputs["steps"], inputs["cfg"], inputs["sampler_name"],
                                   inputs["scheduler"], inputs["positive"], inputs["negative"], inputs["latent_image"],
                                   denoise=inputs["denoise"], noise_mask=inputs["noise_mask"], disable_pbar=True,
                                   seed=inputs["seed"], disable_noise=inputs.get("disable_noise", False),
                                   start_step=inputs.get("start_step"), last_step=inputs.get("last_step"),
                                   force_full_denoise=inputs.get("force_full_denoise", False))


def rank_run_inputs(mp, inputs, layout, kind, attention):
    """What the Parallel Model's driver sends its ranks for the KSampler call ``inputs`` describes (old-style keys:
    noise, steps, cfg, sampler_name, ...): ComfyUI's own ``comfy.sample.sample`` runs on a clone of ``mp`` up to its
    OUTER_SAMPLE extension point, where a wrapper takes the guider, sampler, sigmas, noise, latent and mask as the
    Parallel Model's wrapper does (``parallel_model.rank_inputs``) and returns without sampling."""
    import comfy.patcher_extension as pe
    import comfy.sample

    from patchray.nodes.bridge.parallel_model import rank_inputs

    seen = {}

    def capture(executor, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None, disable_pbar=False,
                seed=None):
        seen["inputs"] = rank_inputs(executor.class_obj, noise, latent_image, sampler, sigmas, denoise_mask, seed, layout,
                                     kind, attention)
        return latent_image

    m = mp.clone()
    m.model_options = inputs["model_options"]
    for name, obj in inputs["object_patches"].items():
        m.add_object_patch(name, obj)
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "patchray.test.capture", capture)
    comfy.sample.sample(m, inputs["noise"], inputs["steps"], inputs["cfg"], inputs["sampler_name"], inputs["scheduler"],
                        inputs["positive"], inputs["negative"], inputs["latent_image"], denoise=inputs["denoise"],
                        noise_mask=inputs["noise_mask"], disable_pbar=True, seed=inputs["seed"],
                        disable_noise=inputs.get("disable_noise", False), start_step=inputs.get("start_step"),
                        last_step=inputs.get("last_step"), force_full_denoise=inputs.get("force_full_denoise", False))
    return seen["inputs"]


@contextlib.contextmanager
def watch_text():
    """The text shard sizes of every sequence-parallel model call of the block (``()``: the text stayed whole), read
    from the rank's shard table after each call (the rank side's own state; nothing is replaced); ``.modes``: the
    attention calls per mode that ran, from the same state."""
    from patchray.nodes.bridge import dit_rank

    class Seen(list):
        modes: dict = {}
        #: (model calls whose modulation was computed in shares, shared modulation layers)
        modulation: tuple = (0, 0)

    seen = Seen()
    original = dit_rank.DitSequence.wrapper

    def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(self.state.require_shards().text_sizes)
        seen.modes = dict(self.state.mode_calls)
        group = self.state.modulation
        if group is not None:
            seen.modulation = (group.shared_calls, len(group.members))
        return out

    dit_rank.DitSequence.wrapper = wrapper
    try:
        yield seen
    finally:
        dit_rank.DitSequence.wrapper = original


def each_case(ctx, opts, cases, build):
    """ComfyUI made importable on the rank (``ksampler_rank.prepare``), torch seeded 0, then ``(name, case, model)``
    for each case of ``opts["cases"]``: ``case`` is ``cases[name]`` (its first item the model kind), ``model`` is
    ``build(kind)``, one model at a time (kept while consecutive cases share its kind)."""
    from patchray.nodes.bridge import ksampler_rank as kr

    kr.prepare(ctx, opts["comfy"])

    torch.manual_seed(0)
    models = {}
    for name in opts["cases"]:
        kind = cases[name][0]
        if kind not in models:
            models = {kind: build(kind)}  # one model at a time
        yield name, cases[name], models[kind]


def sample_case(ctx, key, mp, inputs, layout, kind, attention):
    """One case on every rank: ``ksampler_rank.sample`` (what the node's ranks run) with ``layout``, its final latent
    compared on rank 0 with :func:`stock_sample` of the same ModelPatcher; the layout, model calls, collectives and
    text shard sizes seen (``rel_l2``, ``shape``, ``ref_norm``: rank 0 only)."""
    from patchray.distributed import comm
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.nodes.bridge import ksampler_rank as kr

    ref = stock_sample(mp, inputs).float() if ctx.rank == 0 else None
    inputs = rank_run_inputs(mp, inputs, layout, kind, attention)
    session = RankSession(ctx, key, preset("full_sync", split_batch=False))
    session.begin()
    with comm.log_comm() as log, watch_text() as texts:
        latent = kr.sample(ctx, mp, session, inputs)
        final = session.finalize(latent).float().cpu()
    rec = {"layout": layout.mode, "groups": layout.cfg_groups, "seq": layout.seq_ranks, "calls": session.calls,
           "note": layout.note, "comm_calls": dict(log.calls), "comm_bytes": log.total_bytes,
           "text_sizes": sorted({tuple(t) for t in texts}), "attention_modes": texts.modes,
           "modulation_shared": list(texts.modulation)}
    if ref is not None:
        rec["rel_l2"] = ((final - ref).norm() / ref.norm()).item()
        rec["shape"] = list(final.shape)
        rec["ref_norm"] = ref.norm().item()
    session.close()
    return rec


def write_report(report, out):
    """Print ``report`` as JSON; also write it to ``out`` when given."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w") as fh:
            fh.write(text)


def rank_main(rank_fn, doc, cases, argv, summary):
    """A case script's command line (``--comfy --ranks --cases --cfg --out``): ``rank_fn(ctx, opts)`` on that many gloo
    CPU ranks, the report (ranks, torch, rank 0's cases, then ``summary(results)``) printed and written."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--comfy", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=sorted(cases))
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from patchray.distributed.spawn import run_ranks

    opts = {"comfy": os.path.abspath(args.comfy), "cases": args.cases, "cfg": args.cfg}
    results = run_ranks(rank_fn, args.ranks, opts, backend="gloo", device="cpu", timeout_s=900.0)
    write_report(dict({"ranks": args.ranks, "torch": torch.__version__, "cases": results[0]}, **summary(results)), args.out)
    return 0


# ------------------------------------------------------------------------------------------------ test side


def comfy_in_process(tmp):
    """ComfyUI importable in this test process, on the CPU, with the checkout importable as ``patchray`` through a
    link in ``tmp`` (what the pack's import shim does in ComfyUI) and this folder's scripts on the path."""
    if not (tmp / "patchray").exists():
        os.symlink(ROOT, tmp / "patchray")
    for p in (str(tmp), COMFYUI_DIR, str(Path(__file__).parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    saved = sys.argv
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.model_management  # noqa: F401  (parses the arguments once)

    sys.argv = saved


def comfyui_marks():
    """The marks of an opt-in real-ComfyUI test module (``pytestmark``): skipped unless COMFYUI_DIR is set."""
    import pytest

    return [
        pytest.mark.comfyui,
        pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-ComfyUI tests"),
    ]


def run_rank_script(script, tmp_path, ranks, cases, timeout):
    """Run ``tests/comfyui/<script>`` with ComfyUI's Python on ``ranks`` gloo CPU ranks for ``cases``; its report.

    The checkout is importable as ``patchray`` through a folder holding only a link to it (what the pack's import
    shim does in ComfyUI). A failing script fails the test with the tail of its output."""
    importable = tmp_path / "imp"
    importable.mkdir()
    os.symlink(ROOT, importable / "patchray")
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(importable), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [PYTHON, str(ROOT / "tests" / "comfyui" / script), "--comfy", COMFYUI_DIR, "--ranks", str(ranks),
         "--cases", *cases, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
