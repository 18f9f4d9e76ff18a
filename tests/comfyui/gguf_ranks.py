"""GGUF models of the ComfyUI-GGUF pack through the Parallel Model's rank side, against the same GGUF model sampled stock.

Driver (this process, as ComfyUI's would be): ComfyUI with ``--cpu``, the pack imported as ComfyUI imports a custom
node (its folder's path as module name), a small Wan 2.1 t2v of ComfyUI's class written as GGUF files (Q8_0, and Q4_K
for the K-quants; ``gguf_models.py``) and loaded by the pack's own ``Unet Loader (GGUF)`` (its ``GGUFModelPatcher``,
``GGMLOps`` layers and ``GGMLTensor`` weights). Per case: the stock KSampler's result (``comfy.sample.sample`` on the
loaded MODEL), then what the Parallel Model's driver sends (``model.portable_parts``: the skeleton payload, the
weights as ``sampling.weights.to_arrays`` puts them in Ray's store; ``parallel_model.rank_inputs``), pickled with
Ray's pickler after the classes the ranks cannot import were registered to travel by value, as Ray would pickle them.

Ranks (spawned interpreters that never import the pack: checked): unpickle, build the model as the node's ranks do
(``ksampler_rank.begin_parts``, ``sampling.ship.fill_tensors``, ``ksampler_rank.end_parts``), then sample with
``ksampler_rank.sample`` (sequence with gathered or ring attention, cfg, or batch). Rank 0 compares its final latent with the
driver's stock result; every rank reports what it holds (GGML types, bytes, LoRA patches attached).

``*-lora``: a rank-4 LoRA over every Linear of the blocks (about 10 % of each weight) and a bias difference on one
quantized layer, added the way the stock LoraLoader adds it; stock, the pack's patcher attaches the patches to the
quantized tensors (dequantize, then patch, at every call) and patches the F32 bias in place.

    GGUF_DIR=/path/to/ComfyUI-GGUF python tests/comfyui/gguf_ranks.py --comfy /path/to/ComfyUI --ranks 2 [--out r.json]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_harness import rank_run_inputs, stock_sample, write_report  # noqa: E402

# name -> (file's quantization, parallelism, LoRA, sequence attention, batch)
CASES = {
    "q8-seq": ("Q8_0", "sequence", False, "gathered", 1),
    "q8-cfg": ("Q8_0", "cfg", False, "gathered", 1),
    "q4k-seq": ("Q4_K", "sequence", False, "gathered", 1),
    "q4k-cfg": ("Q4_K", "cfg", False, "gathered", 1),
    "q4k-seq-lora": ("Q4_K", "sequence", True, "gathered", 1),
    "q8-cfg-lora": ("Q8_0", "cfg", True, "gathered", 1),
    "q4k-seq-ring": ("Q4_K", "sequence", False, "ring", 1),
    "q4k-batch": ("Q4_K", "batch", False, "gathered", 2),
}
SHAPE = (1, 16, 5, 9, 6)  # odd rows and columns, 5 frames


def _cond(g, b=1):
    return [[torch.randn(b, 7, 4096, generator=g), {}]]


def _inputs(cfg_scale, batch=1):
    from rank_harness import sampling_inputs

    g = torch.Generator().manual_seed(3)
    return sampling_inputs(torch.zeros((batch,) + SHAPE[1:]), None, _cond(g), _cond(g), "euler", cfg_scale)


def _ggml_summary(module) -> dict:
    """What a model holds: GGML tensors by type, their bytes, the tensors carrying LoRA patches, the classes' modules."""
    from patchray.nodes.bridge import gguf_weights

    types, nbytes, patched, modules = {}, 0, 0, set()
    for _, p in module.named_parameters():
        if gguf_weights.is_ggml(p):
            name = p.tensor_type.name
            types[name] = types.get(name, 0) + 1
            modules.add(type(p).__module__)
            if gguf_weights.is_quantized(p):
                nbytes += p.numel() * p.element_size()
                patched += bool(getattr(p, "patches", None))
    return {"types": types, "quantized_bytes": nbytes, "patched": patched, "modules": sorted(modules)}


def drive(comfy: str, gguf_dir: str, ranks: int, names, cfg_scale: float) -> dict:
    """The driver's side of every case (see the module docstring): per case the pickled payload and the reference."""
    from ray import cloudpickle

    from patchray.distributed.context import ParallelContext
    from patchray.distributed.sampling.weights import to_arrays
    from patchray.nodes.bridge import ksampler_rank as kr

    kr.prepare(ParallelContext.single(torch.device("cpu")), comfy)
    import comfy.sd
    import folder_paths

    from gguf_models import load_pack, lora_state_dict, wan_state_dict, write_gguf
    from patchray.nodes.bridge import shard_models
    from patchray.nodes.bridge.dit_layout import plan_layout
    from patchray.nodes.bridge.model import portable_parts

    pack_nodes, _ = load_pack(gguf_dir)
    folder = tempfile.mkdtemp(prefix="patchray-gguf-")
    folder_paths.add_model_folder_path("diffusion_models", folder)
    sd = wan_state_dict()
    files = {}
    for q in sorted({CASES[n][0] for n in names}):
        files[q] = write_gguf(os.path.join(folder, f"wan_{q}.gguf"), sd, "wan", q)
    out = {"driver": {"file_types": {q: sorted(set(t.values())) for q, t in files.items()},
                      "file_bytes": {q: os.path.getsize(os.path.join(folder, f"wan_{q}.gguf")) for q in files}},
           "cases": {}}
    refs = {}
    for name in names:
        qtype, parallelism, lora, attention, batch = CASES[name]
        mp = pack_nodes.UnetLoaderGGUF().load_unet(f"wan_{qtype}.gguf")[0]
        rec = {"patcher": type(mp).__name__, "driver": _ggml_summary(mp.model)}
        if lora:
            mp, _ = comfy.sd.load_lora_for_models(mp, None, lora_state_dict(sd), 1.0, 0.0)
            rec["lora_keys"] = len(mp.patches)
        inputs = _inputs(cfg_scale, batch)
        torch.manual_seed(0)
        ref = stock_sample(mp, inputs).float()
        if batch == 1:
            refs[(qtype, lora)] = ref
        layout = plan_layout(parallelism, ranks, inputs["cfg"], batch, sequence_refusal=None)
        run = rank_run_inputs(mp, inputs, layout, "dit", attention)
        # after the stock run: ComfyUI left the driver's model loaded, the LoRA attached to its quantized tensors
        rec["driver_after_stock"] = _ggml_summary(mp.model)
        _, make_skeleton, tnames, tensor, sizes = portable_parts(mp, layout.mode)
        payload = make_skeleton()
        arrays, views = to_arrays({n: tensor(n) for n in tnames})
        rec["shipped_bytes"] = int(sum(a.nbytes for a in arrays.values()))
        rec["ggml_patches"] = len(payload.get("ggml_patches") or {})
        rec["blob"] = cloudpickle.dumps((dict(payload, sharding="none"), arrays, views, run))
        rec["ref"] = ref
        rec["layout"] = layout.mode
        try:
            shard_models.blocks_for(mp.model.diffusion_model, "blocks")
            rec["blocks_refusal"] = None
        except NotImplementedError as exc:
            rec["blocks_refusal"] = str(exc)
        rec["auto_sharding"] = list(shard_models.resolve_sharding("auto", mp.model.diffusion_model, ranks, 1.0, 2.0**40,
                                                                   host_ranks=True))
        out["cases"][name] = rec
    for name in names:  # how much the LoRA changes the result (the test needs it to matter)
        qtype, _, lora, _, _ = CASES[name]
        if lora and (qtype, False) in refs:
            base = refs[(qtype, False)]
            out["cases"][name]["lora_effect"] = ((refs[(qtype, True)] - base).norm() / base.norm()).item()
    return out


def _rank(ctx, opts):
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession
    from patchray.distributed.sampling.ship import fill_tensors
    from patchray.distributed.sampling.weights import from_arrays
    from patchray.nodes.bridge import ksampler_rank as kr

    kr.prepare(ctx, opts["comfy"])
    pack = os.path.realpath(opts["gguf_dir"])
    results = {}
    for name, case in opts["cases"].items():
        rec = {"pack_imported_before": any(m.startswith(pack) for m in sys.modules)}
        payload, arrays, views, inputs = pickle.loads(case["blob"])
        rec["pack_imported_after"] = any(m.startswith(pack) for m in sys.modules)
        built, module = kr.begin_parts(ctx, payload)
        fill_tensors(module, from_arrays(arrays, views, copy=False), ctx)
        rank_mp = kr.end_parts(ctx, built)
        rec["rank"] = _ggml_summary(rank_mp.model)
        # the blocks' Linear weights as the rank holds them: GGML bytes (uint8), never a dequantized float tensor
        rec["block_linear_dtypes"] = sorted({str(m.weight.dtype) for n, m in rank_mp.model.diffusion_model.named_modules()
                                             if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)})
        session = RankSession(ctx, ("model", name), preset("full_sync", split_batch=False))
        session.begin()
        latent = kr.sample(ctx, rank_mp, session, inputs)
        final = session.finalize(latent).float().cpu()
        rec["calls"] = session.calls
        session.close()
        if ctx.rank == 0:
            ref = case["ref"]
            rec["rel_l2"] = ((final - ref).norm() / ref.norm()).item()
            rec["ref_norm"] = ref.norm().item()
        results[name] = rec
        del rank_mp, built, module
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy", required=True)
    p.add_argument("--gguf", default=os.environ.get("GGUF_DIR"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=sorted(CASES))
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if not args.gguf:
        p.error("--gguf (or GGUF_DIR): a checkout of the ComfyUI-GGUF pack")
    from patchray.distributed.spawn import run_ranks

    comfy, gguf_dir = os.path.abspath(args.comfy), os.path.abspath(args.gguf)
    driven = drive(comfy, gguf_dir, args.ranks, args.cases, args.cfg)
    cases = {n: {"blob": r.pop("blob"), "ref": r.pop("ref")} for n, r in driven["cases"].items()}
    opts = {"comfy": comfy, "gguf_dir": gguf_dir, "cases": cases}
    results = run_ranks(_rank, args.ranks, opts, backend="gloo", device="cpu", timeout_s=900.0)
    report = {"ranks": args.ranks, "torch": torch.__version__, "driver": driven["driver"],
              "cases": {n: dict(driven["cases"][n], **results[0][n]) for n in args.cases},
              "per_rank": [{n: {k: v for k, v in r[n].items() if k != "rel_l2"} for n in r} for r in results]}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
