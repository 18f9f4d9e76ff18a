"""The rig model: MODELLED seconds per step and memory per rank of every PatchRay mode on N cards of one kind.

``python -m patchray plan-rig --card rtx4090 --ranks 2 --link pcie4_x16_no_p2p --model flux1 --height 1024 --width 1024``

Design decisions:

* **Compute from the H200, scaled by a stated rule** (:mod:`.rig_compute`): one rank's GPU time per call, by part
  (GEMMs, attention, memory-bound), each part scaled to the card by the matching datasheet ratio (:mod:`.rig_cards`),
  the CPU's issue time as a floor for eager calls.
* **Communication from the runtime's own cost functions** (``sampling.dit_traffic.step_cost``,
  ``parallel.seq_cost.attention_cost``, ``sampling.split.split_cost``; the bytes the CI tests check against comm's
  accounting of real runs) over the link's profile (:mod:`.rig_links`: ``latency + bytes / bandwidth``, twice through
  host memory without peer-to-peer). What hides behind compute follows ``tools/dit_kernel_model.py``:
  ``gathered`` and ``ulysses`` block; ``overlapped`` hides the K/V gather behind the rank's attention to its own keys
  (1/N of its attention); ``ring`` behind (N-1)/N of it; the output gather and the modulation all-gather block.
* **The stale presets** (displaced, compressed 4/2/1-bit) use the sampling benchmark's run model
  (``bench/compressed_model.dit_run``: exact warm-up steps, the stale memory's fill, then asynchronous steps whose
  stream hides behind compute) with the codec measured on the H200 (``topology/preset_cost.CODEC_MS_PER_GB``, Triton)
  scaled by memory bandwidth; their text stays whole (the presets' default).
* **Weight sharding** (``blocks``, ``blocks+offload``): every call gathers ``(N-1)/N`` of the block bytes over the
  link (prefetched behind compute), ``blocks+offload`` first copies the rank's shard from pinned host memory over the
  card's own PCIe link (``topology/shard_advice``'s model); the link carries the gathers and the sequence exchange one
  after the other, so a call ends when both the compute and the link are done.
* **Memory per rank** = resident weights (all; ``blocks``: ``1/N`` of the blocks and the rest whole; ``+offload``:
  the rest only) + the gathered blocks in flight (3 x the largest: the running one, the prefetched one and the
  prefetch's all-gather buffer) + the activations (the H200's measured transient, scaled by the rank's tokens) +
  1 GiB (CUDA context). A row that does not fit is still modelled, with the excess streamed from host memory every
  call over the card's PCIe link (what ComfyUI's offload does), and says so.
* **Every figure is MODELLED** and each row says what it came from. Nothing here runs a model.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

from ..parallel.seq_cost import attention_cost
from ..sampling.dit_traffic import step_cost, token_shards
from ..topology.links import LinkProfile, transfer_ms
from ..topology.preset_cost import CODEC_MS_PER_GB
from .rig_cards import REFERENCE_CARD, CardProfile, get_card
from .rig_compute import (GIB, RigModel, activation_gib, basis, card_call_ms, get_model, h200_call_parts,
                          issue_floor_ms, model_shape, rank_call_ms, rank_overhead, vae_decode_ms, weight_bytes_per_param,
                          WEIGHTS, gemm_tflops, casts_weights)
from .rig_links import effective_link, get_link, host_link

__all__ = ["ATTENTIONS", "PRESETS", "SHARDINGS", "CONTEXT_GIB", "INFLIGHT_BLOCKS", "plan", "format_plan"]

ATTENTIONS = ("gathered", "overlapped", "ring", "ulysses")
PRESETS = (("displaced", 0), ("compressed", 4), ("compressed_2bit", 2), ("compressed_1bit", 1))
SHARDINGS = ("none", "blocks", "blocks+offload")
#: memory kept aside on every card for the CUDA context and the allocator
CONTEXT_GIB = 1.0
#: gathered blocks a sharded rank holds at once: the running block, the prefetched one, the prefetch's all-gather buffer
INFLIGHT_BLOCKS = 3
#: the stale presets' exact warm-up steps (DistriFusion's 4, the presets' default)
PRESET_WARMUP = 4


def _link_ms(nbytes: float, messages: int, p: LinkProfile) -> float:
    return transfer_ms(nbytes, p) + messages * p.latency_us / 1e3


class _Ctx:
    """What every row of one plan shares."""

    def __init__(self, card: CardProfile, model: RigModel, shape, n: int, link: Optional[LinkProfile], weights: str,
                 kernels: str, steps: int, calls: Optional[int] = None):
        self.card, self.model, self.shape, self.n, self.link = card, model, shape, n, link
        self.weights, self.kernels, self.steps = weights, kernels, steps
        self.bpp = weight_bytes_per_param(weights)
        self.w = model.params * self.bpp
        self.wb = model.block_params * self.bpp
        self.largest = model.largest_block_params * self.bpp
        self.issue = issue_floor_ms(model, kernels)
        self.host = host_link(card)
        self.calls = int(calls or model.calls_per_step)

    def gpu(self, n: int, shard_text: bool = True) -> Dict[str, float]:
        return rank_call_ms(self.model, self.shape, self.card, n, self.weights, self.kernels, shard_text)

    def floor(self, gpu_ms: float) -> float:
        return max(gpu_ms, self.issue) if self.issue else gpu_ms

    def memory(self, n_act: int, resident: float, inflight: float = 0.0) -> dict:
        act = activation_gib(self.model, self.shape, n_act)
        total = resident / GIB + inflight / GIB + act + CONTEXT_GIB
        return {"weights_gib": round(resident / GIB, 2), "inflight_blocks_gib": round(inflight / GIB, 2),
                "activations_gib": round(act, 2), "context_gib": CONTEXT_GIB, "total_gib": round(total, 2),
                "card_gib": self.card.memory_gib, "fits": total <= self.card.memory_gib}

    def stream_ms(self, mem: dict) -> float:
        """Host -> device streaming of what does not fit, per call (ComfyUI's offload), over the card's PCIe link."""
        excess = mem["total_gib"] - self.card.memory_gib
        return 0.0 if excess <= 0 else excess * GIB / (self.host.bandwidth_gbps * 1e9) * 1e3


def _row(mode: str, ctx: _Ctx, call_ms: float, mem: dict, *, calls: Optional[int] = None, extra_ms: float = 0.0,
         attention=None, preset=None, sharding="none", ranks=None, comm: Optional[dict] = None, notes=(), source="",
         step_ms=None) -> dict:
    """One row: a step is ``calls`` (default: the model's calls per step) x the call, at least the streaming of what
    does not fit, plus ``extra_ms`` (a per-step exchange); ``step_ms`` overrides (the presets' run mean)."""
    stream = ctx.stream_ms(mem)
    call = max(call_ms, stream)
    step = (ctx.calls if calls is None else calls) * call + extra_ms if step_ms is None else step_ms
    notes = list(notes)
    if not mem["fits"]:
        notes.append(f"does not fit {ctx.card.memory_gib:g} GiB: modelled with {mem['total_gib'] - ctx.card.memory_gib:.1f} "
                     f"GiB streamed from host memory every call ({stream:.0f} ms over {ctx.host.name})")
    return {"mode": mode, "attention": attention, "preset": preset, "sharding": sharding,
            "ranks": ctx.n if ranks is None else ranks, "label": "MODELLED",
            "s_per_step": round(step / 1e3, 4), "total_s": round(step * ctx.steps / 1e3, 2),
            "call_ms": round(call, 2), "comm": comm, "memory": mem, "notes": notes, "from": source}


def _seq_comm(ctx: _Ctx, n: int, attention: str, gpu: Dict[str, float], shard_text: bool = True) -> dict:
    """Per call: the exchange's bytes and time on the link, and what of it stays exposed."""
    p = ctx.link
    sc = step_cost(ctx.shape, n, attention, itemsize=2, link=p, shard_text=shard_text)
    counts = token_shards(ctx.shape, n, shard_text).seq_counts
    att = attention_cost(attention, counts, ctx.shape.heads, ctx.shape.head_dim, 2,
                         replicated=0 if shard_text else ctx.shape.text)
    att_bytes, att_msgs = ctx.shape.attention_layers * att.wire_bytes, ctx.shape.attention_layers * att.messages
    att_ms = _link_ms(att_bytes, att_msgs, p)
    other_ms = _link_ms(sc["wire_bytes"] - att_bytes, sc["messages"] - att_msgs, p)
    hide = {"overlapped": gpu["attention"] / n, "ring": gpu["attention"] * (n - 1) / n}.get(attention, 0.0)
    exposed = other_ms + max(0.0, att_ms - hide)
    return {"wire_gb_per_call": round(sc["wire_bytes"] / 1e9, 4), "messages_per_call": sc["messages"],
            "link_ms_per_call": round(att_ms + other_ms, 2), "exposed_ms_per_call": round(exposed, 2),
            "hidden_behind_attention_ms": round(min(hide, att_ms), 2)}


def _sources(ctx: _Ctx) -> str:
    b = basis(ctx.model, ctx.kernels)
    return "; ".join(b["sources"])


def plan(card, ranks: int, link, model, height: int, width: int, frames: int = 1, steps: Optional[int] = None,
         weights: str = "bf16", kernels: str = "eager", attention: str = "auto", warmup: int = PRESET_WARMUP,
         calls_per_step: Optional[int] = None) -> dict:
    """The MODELLED plan of ``ranks`` x ``card`` on ``link`` for ``model`` at ``height x width (x frames)``.

    ``calls_per_step``: model calls per sampling step (default: the model's: 2 with CFG, 1 for FLUX.1-dev); 1 models a
    CFG-free run (CFG 1, or a distilled checkpoint), which leaves nothing for the cfg modes to split.

    Raises ``ValueError`` with the valid choices for an unknown card, link, model, weights, kernels or attention, and
    for a size or link the model or card cannot take.
    """
    card = get_card(card)
    model = get_model(model)
    n = int(ranks)
    if n < 1:
        raise ValueError(f"ranks must be >= 1 (got {ranks})")
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; valid: {', '.join(WEIGHTS)}")
    if calls_per_step is not None and int(calls_per_step) not in (1, 2):
        raise ValueError(f"calls_per_step must be 1 or 2 (got {calls_per_step})")
    if attention not in ("auto",) + ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}; valid: auto, {', '.join(ATTENTIONS)}")
    basis(model, kernels)  # validates kernels
    shape = model_shape(model, height, width, frames)
    get_link(link)
    link_notes: List[str] = []
    profile = None
    if n > 1:
        profile, link_notes = effective_link(card, link, n)
    steps = int(steps or model.steps)
    ctx = _Ctx(card, model, shape, n, profile, weights, kernels, steps, calls_per_step)
    src = _sources(ctx)

    one_gpu = ctx.gpu(1)
    one_mem = ctx.memory(1, ctx.w)
    one = _row("one card", ctx, ctx.floor(one_gpu["total"]), one_mem, ranks=1,
               source="one card: " + src)
    ref_step = one["s_per_step"] * 1e3
    rows: List[dict] = []

    def add(row: dict) -> dict:
        row["speedup"] = round(ref_step / (row["s_per_step"] * 1e3) * (row.pop("_batch", 1)), 3)
        rows.append(row)
        return row

    seq_rows: Dict[str, dict] = {}
    if n > 1:
        gpu = ctx.gpu(n)
        over, measured_n = rank_overhead(model, n, kernels)
        seq_src = (f"per-rank compute: the H200 call x token share x overhead {over:.3f} (measured at N = "
                   f"{measured_n}); traffic: sampling.dit_traffic.step_cost on {profile.name}; " + src)
        for att in ATTENTIONS:
            if att == "ulysses" and shape.heads % n:
                continue
            comm = _seq_comm(ctx, n, att, gpu)
            call = ctx.floor(gpu["total"] + comm["exposed_ms_per_call"])
            seq_rows[att] = add(_row("sequence", ctx, call, ctx.memory(n, ctx.w), attention=att, comm=comm,
                                     source=seq_src))
        best = min(seq_rows, key=lambda a: seq_rows[a]["s_per_step"])
        chosen = best if attention == "auto" else attention
        if chosen not in seq_rows:
            raise ValueError(f"attention {chosen!r} needs the heads ({shape.heads}) to divide by the ranks ({n}); valid "
                             f"here: {', '.join(seq_rows)}")

        # CFG-parallel: each rank one branch (N = 2), then one exchange of the output
        latent = (shape.frames * shape.rows * shape.cols * shape.out_features,)
        from ..sampling.split import split_cost

        cfg_x = split_cost(latent, 2, 2, 2)
        cfg_ms = _link_ms(cfg_x["wire_bytes"], cfg_x["messages"], profile)
        if ctx.calls == 2 and n == 2:
            add(_row("cfg", ctx, ctx.floor(one_gpu["total"]), ctx.memory(1, ctx.w), calls=1, extra_ms=cfg_ms,
                     comm={"wire_gb_per_step": round(cfg_x["wire_bytes"] / 1e9, 5), "exposed_ms_per_step": round(cfg_ms, 2)},
                     source="each rank one whole call (cond or uncond) and one output exchange (split.split_cost); " + src))
        if ctx.calls == 2 and n >= 4 and n % 2 == 0:
            inner = n // 2
            gpu_i = ctx.gpu(inner)
            cands = [a for a in ATTENTIONS if not (a == "ulysses" and shape.heads % inner)]
            if attention != "auto" and attention in cands:
                cands = [attention]
            best_i = None
            for a in cands:
                comm_i = _seq_comm(ctx, inner, a, gpu_i)
                call_i = ctx.floor(gpu_i["total"] + comm_i["exposed_ms_per_call"])
                if best_i is None or call_i < best_i[1]:
                    best_i = (a, call_i, comm_i)
            a, call_i, comm_i = best_i
            add(_row("cfg+sequence", ctx, call_i, ctx.memory(inner, ctx.w), calls=1, extra_ms=cfg_ms, attention=a,
                     comm=dict(comm_i, cfg_exchange_ms=round(cfg_ms, 2)),
                     source=f"2 CFG groups of {inner} sequence ranks, each one call per step, then the output exchange; "
                            f"{seq_src}"))
        if ctx.calls != 2:
            why = (f"{model.title} is guidance-distilled" if model.calls_per_step == 1 else "a CFG-free run (1 call per step)")
            rows.append({"mode": "cfg", "label": "MODELLED", "ranks": n, "s_per_step": None, "speedup": None,
                         "notes": [f"{why}: one call per step, nothing to split"], "from": ""})
        elif n != 2 and not (n >= 4 and n % 2 == 0):
            rows.append({"mode": "cfg+sequence", "label": "MODELLED", "ranks": n, "s_per_step": None, "speedup": None,
                         "notes": [f"the CFG modes need 2 ranks (cfg) or an even number from 4 (cfg+sequence), not {n}"],
                         "from": ""})
        # batch-parallel: N latents, one per rank (throughput)
        r = _row("batch", ctx, ctx.floor(one_gpu["total"]), ctx.memory(1, ctx.w),
                 notes=[f"a batch of {n} latents, one per rank: s/step is the batch's, the speed-up against one card "
                        f"sampling the {n} latents one after the other"],
                 source="each rank one whole latent; " + src)
        r["_batch"] = n
        add(r)

        # the stale presets: sequence ranks, text whole, exact warm-up, then asynchronous steps
        if n >= 2:
            rows.extend(_preset_rows(ctx, ref_step, warmup, src))

        # weight sharding under the chosen sequence attention
        base = seq_rows[chosen]
        comm = base["comm"]
        seq_link = comm["link_ms_per_call"]
        gather_bytes = ctx.wb * (n - 1) / n
        gather = _link_ms(gather_bytes, model.layers, profile)
        h2d = transfer_ms(ctx.wb / n, ctx.host)
        for sh in SHARDINGS[1:]:
            busy = gather + seq_link + (h2d if sh == "blocks+offload" else 0.0)
            call = ctx.floor(max(gpu["total"] + comm["exposed_ms_per_call"], busy))
            resident = (ctx.w - ctx.wb) + (ctx.wb / n if sh == "blocks" else 0.0)
            mem = ctx.memory(n, resident, INFLIGHT_BLOCKS * ctx.largest)
            if sh == "blocks+offload":
                mem["host_pinned_gib_per_rank"] = round(ctx.wb / n / GIB, 2)
            extra = {"weight_gather_gb_per_call": round(gather_bytes / 1e9, 3), "weight_gather_ms_per_call": round(gather, 2)}
            if sh == "blocks+offload":
                extra.update(host_copy_gb_per_call=round(ctx.wb / n / 1e9, 3), host_copy_ms_per_call=round(h2d, 2))
            add(_row("sequence", ctx, call, mem, attention=chosen, sharding=sh, comm=dict(comm, **extra),
                     source=f"{sh}: each call gathers (N-1)/N of the blocks over {profile.name}"
                            + (f" after copying its shard over {ctx.host.name}" if sh == "blocks+offload" else "")
                            + "; the link carries gathers and exchange in turn; " + seq_src))
    out = {
        "MODELLED": True,
        "what": "MODELLED seconds per step and memory per rank; compute measured on one H200 and scaled by the rule "
                "below, communication from the runtime's cost functions over the link profile; nothing was run",
        "card": card._asdict(),
        "ranks": n,
        "link": None if profile is None else dict(profile._asdict(), requested=get_link(link).name),
        "link_notes": link_notes,
        "model": {"key": model.key, "title": model.title, "params": model.params,
                  "weights_gib": round(ctx.w / GIB, 2), "calls_per_step": ctx.calls},
        "shape": {"height": int(height), "width": int(width), "frames": int(frames),
                  "tokens": shape.frames * shape.rows * shape.cols, "text_tokens": shape.text},
        "steps": steps, "weights": weights, "kernels": kernels,
        "compute": _compute_block(ctx, one_gpu),
        "vae_decode_s_one_card": round(vae_decode_ms(model, int(height), int(width), int(frames), card) / 1e3, 3),
        "one_card": one,
        "rows": rows,
        "fastest": None,
    }
    ok = [r for r in rows if r.get("s_per_step") and r["mode"] != "batch" and r["memory"]["fits"]]
    if ok:
        f = min(ok, key=lambda r: r["s_per_step"])
        out["fastest"] = {k: f[k] for k in ("mode", "attention", "preset", "sharding", "s_per_step", "speedup")}
    return out


def _compute_block(ctx: _Ctx, one_gpu: Dict[str, float]) -> dict:
    parts = h200_call_parts(ctx.model, ctx.shape, ctx.kernels)
    card_parts = card_call_ms(parts, ctx.card, ctx.weights)
    ref = REFERENCE_CARD
    return {
        "rule": ("GEMMs x (H200 dense bf16 / card dense GEMM rate), attention x (H200 dense bf16 / card dense bf16), "
                 "memory-bound x (H200 bandwidth / card bandwidth); a sequence rank: x its token share x the overhead "
                 "measured at that N; eager calls at least the CPU's issue time"),
        "h200_call_ms_by_part": {k: round(v, 2) for k, v in parts.items()},
        "card_call_ms_by_part": {k: round(v, 2) for k, v in card_parts.items()},
        "card_call_gpu_ms": round(one_gpu["total"], 2),
        "per_block_ms": round(one_gpu["total"] / ctx.model.layers, 3),
        "cast_ms_per_call": round(one_gpu["cast"], 2),
        "issue_floor_ms": ctx.issue,
        "ratios": {"gemm": round(ref.bf16_tflops / gemm_tflops(ctx.card, ctx.weights), 3),
                   "attention": round(ref.bf16_tflops / ctx.card.bf16_tflops, 3),
                   "memory": round(ref.bandwidth_gbps / ctx.card.bandwidth_gbps, 3)},
        "gemm_rate": "fp8" if gemm_tflops(ctx.card, ctx.weights) != ctx.card.bf16_tflops else "bf16",
        "weights_cast_per_call": casts_weights(ctx.card, ctx.weights),
        "sources": basis(ctx.model, ctx.kernels)["sources"],
    }


def _preset_rows(ctx: _Ctx, ref_step: float, warmup: int, src: str) -> List[dict]:
    from ..parallel.exchange import DISPLACED, compressed
    from .compressed_model import codec_ms, dit_run

    n, shape, p, cps = ctx.n, ctx.shape, ctx.link, ctx.calls
    out_gather = (n - 1) * max(shape.frames * math.ceil(shape.rows / n) * shape.cols, 1) * shape.out_features * 2
    gpu = ctx.gpu(n, shard_text=False)
    compute = cps * ctx.floor(gpu["total"])
    scale = REFERENCE_CARD.bandwidth_gbps / ctx.card.bandwidth_gbps
    table = {b: (e * scale, a * scale) for b, (e, a) in CODEC_MS_PER_GB["triton"].items()}
    w = max(1, min(int(warmup), ctx.steps))

    def sync(cost):
        return {"sync": cps * cost["wire_bytes"], "messages": cps * cost["messages"]}

    warm = sync(step_cost(shape, n, "auto", link=p, shard_text=False))
    fill = sync(step_cost(shape, n, "gathered", shard_text=False))
    kv_exact = step_cost(shape, n, "gathered", shard_text=False)["wire_bytes"] - out_gather
    mem = ctx.memory(n, ctx.w)
    rows = []
    for name, bits in PRESETS:
        kv = DISPLACED if not bits else compressed(bits)
        c = step_cost(shape, n, "gathered", kv=kv, shard_text=False)
        a = cps * (c["wire_bytes"] - out_gather)
        codec = codec_ms(cps * kv_exact, n, bits, table)
        step = {"sync": cps * out_gather, "async": a, "messages": cps, "codec_ms": codec}
        stream = ctx.stream_ms(mem)
        run = dit_run(ref_step, max(compute, cps * stream), warm, fill, step, ctx.steps, w, p)
        r = _row("sequence", ctx, ctx.floor(gpu["total"]), mem, attention="gathered (stale K/V)", preset=name,
                 comm={"async_gb_per_step": round(a / 1e9, 4), "sync_gb_per_step": round(cps * out_gather / 1e9, 4),
                       "warmup_steps": w, "codec_ms_per_step": round(codec, 2)},
                 notes=[f"{w} exact warm-up steps (the last fills the stale memory), then {ctx.steps - w} asynchronous "
                        f"steps; s/step is the run's mean; text whole (the presets' default)"],
                 source="bench/compressed_model.dit_run over the link; codec: topology/preset_cost.CODEC_MS_PER_GB "
                        "(Triton, H200) x the bandwidth ratio; " + src,
                 step_ms=run["run_ms"] / ctx.steps)
        r["speedup"] = round(ref_step / (run["run_ms"] / ctx.steps), 3)
        rows.append(r)
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# text output


def _fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def format_plan(doc: dict) -> str:
    card, m, s = doc["card"], doc["model"], doc["shape"]
    link = doc["link"]
    size = f"{s['height']}x{s['width']}" + (f"x{s['frames']}" if s["frames"] > 1 else "")
    lines = [f"MODELLED rig: {doc['ranks']} x {card['title']} ({card['memory_gib']:g} GiB, {card['bf16_tflops']:g} dense bf16 "
             f"TFLOP/s, {card['bandwidth_gbps']:g} GB/s)"
             + (f" on {link['name']} ({link['bandwidth_gbps']:g} GB/s{', staged through host memory' if link['via_host'] else ''})"
                if link else ""),
             f"model: {m['title']}, {size}, {doc['steps']} steps, {m['calls_per_step']} call(s) per step, weights "
             f"{doc['weights']} ({m['weights_gib']:g} GiB), {doc['kernels']} kernels"]
    for note in doc["link_notes"]:
        lines.append(f"note: {note}")
    c = doc["compute"]
    lines.append(f"compute per call (MODELLED): H200 {sum(c['h200_call_ms_by_part'].values()):.1f} ms "
                 f"({', '.join(f'{k} {v:.1f}' for k, v in c['h200_call_ms_by_part'].items())}) -> this card "
                 f"{c['card_call_gpu_ms']:.1f} ms GPU ({c['per_block_ms']:.2f} ms per block)"
                 + (f", CPU issue floor {c['issue_floor_ms']:.0f} ms" if c["issue_floor_ms"] else ""))
    lines.append("")
    head = (f"{'mode':<13} {'attention':<21} {'preset':<16} {'sharding':<15} {'s/step':>8} {'total s':>9} {'x 1 card':>8} "
            f"{'exposed comm ms/call':>20} {'GiB/rank':>9} fits")
    lines.append(head)
    lines.append("-" * len(head))
    for r in [doc["one_card"]] + doc["rows"]:
        if r.get("s_per_step") is None:
            lines.append(f"{r['mode']:<13} n/a: {'; '.join(r['notes'])}")
            continue
        comm = r.get("comm") or {}
        exposed = comm.get("exposed_ms_per_call", comm.get("exposed_ms_per_step"))
        lines.append(f"{r['mode']:<13} {str(r.get('attention') or '-'):<21} {str(r.get('preset') or '-'):<16} "
                     f"{r.get('sharding') or '-':<15} {r['s_per_step']:>8.3f} {r['total_s']:>9.1f} "
                     f"{_fmt(r.get('speedup', 1.0)):>8} {_fmt(exposed, '.1f'):>20} {r['memory']['total_gib']:>9.1f} "
                     f"{'yes' if r['memory']['fits'] else 'NO'}")
    lines.append("")
    lines.append(f"VAE decode on one card (MODELLED): {doc['vae_decode_s_one_card']:.2f} s")
    if doc["fastest"]:
        f = doc["fastest"]
        lines.append(f"fastest that fits (MODELLED): {f['mode']}"
                     + (f" / {f['attention']}" if f['attention'] else "") + (f" / {f['preset']}" if f['preset'] else "")
                     + (f" / sharding {f['sharding']}" if f['sharding'] != 'none' else "")
                     + f": {f['s_per_step']:.3f} s/step, {f['speedup']:.2f}x one card")
    notes = [n for r in doc["rows"] for n in r.get("notes", []) if "does not fit" in n]
    if notes or not doc["one_card"]["memory"]["fits"]:
        lines.append("rows marked NO do not fit the card: they are modelled with the excess streamed from host memory")
    lines.append("every figure above is MODELLED (docs/rig-model.md): compute measured on one H200 and scaled by the "
                 "card's datasheet ratios, traffic from PatchRay's cost model over the link profile")
    return "\n".join(lines)
