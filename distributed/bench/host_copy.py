"""Host memory while the driver ships a model to CPU ranks through Ray: torch tensors vs numpy views, whole vs sharded.

The driver builds a diffusers Wan transformer (random bf16 weights), then ships it with ``sampling.remote.ship_model``
exactly as the Distributed KSampler does, in one of two transports (``torch``: the state dict's tensors pickled,
PatchRay's former payload; ``numpy``: ``sampling.weights.to_arrays``, viewed by the ranks; ``parts``:
``sampling.ship.ship_model_in_parts``, the skeleton first, then the weights a part at a time) and with sharding ``none``
or ``blocks`` (``parallel.shard``), and runs two forwards on the ranks (later prompts). A thread samples, every 50 ms,
the summed PSS (proportional set size: a shared page counts once over its mappers, so Ray's shared-memory store
counts once) of the driver and every process under it (Ray's raylet and store, the rank actors). Figures are peaks
above the baseline taken before the model is built, in units of the model's bytes (the driver's own copy of the
model, ComfyUI's loaded weights in the node, is one of them).

Usage::

    python -m patchray.distributed.bench.host_copy --out results/cpu-sharding/host_copy.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["main", "measure"]

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=256, freq_dim=64, ffn_dim=4096, num_layers=16, cross_attn_norm=True, qk_norm="rms_norm_across_heads")


def _pss_tree(root_pid: int, idle: bool = True) -> int:
    """Summed PSS of ``root_pid`` and its descendants; without ``idle``, Ray's idle worker processes (``ray::IDLE``,
    started and stopped by Ray on its own, a few hundred MB each whatever the model) are left out."""
    import psutil

    total = 0
    try:
        root = psutil.Process(root_pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            if not idle and " ".join(p.cmdline()).startswith("ray::IDLE"):
                continue
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


class _Sampler:
    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.peak = 0
        self.peak_no_idle = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        pid = os.getpid()
        while not self._stop.is_set():
            self.peak = max(self.peak, _pss_tree(pid))
            self.peak_no_idle = max(self.peak_no_idle, _pss_tree(pid, idle=False))
            time.sleep(self.period_s)

    def __enter__(self):
        self.peak = _pss_tree(os.getpid())
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _pss_tree(os.getpid()))


def _build(ctx, payload):
    """Rank side: the skeleton on the meta device, the weights from the payload, the blocks sharded or not."""
    import diffusers

    from ..parallel.shard import find_units, shard_model
    from ..sampling.weights import from_arrays

    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**payload["config"]).to(torch.bfloat16)
    buffers = {k: v for k, v in diffusers.WanTransformer3DModel(**dict(payload["config"], num_layers=1, num_attention_heads=1, ffn_dim=8)).named_buffers()}
    blocks = payload["sharding"] == "blocks" and ctx.world_size > 1
    state = payload["state_dict"]
    if payload["transport"] == "numpy":
        units = [p + "." for p, _ in find_units(model, ("blocks.*",))] if blocks else []
        in_unit = lambda k: any(k.startswith(u) for u in units)
        tensors = from_arrays({k: a for k, a in state.items() if in_unit(k)}, payload["views"], copy=False)
        tensors.update(from_arrays({k: a for k, a in state.items() if not in_unit(k)}, payload["views"], copy=True))
    else:
        tensors = dict(state)
    tensors.update({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in buffers.items()})
    model.load_state_dict(tensors, strict=False, assign=True)
    for k, v in buffers.items():  # non-persistent buffers are not in load_state_dict's reach
        mod, _, name = k.rpartition(".")
        model.get_submodule(mod).register_buffer(name, v, persistent=False)
    del tensors, state
    handle = shard_model(model, ctx, ("blocks.*",)) if blocks else None
    return (model.eval(), handle)


def _breakdown(root_pid: int) -> Dict[str, int]:
    """PSS by process kind (the driver, Ray's raylet with its shared-memory store, the rank actors, the rest)."""
    import psutil

    out: Dict[str, int] = {}
    root = psutil.Process(root_pid)
    for p in [root] + root.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            kind = ("driver" if p.pid == root_pid else "raylet (store)" if "raylet" in cmd
                    else "ranks" if cmd.startswith("ray::_RankActor") else "ray idle workers" if cmd.startswith("ray::IDLE")
                    else "other ray processes")
            out[kind] = out.get(kind, 0) + p.memory_full_info().pss
        except psutil.Error:
            pass
    return out


def _begin_parts(ctx, payload):
    """Rank side of the parts transport: the skeleton on the meta device, blocks sharded there, tensors allocated."""
    import diffusers

    from ..parallel.shard import shard_model
    from ..sampling.ship import materialize_meta

    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**payload["config"]).to(torch.bfloat16)
    small = diffusers.WanTransformer3DModel(**dict(payload["config"], num_layers=1, num_attention_heads=1, ffn_dim=8))
    buffers = {k: v.to(torch.bfloat16) for k, v in small.named_buffers()}

    def init(m):
        materialize_meta(m, ctx.device)
        for k, v in buffers.items():
            mod, _, name = k.rpartition(".")
            m.get_submodule(mod)._buffers[name] = v

    if payload["sharding"] == "blocks" and ctx.world_size > 1:
        handle = shard_model(model, ctx, ("blocks.*",), init=init)
    else:
        init(model)
        handle = None
    return (model.eval(), handle), model


def _forward(ctx, key):
    from ..cluster import rank_cache
    from ..sampling.remote import _MODEL

    held = rank_cache().get(_MODEL)
    model, _ = held[1]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        x = torch.randn(1, 16, 1, 8, 8, generator=g).to(torch.bfloat16)
        y = model(hidden_states=x, encoder_hidden_states=torch.randn(1, 4, 256, generator=g).to(torch.bfloat16),
                  timestep=torch.tensor([500.0]), return_dict=False)[0]
    return float(y.float().norm())


def _local_bytes(ctx):
    from .. import comm
    from ..cluster import rank_cache
    from ..sampling.remote import _MODEL

    model, _ = rank_cache()[_MODEL][1]
    return sum(comm.local_shard(p).numel() * comm.local_shard(p).element_size() for p in model.parameters())


def _warm(ctx):
    """Import and build what the rank's model needs once (diffusers, a one-block copy for the RoPE tables), so the
    baseline holds the libraries and the figures hold the weights only."""
    import diffusers

    diffusers.WanTransformer3DModel(**dict(CONFIG, num_layers=1, num_attention_heads=1, ffn_dim=8))
    return True


def measure(cases: Sequence[tuple], ranks: int = 2, part_bytes: int = 32 * 1024**2) -> List[dict]:
    import diffusers

    from ..cluster import ClusterConfig, get_cluster, shutdown_cluster
    from ..sampling.remote import ship_model
    from ..sampling.ship import ship_model_in_parts
    from ..sampling.weights import to_arrays

    cluster = get_cluster(ClusterConfig(num_ranks=ranks, device="cpu"))
    out = []
    try:
        for i, (transport, sharding) in enumerate(cases):
            cluster.free_cached()
            cluster.run(_warm)
            gc.collect()
            time.sleep(1.0)
            baseline = _pss_tree(os.getpid())
            baseline_no_idle = _pss_tree(os.getpid(), idle=False)
            before = _breakdown(os.getpid())
            g = torch.Generator().manual_seed(0)
            model = diffusers.WanTransformer3DModel(**CONFIG).to(torch.bfloat16)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            persistent = {k: v for k, v in model.state_dict().items() if "rope." not in k}

            def make_payload():
                if transport == "numpy":
                    arrays, views = to_arrays(persistent)
                    return {"config": CONFIG, "state_dict": arrays, "views": views, "sharding": sharding, "transport": transport}
                return {"config": CONFIG, "state_dict": persistent, "views": {}, "sharding": sharding, "transport": transport}

            with _Sampler() as first:
                if transport == "parts":
                    ship_model_in_parts(cluster, ("host-copy", i), lambda: {"config": CONFIG, "sharding": sharding},
                                        list(persistent), persistent.__getitem__, _begin_parts, part_bytes=part_bytes,
                                        sizes={k: v.numel() * v.element_size() for k, v in persistent.items()})
                else:
                    ship_model(cluster, ("host-copy", i), make_payload, _build)
                norms = cluster.run(_forward, ("host-copy", i))
            after_first = _breakdown(os.getpid())
            with _Sampler() as later:
                for _ in range(2):
                    cluster.run(_forward, ("host-copy", i))
            local = cluster.run(_local_bytes)
            out.append({
                "transport": transport, "sharding": sharding, "ranks": ranks, "model_bytes": model_bytes,
                "part_bytes": part_bytes if transport == "parts" else None,
                "baseline_pss_bytes": baseline, "first_prompt_peak_above_baseline_bytes": first.peak - baseline,
                "later_prompts_peak_above_baseline_bytes": later.peak - baseline,
                "first_prompt_ratio": (first.peak - baseline) / model_bytes,
                "later_prompts_ratio": (later.peak - baseline) / model_bytes,
                "first_prompt_ratio_without_idle_workers": (first.peak_no_idle - baseline_no_idle) / model_bytes,
                "later_prompts_ratio_without_idle_workers": (later.peak_no_idle - baseline_no_idle) / model_bytes,
                "rank_local_weight_bytes": local,
                "pss_growth_by_process_after_first_prompt": {k: after_first.get(k, 0) - before.get(k, 0) for k in after_first}, "outputs_agree": len({round(n, 3) for n in norms}) == 1,
            })
            print(json.dumps(out[-1]), flush=True)
            del model, persistent
            gc.collect()
    finally:
        shutdown_cluster(stop_ray=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patchray.distributed.bench.host_copy", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cases", default="torch:none,numpy:none,numpy:blocks")
    ap.add_argument("--out", required=True)
    ap.add_argument("--part-mb", type=int, default=32, help="parts transport: MB of weights per part")
    ap.add_argument("--append", action="store_true", help="add to the records already in --out (one case per process:"
                    " a process that ran a case keeps its freed memory, which the next case would reuse unseen)")
    a = ap.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    records = measure(cases, a.ranks, a.part_mb * 1024**2)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if a.append and os.path.exists(a.out):
        with open(a.out) as f:
            records = json.load(f)["records"] + records
    with open(a.out, "w") as f:
        json.dump({"command": "python -m patchray.distributed.bench.host_copy --cases CASE --append --out ... (one process per case)",
                   "config": CONFIG, "torch": torch.__version__, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
