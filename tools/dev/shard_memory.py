"""Per-rank memory and cost of weight sharding at full size: Wan 2.1 14B and FLUX.1 12B, random bf16 weights.

For each model, rank count N and sharding (``none``: every rank holds the whole model; ``blocks``: FSDP2 per block,
``parallel/shard.py``; ``blocks+offload``: the same with each rank's shards in host memory, FSDP2's CPU offload) the ranks run sequence-parallel (gathered K/V, full_sync) on one shared GPU under gloo, each
limited to 1/N of the card (``torch.cuda.set_per_process_memory_fraction``), and report their peak GPU memory, the
weights they hold, the bytes they gather, their host RSS and their time. A one-rank run of the whole model gives the
one-card compute the link model starts from.

Design decisions:

* **Real residency, a few blocks of forward.** Every rank builds the whole architecture (all 40 Wan blocks, all 57
  FLUX blocks) on the meta device and allocates only what it holds (its shards, or everything), then runs the forward
  through the first ``run_blocks`` blocks of each stack and the head. The blocks of a stack are identical, so the
  transient peak of one block is the peak of any block; the resident weights are all of them. A full forward per
  case would move ~30 GB per rank through gloo's host staging (sequence K/V plus weights) and does not fit the
  device time; the step time of the whole model is therefore the measured per-block time times the blocks (labelled).
* **Shared-GPU times are not a card's times.** N ranks on one GPU take turns on it and gloo stages every collective
  through the host: ``step_ms_shared`` is reported for completeness only. The modelled step times per link start
  from the one-card compute (measured), divided by N for a rank (sequence parallelism splits every layer's work),
  plus the link model of ``topology/links.py`` for the weight gathers and ``sampling.dit.step_cost`` for the
  sequence exchange, and compare with one card streaming the weights from host memory (``topology/shard_advice``).
  Every modelled number is labelled MODELLED.

Usage::

    python -m tools.dev.shard_memory --device cuda --out results/h200/sharding
    python -m tools.dev.shard_memory --tiny --device cpu --out /tmp/shard   # a CPU check
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from patchray.distributed.context import ParallelContext
from patchray.distributed.sampling.dit import FULL_SIZE_SHAPES, step_cost
from patchray.distributed.topology.links import get_profile, transfer_ms
from patchray.distributed.topology.shard_advice import offloaded_step_ms, sharded_step_ms

__all__ = ["MODELS", "run", "model_rows", "main"]

GIB = 1024**3

#: the public checkpoints' configurations (diffusers config.json of Wan-AI/Wan2.1-T2V-14B-Diffusers and
#: black-forest-labs/FLUX.1-dev) and the inputs of the README's sizes
MODELS: Dict[str, dict] = {
    "wan21_14b": dict(
        cls="WanTransformer3DModel", shape="wan21_14b_480x832x81", stacks=("blocks",),
        config=dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        latent=(16, 21, 60, 104), text=(512, 4096),
    ),
    "flux1_12b": dict(
        cls="FluxTransformer2DModel", shape="flux1_1024", stacks=("transformer_blocks", "single_transformer_blocks"),
        config=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                    axes_dims_rope=(16, 56, 56)),
        latent=(64, 64, 64), text=(512, 4096),
    ),
}

#: small stand-ins of the same classes for a CPU check of the whole pipeline (not figures)
TINY: Dict[str, dict] = {
    "wan21_14b": dict(MODELS["wan21_14b"], config=dict(MODELS["wan21_14b"]["config"], num_attention_heads=4, attention_head_dim=16,
                                                       text_dim=32, freq_dim=16, ffn_dim=64, num_layers=6),
                      latent=(16, 3, 16, 12), text=(8, 32)),
    "flux1_12b": dict(MODELS["flux1_12b"], config=dict(MODELS["flux1_12b"]["config"], num_layers=2, num_single_layers=4,
                                                       attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                                       pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)),
                      latent=(64, 8, 6), text=(8, 32)),
}


_BUFFERS: Dict[str, dict] = {}


def _buffers(spec: dict) -> dict:
    """The model's buffers (Wan's RoPE tables: computed at construction, not drawn), from a one-block, one-head copy
    of the class (the tables depend on the head width and the patch size only)."""
    key = spec["cls"]
    if key not in _BUFFERS:
        import diffusers

        cfg = dict(spec["config"], **{k: 1 for k in ("num_layers", "num_single_layers", "num_attention_heads") if k in spec["config"]})
        if "ffn_dim" in cfg:
            cfg["ffn_dim"] = 8
        _BUFFERS[key] = {k: v.clone() for k, v in getattr(diffusers, key)(**cfg).named_buffers()}
    return _BUFFERS[key]


def _build(spec: dict, device: torch.device, dtype: torch.dtype, ctx: ParallelContext, sharding: str):
    """The model on the meta device, then each rank allocates what it holds and draws it (per-name seeds)."""
    import diffusers

    from patchray.distributed.parallel.shard import shard_model
    from patchray.distributed.sampling.dit_families import shard_blocks_for

    cls = getattr(diffusers, spec["cls"])
    with torch.device("meta"):
        model = cls(**spec["config"]).to(dtype)
    buffers = _buffers(spec)

    offload = sharding == "blocks+offload"

    def materialize(m):
        from patchray.distributed import comm

        if offload:  # FSDP2's CPU offload wants the shards on the host; the rest on the device
            from patchray.distributed.sampling.ship import materialize_meta

            materialize_meta(m, device, torch.device("cpu"))
        else:
            m.to_empty(device=device)
        with torch.no_grad():
            for i, (name, p) in enumerate(m.named_parameters()):
                held = comm.local_shard(p)
                # host shards (offload) are drawn on the device and copied: a CPU generator is ~100x slower
                local = torch.empty_like(held, device=device) if held.device != device else held
                g = torch.Generator(device=device).manual_seed(1000 + i)
                if p.dim() == 1 and "norm" in name and "bias" not in name:
                    local.normal_(1.0, 0.1, generator=g)
                else:
                    fan_in = p.shape[-1] if p.dim() > 1 else 64
                    local.normal_(0.0, 0.5 / fan_in**0.5, generator=g)
                if local is not held:
                    held.copy_(local)
                    del local
            for name, b in m.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name].to(b.dtype))

    handle = None
    if sharding in ("blocks", "blocks+offload"):
        handle = shard_model(model, ctx, shard_blocks_for(model), offload=offload, init=materialize)
    else:
        materialize(model)
    return model.eval(), handle


def _inputs(name: str, spec: dict, device, dtype, batch: int = 1) -> dict:
    g = torch.Generator(device=device).manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)
    txt, tdim = spec["text"]
    if name.startswith("wan"):
        return dict(hidden_states=r(batch, *spec["latent"]), encoder_hidden_states=r(batch, txt, tdim),
                    timestep=torch.full((batch,), 500.0, device=device))
    c, h, w = spec["latent"]
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return dict(hidden_states=r(batch, h * w, c), encoder_hidden_states=r(batch, txt, tdim),
                pooled_projections=r(batch, spec["config"]["pooled_projection_dim"]), timestep=torch.full((batch,), 0.5, device=device),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(txt, 3, device=device), guidance=torch.full((batch,), 3.5, device=device))


def _truncate(model, stacks: Sequence[str], keep: int):
    """Keep the first ``keep`` blocks of each stack for the forward; returns the full lists (to put back) and the
    fraction of the model's blocks that run."""
    full, ran, total = {}, 0, 0
    for s in stacks:
        blocks = getattr(model, s)
        full[s] = blocks
        total += len(blocks)
        ran += min(keep, len(blocks))
        setattr(model, s, torch.nn.ModuleList(list(blocks)[:keep]))
    return full, ran, total


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _case(ctx: ParallelContext, name: str, spec: dict, sharding: str, run_blocks: int, dtype,
          gpu_per_rank: bool = False) -> dict:
    from patchray.distributed.sampling.dit import parallelize_dit

    device = ctx.device
    n = ctx.world_size
    cuda = device.type == "cuda"
    rec = {"model": name, "world_size": n, "sharding": sharding, "rank": ctx.rank}
    gc.collect()  # FSDP2 modules sit in reference cycles: a previous case's model is freed only by the collector
    if cuda:
        torch.cuda.set_per_process_memory_fraction(_fraction(n, gpu_per_rank), device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        rec["baseline_allocated_bytes"] = torch.cuda.memory_allocated(device)  # left over before this case (0 = clean)
    t0 = time.perf_counter()
    model, handle = _build(spec, device, dtype, ctx, sharding)
    rec["build_s"] = time.perf_counter() - t0
    from patchray.distributed import comm

    rec["resident_weight_bytes"] = sum(comm.local_shard(p).numel() * comm.local_shard(p).element_size() for p in model.parameters())
    rec["host_weight_bytes"] = sum(comm.local_shard(p).numel() * comm.local_shard(p).element_size() for p in model.parameters()
                                   if comm.local_shard(p).device.type == "cpu" and device.type != "cpu")  # offloaded shards
    rec["model_weight_bytes"] = sum(int(torch.Size(p.shape).numel()) * p.element_size() for p in model.parameters())
    if handle is not None:
        rec["block_bytes"] = handle.sharded_bytes
    seq = parallelize_dit(model, ctx, mode="gathered") if n > 1 else None
    inputs = _inputs(name, spec, device, dtype)
    full, ran, total = _truncate(model, spec["stacks"], run_blocks)
    rec["blocks_run"], rec["blocks_total"] = ran, total
    times = []
    with torch.no_grad():
        for _ in range(2):
            if handle is not None:
                handle.tally.reset()
            _sync(device)
            t = time.perf_counter()
            out = model(**inputs, return_dict=False)[0]
            _sync(device)
            times.append((time.perf_counter() - t) * 1e3)
            del out
    rec["forward_ms_run"] = times
    if handle is not None:
        rec["gathered_bytes_run"] = handle.tally.gathered
        rec["received_bytes_run"] = handle.tally.received
    for s, blocks in full.items():
        setattr(model, s, blocks)
    if handle is not None:
        for _, unit in handle.units:  # the last block run prefetched the next one, which never ran: free it
            if comm.is_sharded(unit):
                unit.reshard()
    if cuda:
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        rec["memory_fraction_bytes"] = int(_fraction(n, gpu_per_rank) * torch.cuda.get_device_properties(device).total_memory)
    try:  # POSIX only; on Windows the field stays empty
        import resource

        rec["host_rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except ImportError:
        rec["host_rss_peak_bytes"] = None
    if seq is not None:
        seq.remove()
    del model, handle, seq, inputs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def _fraction(n: int, gpu_per_rank: bool) -> float:
    """The share of its GPU a rank may allocate: 1/N of a shared card, 95% of a card of its own."""
    return 0.95 if gpu_per_rank else min(0.95, 0.97 / n)


def _bench_rank(ctx: ParallelContext, cases: List[tuple], tiny: bool, run_blocks: int, dtype_name: str,
                gpu_per_rank: bool = False) -> List[dict]:
    from patchray.distributed import comm

    dtype = getattr(torch, dtype_name)
    table = TINY if tiny else MODELS
    groups = {}
    out = []
    for name, n, sharding in cases:
        if n not in groups:
            # every rank calls new_group for every size (members only would do; all calling keeps the order simple)
            groups[n] = ParallelContext.single(ctx.device) if n == 1 else (
                ctx if n == ctx.world_size else (comm.context_for_group(comm.new_group(range(n)), ctx.device) if ctx.rank < n else None))
        sub = groups[n]
        if ctx.rank < n:
            try:
                out.append(_case(sub, name, table[name], sharding, run_blocks, dtype, gpu_per_rank))
            except Exception as exc:  # recorded; every rank of a case fails alike (same shapes, same memory cap)
                kind = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
                out.append({"model": name, "world_size": n, "sharding": sharding, "rank": ctx.rank,
                            "error": f"{kind}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"})
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            partial = os.environ.get("SHARD_BENCH_PARTIAL")
            if partial:  # what is done survives a run cut short
                with open(f"{partial}.rank{ctx.rank}.jsonl", "a") as f:
                    f.write(json.dumps(out[-1]) + "\n")
        comm.uncounted_barrier(ctx)
    return out


def model_rows(records: List[dict], profiles: Sequence[str] = ("nvlink", "pcie4_x16_no_p2p")) -> List[dict]:
    """MODELLED step times per model, N and link, from the one-card compute measured in ``records``."""
    rows = []
    one = {r["model"]: r for r in records if r.get("world_size") == 1 and "forward_ms_run" in r}
    for name, base in one.items():
        # per-block time of the whole model on one card: the second (warm) forward over the blocks that ran
        t_one = base["forward_ms_run"][-1] * base["blocks_total"] / base["blocks_run"]
        weights = base["model_weight_bytes"]
        shape = FULL_SIZE_SHAPES[MODELS[name]["shape"]]
        blocks = max((r.get("block_bytes", 0) for r in records if r["model"] == name), default=0) or 0.97 * weights
        for n in sorted({r["world_size"] for r in records if r["model"] == name and r["world_size"] > 1}):
            for prof in profiles:
                p = get_profile(prof)
                seq = step_cost(shape, n, "auto", link=prof)  # the sampler's default: the cheaper of gathered/ulysses
                seq_ms = transfer_ms(seq["wire_bytes"], p) + seq["messages"] * p.latency_us / 1e3
                compute = t_one / n
                none = compute + seq_ms
                overlap = sharded_step_ms(compute, blocks, n, p) + seq_ms
                serial = sharded_step_ms(compute, blocks, n, p, overlap=False) + seq_ms
                offload = offloaded_step_ms(t_one, weights)
                rows.append({
                    "label": "MODELLED", "model": name, "world_size": n, "link": prof, "sequence_mode": seq["mode"],
                    "one_card_compute_ms_measured": t_one, "rank_compute_ms": compute,
                    "weight_gather_received_bytes": blocks * (n - 1) / n, "sequence_wire_bytes": seq["wire_bytes"],
                    "step_ms_none": none, "step_ms_blocks_prefetch": overlap, "step_ms_blocks_no_overlap": serial,
                    "one_card_offloaded_ms": offload, "blocks_slower_than_offload": overlap > offload,
                })
    return rows


def run(models: Sequence[str], ranks: Sequence[int], shardings: Sequence[str], *, device: str, tiny: bool,
        run_blocks: int, dtype: str = "bfloat16", timeout_s: float = 900.0, gpu_per_rank: bool = False) -> dict:
    from patchray.distributed.spawn import run_ranks

    # blocks first (the figures the goal is about), then the one-card reference, then every rank holding everything
    cases = [(m, n, "blocks") for m in models for n in ranks if "blocks" in shardings]
    cases += [(m, n, "blocks+offload") for m in models for n in ranks if "blocks+offload" in shardings]
    cases += [(m, 1, "none") for m in models]
    cases += [(m, n, "none") for m in models for n in ranks if "none" in shardings]
    world = max(ranks)
    # one GPU per rank (NCCL): real per-card peaks and step times; otherwise the ranks share one GPU under gloo
    results = run_ranks(_bench_rank, world, cases, tiny, run_blocks, dtype, gpu_per_rank,
                        backend="nccl" if gpu_per_rank else "gloo", device=device, timeout_s=timeout_s, gpu_per_rank=gpu_per_rank)
    records = [r for per_rank in results for r in per_rank]
    env = {"torch": torch.__version__, "device": device, "tiny": tiny, "dtype": dtype, "run_blocks": run_blocks,
           "placement": "one GPU per rank" if gpu_per_rank else ("CPU ranks" if device == "cpu" else "ranks share one GPU")}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return {"env": env, "records": records, "modelled": model_rows(records)}


def _chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if r["world_size"] > 1]
    models = sorted({r["model"] for r in recs})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        labels, vals, errs = [], [], []
        for n in sorted({r["world_size"] for r in recs if r["model"] == m}):
            for s in ("none", "blocks", "blocks+offload"):
                rs = [r for r in recs if r["model"] == m and r["world_size"] == n and r["sharding"] == s]
                if not rs:
                    continue
                # the rank processes that ran the fewest cases before this one (leftovers of earlier cases inflate a
                # peak: see the README); the largest of their peaks
                fewest = min(r.get("prior_cases_on_rank", 0) for r in rs)
                rs = [r for r in rs if r.get("prior_cases_on_rank", 0) == fewest]
                labels.append(f"N={n} {s}" + (f" (after {fewest} cases)" if fewest else ""))
                err = next((r["error"] for r in rs if "error" in r), None)
                vals.append(None if err else max(r.get("peak_allocated_bytes", 0) for r in rs) / GIB)
                errs.append(err)
        ys = list(range(len(labels)))[::-1]
        for y, v, e in zip(ys, vals, errs):
            if v is None:
                ax.barh(y, 0.1, color="none", hatch="//", edgecolor="red")
                ax.text(0.2, y, "OOM (leftovers of earlier cases)", va="center", color="red", fontsize=8)
            else:
                ax.barh(y, v, color="tab:blue" if "blocks" in labels[ys.index(y)] else "tab:gray")
                ax.text(v, y, f" {v:.1f}", va="center")
        ax.set_yticks(ys)
        ax.set_yticklabels(labels)
        for limit in (20, 12):
            ax.axvline(limit, color="tab:red", ls="--", lw=0.8)
        ax.set_xlabel("largest rank's peak GPU memory allocated (GiB)")
        ax.set_title(f"{m}: per-rank peak (goal: <20 GiB at N=2, <12 GiB at N=4)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _assemble(folder: str, out: str) -> int:
    """The JSON and chart of a run cut short (or whose result did not come back) from its per-rank partial files;
    ``prior_cases_on_rank`` says how many cases that rank process ran before (see the README on leftovers)."""
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "partial.rank*.jsonl"))):
        for i, line in enumerate(open(path)):
            r = json.loads(line)
            r["prior_cases_on_rank"] = i
            records.append(r)
    result = {"env": {"assembled_from": sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "partial.rank*.jsonl")))},
              "records": records, "modelled": model_rows(records)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "shard_memory.json"), "w") as f:
        json.dump(result, f, indent=1)
    _chart(result, os.path.join(out, "shard_memory.png"))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.dev.shard_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="wan21_14b,flux1_12b")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sharding", default="none,blocks", help="comma-separated: none, blocks, blocks+offload")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="small stand-ins of the same classes (a CPU check, not figures)")
    ap.add_argument("--run-blocks", type=int, default=2, help="blocks of each stack the forward runs through")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--gpu-per-rank", action="store_true", help="rank r on GPU r, NCCL (a multi-GPU machine)")
    ap.add_argument("--out", required=True, help="folder for shard_memory.json and shard_memory.png")
    ap.add_argument("--assemble", default=None, help="build the JSON and chart from a run's partial.rank*.jsonl in this folder")
    a = ap.parse_args(argv)
    if a.assemble:
        return _assemble(a.assemble, a.out)
    result = run(a.models.split(","), [int(x) for x in a.ranks.split(",")], a.sharding.split(","), device=a.device,
                 tiny=a.tiny, run_blocks=a.run_blocks, dtype=a.dtype, timeout_s=a.timeout, gpu_per_rank=a.gpu_per_rank)
    result["command"] = "python -m tools.dev.shard_memory " + " ".join(sys.argv[1:] if argv is None else argv)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "shard_memory.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        _chart(result, os.path.join(a.out, "shard_memory.png"))
    except ImportError:
        pass
    for r in result["records"]:
        print(json.dumps({k: r.get(k) for k in ("model", "world_size", "sharding", "rank", "peak_allocated_bytes", "resident_weight_bytes", "forward_ms_run", "error")}))
    for r in result["modelled"]:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
