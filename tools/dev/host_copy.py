"""Host memory while the driver ships a model to the ranks through Ray: torch tensors vs numpy views, whole vs sharded,
CPU ranks or GPU ranks.

The driver builds a diffusers transformer with random weights in host memory (ComfyUI's loaded model, which the node
ships), then ships it to the ranks in one of three transports (``torch``: the state dict's tensors pickled in one
payload, PatchRay's former transport; ``numpy``: one payload of ``sampling.weights.to_arrays`` views; ``parts``:
``sampling.ship.ship_model``, the skeleton first, then the weights a part at a time, the node's transport)
with sharding ``none``, ``blocks`` (``parallel.shard``) or, for comparison, ``none-host`` (the node's former placement
of a whole model: allocated on the host, moved to the rank's device once every part arrived, as ComfyUI's loader does),
and runs a forward on the ranks (the first prompt), then two more (later prompts). A thread samples, every 50 ms, the
summed PSS (proportional set size: a shared page counts once over its mappers, so Ray's shared-memory store counts
once) of the driver and every process under it (Ray's raylet and store, the rank actors, Ray's other processes).
Figures are peaks above the baseline taken after the ranks imported their libraries and before the model is built,
in units of the model's bytes (the driver's own copy of the model is one of them); each GPU rank's peak GPU memory is
recorded too.

Models (``--model``): ``wan-small`` (a 16-block Wan transformer, 0.555 GB in bf16: the CPU runs), ``flux1`` (FLUX.1-dev's
transformer at its released configuration, 23.8 GB), ``wan21-14b`` (Wan 2.1 T2V-14B's, 28.6 GB), and the tiny
configurations of both (``flux1-tiny``, ``wan21-tiny``: tests). GPU ranks (``--device cuda``) share this machine's one
GPU: Ray is told the machine has one GPU per rank and leaves ``CUDA_VISIBLE_DEVICES`` alone, the ranks form their group
over gloo (NCCL refuses two ranks on one device; gloo runs the collectives on CUDA tensors by staging them through
pinned host memory, which a real multi-GPU run over NCCL does not: the forward's figures on shared-GPU ranks include
that staging, the shipping figures do not depend on it) and each rank's allocator is capped at 1/N of the card
(``torch.cuda.set_per_process_memory_fraction``).

Usage::

    python -m tools.dev.host_copy --cases parts:blocks --out results/cpu-sharding/host_copy.json
    python -m tools.dev.host_copy --device cuda --model flux1 --ranks 4 --cases parts:blocks --out ...
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

#: the repository root: the rank processes import this instrument as ``tools.dev.host_copy`` (Ray sends its rank
#: functions by name), so it goes on their import path
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["main", "measure", "MODELS", "SHARDINGS", "TRANSPORTS"]

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=256, freq_dim=64, ffn_dim=4096, num_layers=16, cross_attn_norm=True, qk_norm="rms_norm_across_heads")

TRANSPORTS = ("torch", "numpy", "parts")
#: models up to this size also run one forward on the driver (the reference each rank's output must equal)
REFERENCE_MAX_BYTES = 1 << 30
SHARDINGS = ("none", "blocks", "none-host")


class HostCopyModel(NamedTuple):
    """A model of this bench: a ``dit_models`` preset at one size, its block globs, and the forward's small input."""

    preset: str  # a key of dit_models.PRESETS, or "wan-small"
    size: str  # "full" or "tiny"
    blocks: Tuple[str, ...]
    grid: Tuple[int, int, int]  # (frames, token rows, token cols) of the forward's input
    text: int  # text tokens of the forward's input


MODELS: Dict[str, HostCopyModel] = {
    "wan-small": HostCopyModel("wan-small", "full", ("blocks.*",), (1, 4, 4), 4),
    "flux1": HostCopyModel("flux1_1024", "full", ("transformer_blocks.*", "single_transformer_blocks.*"), (1, 16, 16), 64),
    "wan21-14b": HostCopyModel("wan21_14b_480x832x81", "full", ("blocks.*",), (1, 8, 8), 64),
    "flux1-tiny": HostCopyModel("flux1_1024", "tiny", ("transformer_blocks.*", "single_transformer_blocks.*"), (1, 7, 3), 5),
    "wan21-tiny": HostCopyModel("wan21_14b_480x832x81", "tiny", ("blocks.*",), (3, 7, 3), 5),
}


def _preset(name: str):
    from patchray.distributed.bench import dit_models

    m = MODELS[name]
    if m.preset == "wan-small":
        base = dit_models.PRESETS["wan21_14b_480x832x81"]
        return base._replace(name="wan-small", title="Wan transformer, 16 blocks, 1024 wide", full=CONFIG, tiny=CONFIG,
                             grid_full=m.grid, grid_tiny=m.grid, text_full=m.text, text_tiny=m.text)
    p = dit_models.PRESETS[m.preset]
    return p._replace(grid_full=m.grid, grid_tiny=m.grid, text_full=m.text, text_tiny=m.text)


def _pss_tree(root_pid: int, idle: bool = True) -> int:
    """Summed PSS of ``root_pid`` and its descendants; without ``idle``, Ray's idle worker processes (``ray::IDLE``,
    started and stopped by Ray on its own, a few hundred MB each whatever the model) are left out."""
    return _pss_totals(root_pid)[0 if idle else 1]


def _pss_totals(root_pid: int) -> Tuple[int, int]:
    """``(with Ray's idle workers, without them)``, from one reading of each process."""
    import psutil

    total = no_idle = 0
    try:
        root = psutil.Process(root_pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            pss = p.memory_full_info().pss
            total += pss
            if not " ".join(p.cmdline()).startswith("ray::IDLE"):
                no_idle += pss
        except psutil.Error:
            pass
    return total, no_idle


class _Sampler:
    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.peak = 0
        self.peak_no_idle = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        total, no_idle = _pss_totals(os.getpid())
        self.peak = max(self.peak, total)
        self.peak_no_idle = max(self.peak_no_idle, no_idle)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period_s)

    def __enter__(self):
        self._sample()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()


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


# ------------------------------------------------------------------------------------------------ rank side

_REFERENCE: Dict[str, Dict[str, torch.Tensor]] = {}  # per rank process: a model's constructor tensors (built in _warm)


def _warm(ctx, model: str, memory_fraction: float):
    """Import and build what the rank's model needs once (diffusers, the constructor tensors from a one-block build,
    CUDA's context and a GEMM's libraries), cap the rank's share of a shared GPU, and clear its peak counters: the
    baseline then holds the libraries, and the figures the weights and what the first prompt loads (FSDP2's code
    when sharding, the forward's kernels), as in the node."""
    import diffusers  # noqa: F401

    from patchray.distributed.bench import dit_models

    if model not in _REFERENCE:
        _REFERENCE[model] = dit_models.constructor_tensors(_preset(model), MODELS[model].size)
    if ctx.device.type == "cuda":
        if memory_fraction:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, ctx.device)
        a = torch.ones(64, 64, device=ctx.device, dtype=torch.bfloat16)
        (a @ a).sum().item()
        del a
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
    gc.collect()
    return True


def _begin_model(ctx, payload):
    """Rank side of the parts transport: the skeleton on the meta device, blocks sharded there (each rank allocates
    its shards on its device) or the whole model allocated where the node puts it (``none``:
    ``sampling.ship.whole_model_device``; ``none-host``: the host), the constructor tensors set."""
    from patchray.distributed.bench import dit_models
    from patchray.distributed.parallel.shard import shard_model
    from patchray.distributed.sampling.ship import materialize_meta, whole_model_device

    name = payload["model"]
    spec = MODELS[name]
    model = dit_models.skeleton(_preset(name), spec.size, getattr(torch, payload["dtype"]), keep_fp32=False)
    dtypes = dit_models.constructor_dtypes(model)
    reference = _REFERENCE[name] if name in _REFERENCE else dit_models.constructor_tensors(_preset(name), spec.size)

    def init(m, device):
        materialize_meta(m, device)
        dit_models.set_constructor_tensors(m, dtypes, reference, device)

    sharding = payload["sharding"]
    if sharding == "blocks" and ctx.world_size > 1:
        handle = shard_model(model, ctx, spec.blocks, init=lambda m: init(m, ctx.device))
    else:
        init(model, torch.device("cpu") if sharding == "none-host" else whole_model_device(ctx, model))
        handle = None
    return (model.eval(), handle), model


def _end_model(ctx, built):
    """Once every part arrived: a whole model left on the host moves to the rank's device (ComfyUI's loader)."""
    model, handle = built
    if handle is None and ctx.device.type == "cuda" and any(p.device.type == "cpu" for p in model.parameters()):
        model.to(ctx.device)
        gc.collect()
    return (model, handle)


def _build(ctx, payload):
    """Rank side of the one-payload transports (``torch``, ``numpy``; ``wan-small`` only): the skeleton on the meta
    device, the weights from the payload, the blocks sharded or not."""
    import diffusers

    from patchray.distributed.parallel.shard import find_units, shard_model
    from patchray.distributed.sampling.weights import from_arrays

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


def _begin_whole(ctx, payload):
    """``ship_model``'s ``begin`` for the one-payload transports: the whole model arrives with the skeleton."""
    built = _build(ctx, payload)
    return built, built[0]


def _run_model(model, model_name: str, device: torch.device, dtype: str, run_blocks: int) -> float:
    """The norm of one forward of ``model`` on the bench's input (through the first ``run_blocks`` blocks of each
    stack and the head when > 0)."""
    from patchray.distributed.bench import dit_models

    inputs = dit_models.make_inputs(_preset(model_name), MODELS[model_name].size, device, getattr(torch, dtype))[0]
    stacks = [g[:-2] for g in MODELS[model_name].blocks]
    full = {s: getattr(model, s) for s in stacks}
    try:
        if run_blocks > 0:
            for s in stacks:
                setattr(model, s, torch.nn.ModuleList(list(full[s])[:run_blocks]))
        with torch.no_grad():
            y = model(**inputs)[0]
    finally:
        for s in stacks:
            setattr(model, s, full[s])
    return float(y.float().norm())


def _forward(ctx, model_name: str, dtype: str, run_blocks: int = 0):
    """One forward on the rank's model (``run_blocks`` > 0: the first blocks of each stack only; the blocks of a
    stack are identical, and a whole FLUX.1 forward on ranks sharing a GPU under gloo pushes the whole 24 GB through
    gloo's host staging on every rank); the output's norm."""
    from patchray.distributed.cluster import rank_cache
    from patchray.distributed.sampling.ship import MODEL_SLOT as _MODEL

    model, _ = rank_cache()[_MODEL][1]
    return _run_model(model, model_name, ctx.device, dtype, run_blocks)


def _pinned_peak(device: torch.device) -> Optional[int]:
    """Peak pinned host memory of PyTorch's caching host allocator (gloo stages CUDA collectives there)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or stats is None:
        return None
    try:
        got = stats()
    except Exception:  # a build without the counters
        return None
    for key in ("allocated_bytes.peak", "allocated_bytes.all.peak", "reserved_bytes.all.peak"):
        if key in got:
            return int(got[key])
    return None


def _rank_report(ctx):
    """``(weight bytes this rank holds, on the host, GPU peak allocated, GPU peak reserved, pinned host peak)``;
    clears the GPU peak."""
    from patchray.distributed import comm
    from patchray.distributed.cluster import rank_cache
    from patchray.distributed.sampling.ship import MODEL_SLOT as _MODEL

    model, _ = rank_cache()[_MODEL][1]
    local = [comm.local_shard(p) for p in model.parameters()]
    held = sum(t.numel() * t.element_size() for t in local)
    host = sum(t.numel() * t.element_size() for t in local if t.device.type == "cpu")
    peak = reserved = None
    pinned = _pinned_peak(ctx.device)
    if ctx.device.type == "cuda":
        peak, reserved = torch.cuda.max_memory_allocated(ctx.device), torch.cuda.max_memory_reserved(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    return held, host, peak, reserved, pinned


# ------------------------------------------------------------------------------------------------ driver side


def _shared_gpu_cluster(ranks: int, object_store_mb: Optional[int]):
    """``ranks`` GPU ranks on this machine's GPU 0, for measurement (see the module docstring)."""
    import ray

    from patchray.distributed.cluster import ClusterConfig
    from patchray.distributed.cluster.ranks import RankCluster
    from patchray.distributed.cluster.ray_setup import _apply_embedded_env, ray_init_kwargs

    # the machine check counts physical GPUs (one per rank), so the configuration says cpu and the device is picked
    # below; Ray is started here, declaring one GPU per rank, and RankCluster reuses it. Ray refuses more GPUs than
    # CUDA_VISIBLE_DEVICES lists, and gives each GPU actor the entry of its slot: listing GPU 0 once per rank while Ray
    # starts makes every rank's CUDA_VISIBLE_DEVICES "0" (the driver's own setting is restored before it uses CUDA).
    config = ClusterConfig(num_ranks=ranks, device="cpu", object_store_mb=object_store_mb, extra_pythonpath=(_REPO_ROOT,))
    _apply_embedded_env()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = (saved or "0").split(",")[0]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join([gpu] * ranks)
    try:
        ray.init(**dict(ray_init_kwargs(config), num_gpus=ranks))
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved

    class _SharedGpuCluster(RankCluster):
        def _pick_device(self, ray_module) -> str:
            return "cuda"

        def _start(self, ray_module):
            self.backend = "gloo"  # NCCL refuses two ranks on one device
            super()._start(ray_module)

    return _SharedGpuCluster(config)


def _driver_model(name: str, dtype: torch.dtype, build_device: torch.device) -> torch.nn.Module:
    """The model ComfyUI would hold: random weights (``dit_models.build_random``, every tensor in ``dtype``: FSDP2
    shards a block of one dtype), in host memory. Drawn on
    ``build_device`` (a GPU draws 24 GB in seconds) and copied to the host a tensor at a time."""
    from patchray.distributed.bench import dit_models

    model = dit_models.build_random(_preset(name), MODELS[name].size, build_device, dtype, keep_fp32=False)
    if build_device.type != "cpu":
        model.to("cpu")
        torch.cuda.synchronize(build_device)
        torch.cuda.empty_cache()
    return model


def measure(cases: Sequence[tuple], ranks: int = 2, part_bytes: int = 32 * 1024**2, *, model: str = "wan-small",
            device: str = "cpu", dtype: str = "bfloat16", build_device: str = "auto", later: int = 2,
            object_store_mb: Optional[int] = None, run_blocks: int = 0, log=print, on_record=None) -> List[dict]:
    """Run ``cases`` (``(transport, sharding)`` pairs, or ``(transport, sharding, model)`` to override ``model``) one
    after the other in one cluster; one record each
    (``on_record(record)`` is called as each case ends, so a run cut short keeps the cases it finished)."""
    from patchray.distributed.bench import dit_models
    from patchray.distributed.cluster import ClusterConfig, get_cluster, shutdown_cluster
    from patchray.distributed.parallel.shard import find_units
    from patchray.distributed.sampling.ship import ship_model
    from patchray.distributed.sampling.weights import to_arrays

    cases = [tuple(c) if len(c) > 2 else (c[0], c[1], model) for c in cases]
    for transport, sharding, case_model in cases:
        if case_model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)} (got {case_model!r})")
        if transport not in TRANSPORTS or sharding not in SHARDINGS:
            raise ValueError(f"a case is TRANSPORT:SHARDING with a transport of {TRANSPORTS} and a sharding of {SHARDINGS} "
                             f"(got {transport}:{sharding})")
        if transport != "parts" and (case_model != "wan-small" or sharding == "none-host"):
            raise ValueError(f"transport {transport} is measured on model wan-small with sharding none or blocks only")
    torch_dtype = getattr(torch, dtype)
    if build_device == "auto":
        build_device = "cuda" if device == "cuda" else "cpu"
    build = torch.device(build_device)
    fraction = min(0.95, 0.97 / ranks) if device == "cuda" else 0.0
    t_start = time.perf_counter()
    if device == "cuda":
        cluster = _shared_gpu_cluster(ranks, object_store_mb)
        torch.cuda.init()  # the driver's CUDA context (ComfyUI's, on a GPU machine) belongs to the baseline
        torch.ones(1, device=build if build.type == "cuda" else "cuda").sum().item()
    else:
        cluster = get_cluster(ClusterConfig(num_ranks=ranks, device="cpu", object_store_mb=object_store_mb, extra_pythonpath=(_REPO_ROOT,)))
    log(f"host_copy: {ranks} {device} ranks ready in {time.perf_counter() - t_start:.1f} s")
    out = []
    try:
        for i, (transport, sharding, model) in enumerate(cases):
            t_case = time.perf_counter()
            key = ("host-copy", model, i)
            cluster.free_cached()
            cluster.run(_warm, model, fraction)
            gc.collect()
            time.sleep(1.0)
            baseline, baseline_no_idle = _pss_totals(os.getpid())
            before = _breakdown(os.getpid())
            t0 = time.perf_counter()
            driver_model = _driver_model(model, torch_dtype, build)
            build_s = time.perf_counter() - t0
            model_bytes = sum(p.numel() * p.element_size() for p in driver_model.parameters())
            computed = set(dit_models.constructor_dtypes(driver_model))
            largest_unit = max((sum(p.numel() * p.element_size() for p in u.parameters())
                                for _, u in find_units(driver_model, MODELS[model].blocks)), default=0)
            # gloo on CUDA tensors (ranks sharing a GPU) gathers each block through the host (comm_fsdp: the whole
            # block's output buffer and this rank's shard, one block at a time, every rank at once); ranks on separate
            # GPUs over NCCL stage nothing. Its bound, for the derived first-prompt figure without it:
            staging = (ranks + 1) * largest_unit if (device == "cuda" and sharding == "blocks" and ranks > 1) else 0
            persistent = {k: v for k, v in driver_model.state_dict().items() if k not in computed}
            log(f"host_copy: case {transport}:{sharding}: {model} ({model_bytes / 1e9:.2f} GB) built on {build} in {build_s:.1f} s")

            def make_payload():
                if transport == "numpy":
                    arrays, views = to_arrays(persistent)
                    return {"config": CONFIG, "state_dict": arrays, "views": views, "sharding": sharding, "transport": transport}
                return {"config": CONFIG, "state_dict": persistent, "views": {}, "sharding": sharding, "transport": transport}

            t0 = time.perf_counter()
            with _Sampler() as ship:
                if transport == "parts":
                    ship_model(cluster, key, lambda: {"model": model, "dtype": dtype, "sharding": sharding}, _begin_model,
                               names=list(persistent), tensor=persistent.__getitem__, end=_end_model,
                               part_bytes=part_bytes, sizes={k: v.numel() * v.element_size() for k, v in persistent.items()})
                else:
                    ship_model(cluster, key, make_payload, _begin_whole)
            ship_s = time.perf_counter() - t0
            after_ship = _breakdown(os.getpid())
            t0 = time.perf_counter()
            with _Sampler() as fwd:
                norms = cluster.run(_forward, model, dtype, run_blocks)
            forward_s = time.perf_counter() - t0
            after_first = _breakdown(os.getpid())
            first_report = cluster.run(_rank_report)
            with _Sampler() as later_s:
                for _ in range(later):
                    cluster.run(_forward, model, dtype, run_blocks)
            later_report = cluster.run(_rank_report)
            first_peak = max(ship.peak, fwd.peak)
            first_peak_no_idle = max(ship.peak_no_idle, fwd.peak_no_idle)
            rec = {
                "model": model, "device": device, "transport": transport, "sharding": sharding, "ranks": ranks,
                "dtype": dtype, "model_bytes": model_bytes, "part_bytes": part_bytes if transport == "parts" else None,
                "backend": cluster.backend, "rank_memory_fraction": fraction or None,
                "baseline_pss_bytes": baseline,
                "first_prompt_peak_above_baseline_bytes": first_peak - baseline,
                "later_prompts_peak_above_baseline_bytes": later_s.peak - baseline,
                "first_prompt_ratio": (first_peak - baseline) / model_bytes,
                "shipping_ratio": (ship.peak - baseline) / model_bytes,
                "first_forward_ratio": (fwd.peak - baseline) / model_bytes,
                "later_prompts_ratio": (later_s.peak - baseline) / model_bytes,
                "first_prompt_ratio_without_idle_workers": (first_peak_no_idle - baseline_no_idle) / model_bytes,
                "later_prompts_ratio_without_idle_workers": (later_s.peak_no_idle - baseline_no_idle) / model_bytes,
                "rank_local_weight_bytes": [r[0] for r in first_report],
                "rank_host_weight_bytes": [r[1] for r in first_report],
                "rank_gpu_peak_allocated_bytes_first_prompt": [r[2] for r in first_report],
                "rank_gpu_peak_reserved_bytes_first_prompt": [r[3] for r in first_report],
                "rank_gpu_peak_allocated_bytes_later": [r[2] for r in later_report],
                "rank_pinned_host_peak_bytes": [r[4] for r in later_report],
                "largest_block_bytes": largest_unit,
                "gloo_host_staging_bound_bytes": staging,
                "first_prompt_ratio_less_gloo_staging": (first_peak - baseline - staging) / model_bytes,
                "forward_blocks_per_stack": run_blocks or "all",
                "pss_growth_by_process_after_shipping": {k: after_ship.get(k, 0) - before.get(k, 0) for k in after_ship},
                "pss_growth_by_process_after_first_prompt": {k: after_first.get(k, 0) - before.get(k, 0) for k in after_first},
                "outputs_agree": len({round(n, 3) for n in norms}) == 1, "output_norms": norms,
                "seconds": {"build": build_s, "ship": ship_s, "first_forward": forward_s,
                            "case": time.perf_counter() - t_case},
            }
            # the driver's own forward on the same input (small models, on the host, after the figures): what every
            # rank's output must equal
            rec["reference_output_norm"] = (_run_model(driver_model, model, torch.device("cpu"), dtype, run_blocks)
                                            if model_bytes <= REFERENCE_MAX_BYTES else None)
            out.append(rec)
            log(json.dumps(rec))
            if on_record is not None:
                on_record(rec)
            cluster.free_cached()
            del driver_model, persistent
            gc.collect()
    finally:
        if device == "cuda":
            import ray

            cluster.shutdown()
            ray.shutdown()
        else:
            shutdown_cluster(stop_ray=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.dev.host_copy", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cases", default="torch:none,numpy:none,numpy:blocks", help="TRANSPORT:SHARDING,...")
    ap.add_argument("--model", default="wan-small", choices=sorted(MODELS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the ranks' device (cuda: they share GPU 0)")
    ap.add_argument("--build-device", default="auto", help="where the driver draws the random weights (auto: the GPU "
                    "with --device cuda, else the host); they end in host memory either way")
    ap.add_argument("--later", type=int, default=2, help="forwards after the first prompt")
    ap.add_argument("--object-store-mb", type=int, default=None)
    ap.add_argument("--run-blocks", type=int, default=0, help="the forwards run the first N blocks of each stack (0: all)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--part-mb", type=int, default=32, help="parts transport: MB of weights per part (the node: 256)")
    ap.add_argument("--append", action="store_true", help="add to the records already in --out (one case per process:"
                    " a process that ran a case keeps its freed memory, which the next case would reuse unseen)")
    a = ap.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    earlier = []
    if a.append and os.path.exists(a.out):
        with open(a.out) as f:
            earlier = json.load(f)["records"]
    spec = MODELS[a.model]
    header = {"command": "python -m tools.dev.host_copy " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": CONFIG if spec.preset == "wan-small" else getattr(_preset(a.model), spec.size),
              "torch": torch.__version__}
    records = list(earlier)

    def write(rec):
        records.append(rec)
        with open(a.out, "w") as f:
            json.dump(dict(header, records=records), f, indent=1)

    measure(cases, a.ranks, a.part_mb * 1024**2, model=a.model, device=a.device, build_device=a.build_device,
            later=a.later, object_store_mb=a.object_store_mb, run_blocks=a.run_blocks, on_record=write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
