"""``python -m tools.dev.dit_error``: final-latent error and bytes per step of the DiT sampling presets.

For one world size N, every rank builds the same random-weight diffusers DiT (FLUX.1, Qwen-Image or Wan 2.1 layout:
full width or tiny, ``--layers`` blocks), runs a rectified-flow Euler loop (``--steps``, sigmas shifted as FLUX/Wan schedulers shift
them: ``s' = shift s / (1 + (shift - 1) s)``) once per preset through ``parallelize_dit(config=...)``, and records:

* the final latent's relative L2 error against the ``full_sync`` run of the same N (which equals the single-rank
  result within floating-point tolerance; the CI tests check that);
* bytes this rank sent per step by kind, synchronous and asynchronous (the accounting of ``comm_manager.Traffic``:
  packed sizes for the compressed modes), per step and averaged over the run.

Several warm-up counts (``--warmup 1 --warmup 2 --warmup 4``) and text layouts (``--text whole --text sharded``:
the joint-attention families' text tokens kept whole on every rank or sharded with the image tokens) run in one
spawn; with more than one of either, each result is keyed ``preset/wW/text`` (one of each: the preset's name, as
before).

Every step is also timed with the ranks running at once (``step_ms``: wall time from the step's start to the end of
this rank's device work; ``mean_step_ms`` over the steps after the first, which pays one-time set-up). Only with
one GPU per rank (``--gpu-per-rank``, NCCL) is that a multi-GPU step time; ranks sharing one GPU, or CPU cores,
compete for it (per-rank compute measured alone is the job of ``dit_bench``; a displaced or compressed step computes
what a full_sync step computes plus the residual codec). The speed-up over one GPU is the ``--ranks 1`` run's
full_sync ``mean_step_ms`` over this one's.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional

import torch

__all__ = ["run_dit_error", "main", "PRESET_NAMES"]

PRESET_NAMES = ("full_sync", "displaced", "compressed", "compressed_2bit", "compressed_1bit", "balanced", "otil")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.dim() == 1 and "norm" in name and "bias" not in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 64
                p.copy_(noise * (1.0 / fan_in**0.5))


def build(family: str, layers: int, size: str, device, dtype, seed: int = 0, text_tokens: Optional[int] = None):
    """``(model, inputs, row_dim or None)``: ``inputs`` are the forward's keyword arguments except timestep;
    ``text_tokens``: the prompt's tokens (default: 512 full width, 8 tiny)."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    r = lambda *s: torch.randn(*s, generator=g)
    if family == "flux":
        from diffusers import FluxTransformer2DModel

        heads, dim, hw, txt = (24, 128, 64, 512) if size == "full" else (4, 16, 12, 8)
        txt = text_tokens or txt
        m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=layers, num_single_layers=2 * layers,
                                   attention_head_dim=dim, num_attention_heads=heads,
                                   joint_attention_dim=4096 if size == "full" else 32, pooled_projection_dim=768 if size == "full" else 16,
                                   guidance_embeds=False, axes_dims_rope=(16, 56, 56) if size == "full" else (4, 6, 6))
        ids = torch.zeros(hw, hw, 3)
        ids[..., 1] = torch.arange(hw)[:, None]
        ids[..., 2] = torch.arange(hw)[None, :]
        inputs = dict(hidden_states=r(1, hw * hw, 64), encoder_hidden_states=r(1, txt, m.config.joint_attention_dim),
                      pooled_projections=r(1, m.config.pooled_projection_dim), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(txt, 3))
        row_dim = None
    elif family == "qwen":
        from diffusers import QwenImageTransformer2DModel

        # Qwen-Image: 24 heads x 128, 1328x1328 -> 83x83 tokens (2x2 patches of the 16-channel latent, packed to 64)
        heads, dim, hw, txt = (24, 128, 83, 256) if size == "full" else (4, 16, 12, 8)
        txt = text_tokens or txt
        m = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=layers, attention_head_dim=dim,
                                        num_attention_heads=heads, joint_attention_dim=3584 if size == "full" else 32,
                                        axes_dims_rope=(16, 56, 56) if size == "full" else (4, 6, 6))
        inputs = dict(hidden_states=r(1, hw * hw, 64), encoder_hidden_states=r(1, txt, m.config.joint_attention_dim),
                      encoder_hidden_states_mask=torch.ones(1, txt, dtype=torch.bool), img_shapes=[[(1, hw, hw)]])
        row_dim = None
    elif family == "wan":
        from diffusers import WanTransformer3DModel

        heads, dim, (t, h, w), txt = (40, 128, (21, 60, 104), 512) if size == "full" else (4, 16, (3, 16, 12), 8)
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=dim, in_channels=16,
                                  out_channels=16, text_dim=4096 if size == "full" else 32, freq_dim=256 if size == "full" else 32,
                                  ffn_dim=13824 if size == "full" else 128, num_layers=layers, cross_attn_norm=True,
                                  qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)
        inputs = dict(hidden_states=r(1, 16, t, h, w), encoder_hidden_states=r(1, txt, m.config.text_dim))
        row_dim = -2
    else:
        raise ValueError(f"family must be flux, qwen or wan (got {family!r})")
    _randomize(m, seed)
    m = m.to(device=device, dtype=dtype).eval()
    inputs = {k: (v if not isinstance(v, torch.Tensor) else v.to(device=device, dtype=dtype)
                  if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v.to(device)) for k, v in inputs.items()}
    return m, inputs, row_dim


def sigmas(steps: int, shift: float = 3.0) -> List[float]:
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).tolist()


def _rank(ctx, plan: dict) -> dict:
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.dit import parallelize_dit
    from patchray.distributed.bench.turns import settle

    dev = ctx.device
    dtype = getattr(torch, plan["dtype"])
    model, inputs, row_dim = build(plan["family"], plan["layers"], plan["size"], dev, dtype, text_tokens=plan.get("text_tokens"))
    x0 = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator(device="cpu").manual_seed(7)).to(dev, dtype)
    sig = sigmas(plan["steps"], plan["shift"])
    out = {}
    finals = {}
    warmups, texts = plan.get("warmups") or [plan["warmup"]], plan.get("texts") or [None]
    keyed = len(warmups) > 1 or len(texts) > 1
    runs = []
    for name in plan["presets"]:
        for w in ([None] if name == "full_sync" else warmups):
            for text in ([None] if name == "full_sync" else texts):
                key = name if not keyed or name == "full_sync" else f"{name}/w{w}/{text or 'default'}"
                runs.append((key, name, w, text))
    if plan.get("cases"):  # an explicit list of preset/wW/text keys (full_sync always runs: the reference)
        runs = [r for r in runs if r[0] == "full_sync"] + [(c, c.split("/")[0], int(c.split("/")[1][1:]), c.split("/")[2])
                                                           for c in plan["cases"]]
    for key, name, w, text in runs:
        cfg = preset(name) if name == "full_sync" else preset(name, split_batch=False, warmup_steps=w)
        shard_text = None if text is None else text == "sharded"
        h = parallelize_dit(model, ctx, mode=plan.get("mode", "gathered"), config=cfg, shard_text=shard_text, link=plan.get("link"))
        x = x0.clone()
        per_step = []
        step_ms = []
        settle(ctx)
        t0 = time.perf_counter()
        for i in range(plan["steps"]):
            ts = time.perf_counter()
            before = h.traffic.snapshot()
            h.begin_step(i)
            with torch.no_grad():
                v = model(**dict(inputs, hidden_states=x), timestep=torch.full((1,), sig[i], device=dev, dtype=dtype) * (1000 if plan["family"] == "wan" else 1),
                          return_dict=False)[0]
            h.end_step()
            x = x + (sig[i + 1] - sig[i]) * v
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            step_ms.append((time.perf_counter() - ts) * 1e3)
            d = h.traffic.diff(h.traffic.snapshot(), before)
            per_step.append({"bytes": {k: v for k, v in d["bytes"].items() if v}, "async": {k: v for k, v in d["async_bytes"].items() if v}})
        h.state.finish()
        x = h.finalize_rows(x, row_dim) if row_dim is not None else h.finalize_tokens(x)
        finals[key] = x.float().cpu()
        h.remove()
        tot = [sum(s["bytes"].values()) for s in per_step]
        asy = [sum(s["async"].values()) for s in per_step]
        out[key] = {"preset": name, "warmup": w, "text": text, "bytes_per_step": tot, "async_bytes_per_step": asy, "mean_bytes_per_step": sum(tot) / len(tot),
                     "mean_async_bytes_per_step": sum(asy) / len(asy), "by_kind_last_step": per_step[-1], "wall_s": time.perf_counter() - t0,
                    "step_ms": [round(v, 3) for v in step_ms],
                    "mean_step_ms": round(sum(step_ms[1:]) / len(step_ms[1:]), 3) if len(step_ms) > 1 else None}
    ref = finals.get("full_sync")
    for name in out:
        out[name]["rel_l2_vs_full_sync"] = None if ref is None else float((finals[name] - ref).norm() / ref.norm())
    return out


def run_dit_error(family: str, ranks: int, *, layers: int = 2, size: str = "full", steps: int = 20, warmup=4,
                  shift: float = 3.0, presets=PRESET_NAMES, device: str = "cpu", dtype: str = "float32",
                  out: Optional[str] = None, texts=None, text_tokens: Optional[int] = None, mode: str = "gathered",
                  link: Optional[str] = None, cases=None, gpu_per_rank: bool = False, backend: Optional[str] = None) -> dict:
    """Run the presets on ``ranks`` spawned ranks; ``warmup``: one warm-up count or a list of them; ``texts``: a list
    of ``"whole"``/``"sharded"`` (``None``: ``parallelize_dit``'s default for each preset); ``cases``: instead of the
    cross product, these ``preset/wW/text`` keys (and full_sync); ``gpu_per_rank``: rank r on ``cuda:r`` (NCCL unless
    ``backend`` says otherwise), the placement whose step times are multi-GPU step times."""
    from patchray.distributed.spawn import run_ranks

    warmups = [int(warmup)] if isinstance(warmup, int) else [int(w) for w in warmup]
    plan = dict(family=family, layers=layers, size=size, steps=steps, warmup=warmups[0], warmups=warmups, shift=shift,
                presets=list(presets), dtype=dtype, texts=list(texts) if texts else None, text_tokens=text_tokens, mode=mode, link=link,
                cases=list(cases) if cases else None)
    backend = backend or ("nccl" if gpu_per_rank else "gloo")
    if backend == "nccl" and not gpu_per_rank and ranks > 1:
        raise ValueError("NCCL refuses two ranks on one GPU: use --backend gloo, or --gpu-per-rank on a multi-GPU machine")
    t0 = time.time()
    per_rank = run_ranks(_rank, ranks, plan, device=device, timeout_s=1800, backend=backend, gpu_per_rank=gpu_per_rank)
    placement = "one GPU per rank" if gpu_per_rank else ("CPU ranks" if device == "cpu" else "ranks share one GPU")
    doc = {"benchmark": "dit-error", "ranks": ranks, "device": device, **plan, "wall_s": time.time() - t0,
           "placement": placement, "backend": backend,
           "step_ms_note": ("measured with the ranks at once; a multi-GPU step time only with one GPU per rank (or one "
                            "rank): ranks sharing a device compete for it" + ("" if gpu_per_rank or ranks == 1 else
                                                                            ": NOT a multi-GPU figure here")),
           "note": "rel_l2_vs_full_sync: final latent vs the full_sync run of the same N; bytes: what rank 0 sent per step "
                   "(Traffic accounting: all-gathers count bytes x (N-1), compressed slots their packed size)",
           "results": per_rank[0], "rel_l2_by_rank": [{k: v["rel_l2_vs_full_sync"] for k, v in r.items()} for r in per_rank]}
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def chart(paths: List[str], out: str) -> None:
    """Final-latent error vs full_sync and mean bytes per step, per preset, from ``dit_error`` JSONs and
    ``sample-bench`` JSONs (their ``rel_l2`` is against the one-rank reference, which full_sync equals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for path in paths:
        d = json.load(open(path))
        if d.get("benchmark") == "dit-error":
            res = {k: (v["rel_l2_vs_full_sync"], v["mean_bytes_per_step"]) for k, v in d["results"].items() if k != "full_sync"}
            label = f"{d['family']} {d['size']} N={d['ranks']}"
        else:
            res = {c["case"]: (c["rel_l2"], sum(c["bytes_per_step_total"]) / len(c["bytes_per_step_total"])) for c in d["cases"]
                   if c["case"] != "full_sync"}
            label = f"SDXL {'tiny' if 'tiny' in str(d.get('model', '')).lower() or d['latent'][-1] < 64 else ''} N={d['ranks']}"
        series.append((label, res))
    names = [n for n in ("displaced", "compressed", "compressed_2bit", "compressed_1bit", "otil", "otil_compressed", "balanced")
             if any(n in r for _, r in series)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        axes[0].bar([j + i * w for j in range(len(series))], [r.get(n, (0, 0))[0] for _, r in series], w, label=n)
        axes[1].bar([j + i * w for j in range(len(series))], [r.get(n, (0, 0))[1] / 1e6 for _, r in series], w, label=n)
    for ax, title in zip(axes, ("final-latent rel. L2 vs full_sync (measured, CPU ranks)", "MB per step per rank (mean over the run)")):
        ax.set_xticks([j + 0.4 for j in range(len(series))], [s for s, _ in series], fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=["flux", "qwen", "wan"], default="flux")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, action="append", default=None, help="warm-up steps (repeat for several; default 4)")
    ap.add_argument("--text", action="append", choices=["whole", "sharded"], default=None,
                    help="joint-attention text tokens whole on every rank or sharded (repeat for both; default: the preset's)")
    ap.add_argument("--text-tokens", type=int, default=None, help="prompt tokens (default 512 full width, 8 tiny)")
    ap.add_argument("--attention", default="gathered", help="parallelize_dit's mode (auto: the exact warm-up steps by the link's cheapest)")
    ap.add_argument("--link", default=None, help="link profile for --attention auto")
    ap.add_argument("--case", action="append", default=None,
                    help="run exactly these PRESET/wW/TEXT keys (e.g. compressed/w1/sharded; repeatable) and full_sync")
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--preset", action="append", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu-per-rank", action="store_true", help="rank r on GPU r (NCCL unless --backend gloo)")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--chart-from", nargs="+", default=None, help="JSONs to chart into --out (a .png); nothing is run")
    a = ap.parse_args(argv)
    if a.chart_from:
        chart(a.chart_from, a.out)
        return 0
    doc = run_dit_error(a.family, a.ranks, layers=a.layers, size=a.size, steps=a.steps, warmup=a.warmup or [4], shift=a.shift,
                        presets=a.preset or (["full_sync"] if a.case else PRESET_NAMES), device=a.device, dtype=a.dtype, out=a.out, texts=a.text,
                        text_tokens=a.text_tokens, mode=a.attention, link=a.link, cases=a.case,
                        gpu_per_rank=a.gpu_per_rank, backend=a.backend)
    for name, r in doc["results"].items():
        print(f"{name:28s} rel L2 vs full_sync {r['rel_l2_vs_full_sync']:.3e}  MB/step {r['mean_bytes_per_step'] / 1e6:8.3f}"
              f"  async {r['mean_async_bytes_per_step'] / 1e6:8.3f}  wall {r['wall_s']:.1f}s  step {r['mean_step_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
