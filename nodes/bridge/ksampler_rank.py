"""ComfyUI's own sampler on each rank, with each model call (UNet or DiT) routed through the patch-parallel session.

Runs in the rank processes, never in ComfyUI's process: the driver passes these functions themselves, and the cluster
sends them by their canonical name (``patchray.nodes.bridge.ksampler_rank:...``, ``cluster.fn_ref``).
ComfyUI is imported only after :func:`prepare` has put its folder on the import path, with ``--cpu`` semantics on
CPU ranks (ComfyUI's device logic assumes CUDA otherwise). GPU ranks see one GPU (Ray's ``CUDA_VISIBLE_DEVICES``),
which ComfyUI's model management then uses as its device.

Each rank runs ``comfy.sample.sample`` — the stock KSampler path: sigmas from ComfyUI's scheduler, its sampler,
CFG, model_options — on identical inputs (the driver prepared the seeded noise). A DIFFUSION_MODEL wrapper (ComfyUI's
own extension point around ``UNetModel.forward``) hands every model call to :class:`RankSession.denoise`, so each
rank computes its row band; the final latent is assembled exactly from every rank's own band.

ComfyUI decides per model call whether cond and uncond share one batch, from this device's free memory; ranks that
decided differently would make different collective calls. A CALC_COND_BATCH wrapper (ComfyUI's extension point
around that decision) makes every rank decide from the group's minimum free memory: for the duration of the call
only, the model the wrapper is handed answers ``memory_required`` with the agreed verdict. Nothing process-wide
(``comfy.model_management``) is replaced, and the model is restored exactly when the call ends, also on error.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Callable

import torch

__all__ = [
    "WRAPPER_KEY", "prepare", "share_host_memory", "begin_parts", "end_parts", "device_memory", "host_memory", "sample", "agreed_batching",
    "patch_parallel", "comm_seconds", "probe_calls",
]

WRAPPER_KEY = "patchray.patch_parallel"


def prepare(ctx, comfy_root: str) -> None:
    """Make ComfyUI importable in this rank process (once), on the rank's device."""
    if comfy_root not in sys.path:
        sys.path.append(comfy_root)  # appended: ComfyUI's top-level names must not shadow installed packages
    if "comfy.model_management" not in sys.modules:
        import comfy.cli_args  # parses no command line unless comfy.options enabled it (ComfyUI's main.py does)

        if ctx.device.type == "cpu":
            comfy.cli_args.args.cpu = True
    import comfy.model_management as mm

    dev = mm.get_torch_device()
    if dev.type != ctx.device.type:
        raise RuntimeError(f"ComfyUI on this rank chose device {dev}, the rank runs on {ctx.device}")
    if ctx.device.type == "cpu":
        share_host_memory(mm, ctx.world_size)


_SHARED = "_patchray_host_share"


def share_host_memory(mm, ranks: int) -> None:
    """Make this CPU rank's ComfyUI size its work (attention chunks, cond batching, weight offload) to its share of the
    host's free memory: ``comfy.model_management.get_free_memory`` answers the host's available memory divided by
    ``ranks`` for CPU devices. ComfyUI's attention functions size their chunks from that figure at every call; N CPU
    ranks on one host each sized against all of it would together take N times the free memory. The rank process is
    PatchRay's own (ComfyUI's process is never changed); idempotent; a larger ``ranks`` than share the host only makes
    the chunks smaller (same results, chunked sums)."""
    current = mm.get_free_memory
    original = getattr(current, _SHARED, current)
    ranks = max(1, int(ranks))

    def get_free_memory(dev=None, torch_free_too=False):
        out = original(dev, torch_free_too)
        device = mm.get_torch_device() if dev is None else dev
        if getattr(device, "type", None) != "cpu" or ranks == 1:
            return out
        return tuple(v / ranks for v in out) if isinstance(out, tuple) else out / ranks

    setattr(get_free_memory, _SHARED, original)
    mm.get_free_memory = get_free_memory


def begin_parts(ctx, payload: dict):
    """Rank side of ``sampling.ship.ship_model``: the skeleton, its blocks sharded on the meta device
    (``sharding=blocks``: each rank allocates only its shards, on its device; ``blocks+offload``: in host memory, where
    FSDP2's CPU offload keeps them), every other tensor allocated (``none``: on the rank's GPU when the model and the
    activation reserve fit its free memory, so the parts go straight to the card and no rank holds a host copy;
    otherwise on the host, where ComfyUI's loader decides what to offload: ``sampling.ship.whole_model_device``).
    Returns ``(base, base)``: the parts fill the BaseModel by its state-dict names."""
    import comfy.model_management as mm

    from ...distributed.sampling.ship import materialize_meta, whole_model_device
    from .shard_models import SHARDED, apply_sharding

    mm.unload_all_models()
    mm.soft_empty_cache()
    base = payload["skeleton"]
    sharding = payload.get("sharding", "none")
    if sharding in SHARDED and ctx.world_size > 1:
        shard_device = torch.device("cpu") if sharding == "blocks+offload" else ctx.device
        handle = apply_sharding(ctx, base, sharding, init=lambda dm: materialize_meta(base, ctx.device, shard_device))
        base.__dict__["_patchray_shards"] = handle
    else:
        materialize_meta(base, whole_model_device(ctx, base))
    if payload.get("ggml_patches"):
        # a LoRA on a GGUF model's quantized weights: attached to the rank's tensors as the pack's patcher attaches them
        from .gguf_weights import attach_patches

        device = mm.get_torch_device() if payload.get("ggml_patch_on_device") else mm.unet_offload_device()
        attach_patches(base, payload["ggml_patches"], device)
    return base, base


def end_parts(ctx, base):
    """The rank's ModelPatcher once every part arrived (its size: what this rank holds)."""
    import comfy.model_management as mm
    import comfy.model_patcher

    from .shard_models import local_model_bytes

    mp = comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())
    handle = base.__dict__.get("_patchray_shards")
    if handle is not None:
        mp.size = local_model_bytes(base, handle)
    return mp


def device_memory(ctx) -> tuple:
    """``(free, total, device type)`` of this rank's device, free counting what PyTorch holds here (a cached model is
    replaced when the next one ships, so its memory is available to it): the driver's ``sharding=auto`` input."""
    if ctx.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ctx.device)
        return float(free + torch.cuda.memory_reserved(ctx.device)), float(total), "cuda"
    import psutil

    vm = psutil.virtual_memory()
    return float(vm.available), float(vm.total), ctx.device.type


def host_memory(ctx) -> tuple:
    """``(machine, available, total)`` bytes of this rank's host memory: the driver's ``sharding=blocks+offload`` check.

    ``available`` is ``psutil``'s figure plus what the model this rank caches holds in host memory (a new model
    replaces it, so its memory is available to the next one; the same model is not shipped again). Ranks on one
    machine report the same ``machine`` name, so the driver adds up the shards each machine would pin."""
    import socket

    import psutil

    from ...distributed.cluster import rank_cache
    from ...distributed.sampling.ship import MODEL_SLOT

    entry = rank_cache().get(MODEL_SLOT)
    held = host_bytes(getattr(entry[1], "model", entry[1])) if entry is not None else 0
    vm = psutil.virtual_memory()
    return socket.gethostname(), float(vm.available + held), float(vm.total)


def host_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers (this rank's shards of sharded ones) in host memory; 0 for anything
    that is not a module."""
    from ...distributed import comm

    if not isinstance(model, torch.nn.Module):
        return 0
    held, seen = 0, set()
    for t in list(model.parameters()) + list(model.buffers()):
        local = comm.local_shard(t)
        if local.device.type == "cpu" and local.data_ptr() not in seen:
            seen.add(local.data_ptr())
            held += local.numel() * local.element_size()
    return held


_NOT_SET = object()


def agreed_batching(session, free_memory: Callable[[torch.device], float]):
    """A CALC_COND_BATCH wrapper: cond/uncond batching decided from the ranks' minimum free memory.

    ComfyUI batches when ``model.memory_required(shape) * 1.5 < free_memory`` (``comfy.samplers._calc_cond_batch``).
    Inside the call, ``model.memory_required`` is an instance attribute that returns ``-inf`` when the batch fits
    the agreed (minimum) free memory and ``+inf`` when it does not, so every rank's comparison gives the same
    answer whatever its own free memory. One tiny all-reduce per call.

    Args:
        session: the rank's ``RankSession`` (its ``agree_min`` is the collective).
        free_memory: ``free_memory(device) -> bytes``, ComfyUI's ``model_management.get_free_memory``.
    """

    def wrapper(executor, model, conds, x_in, *args, **kwargs):
        agreed = session.agree_min(free_memory(x_in.device))
        required = model.memory_required  # the model's own estimate (bound method or an earlier override)
        own = model.__dict__.get("memory_required", _NOT_SET)

        def memory_required(input_shape, cond_shapes=None):
            fits = required(input_shape, cond_shapes=cond_shapes if cond_shapes is not None else {}) * 1.5 < agreed
            return -math.inf if fits else math.inf

        model.memory_required = memory_required
        try:
            return executor(model, conds, x_in, *args, **kwargs)
        finally:
            if own is _NOT_SET:
                del model.memory_required
            else:
                model.memory_required = own

    return wrapper


def patch_parallel(session):
    """A DIFFUSION_MODEL wrapper: every model call goes through ``session.denoise`` (the rank computes its band)."""

    def wrapper(executor, x, timesteps, context=None, y=None, control=None, transformer_options=None, **kwargs):
        if control is not None:
            raise NotImplementedError("PatchRay: ControlNet is not supported yet; sample this graph without PatchRay")
        # ComfyUI's UNet writes into transformer_options: a call without them gets a dict of its own
        transformer_options = {} if transformer_options is None else transformer_options
        stream = tuple(transformer_options.get("cond_or_uncond", ()))  # cond and uncond may arrive in separate calls
        return session.denoise(
            executor.class_obj, executor, x, timesteps, stream=stream,
            context=context, y=y, control=control, transformer_options=transformer_options, **kwargs,
        )

    return wrapper


def _layout(inputs: dict):
    from .dit_layout import Layout

    raw = inputs.get("layout")
    return Layout(**raw) if raw else None



def comfy_linear_rows(module, x, lo: int, hi: int):
    """Rows ``lo:hi`` of one of ComfyUI's linear layers, as its forward would use them: the weight and bias sliced,
    then cast to ``x``'s dtype and device as ComfyUI's per-call cast does (fp8 weights, weights offloaded to the
    host), or ``None`` where the layer computes something else (a LoRA or other patch applied on the fly, a scaled
    fp8 or quantised weight, another class's forward): its own forward then fills its share
    (``distributed/parallel/seq_modulation.py``)."""
    from comfy import ops

    from ...distributed.parallel.seq_modulation import linear_rows, weight_rows

    base = ops.disable_weight_init.Linear
    if type(module).forward is not base.forward:
        return linear_rows(module, x, lo, hi)
    w = module.weight
    # fp8 matmul ops and scaled fp8 weights compute the layer another way (their own cast path): left to them
    if (getattr(type(module), "forward_comfy_cast_weights", None) is not base.forward_comfy_cast_weights
            or getattr(module, "weight_function", None) or getattr(module, "bias_function", None)
            or getattr(module, "scale_weight", None) is not None or getattr(module, "scale_input", None) is not None
            or type(w) is not torch.nn.Parameter or not w.dtype.is_floating_point or w.is_meta):
        return None
    return weight_rows(w, module.bias, x, lo, hi)


def sample(ctx, mp, session, inputs: dict) -> torch.Tensor:
    """``comfy.sample.sample`` with the model calls routed through PatchRay; returns the final latent.

    Without a layout (or for a UNet's sequence layout over every rank) the UNet call goes through ``session`` (row-band
    patch parallelism); other layouts install :mod:`.dit_rank`'s CFG, batch and sequence wrappers for this run.
    """
    import comfy.model_management as mm
    import comfy.patcher_extension as pe

    model = mp.clone()
    model.model_options = inputs["model_options"]
    for name, obj in inputs["object_patches"].items():
        model.add_object_patch(name, obj)
    _drop_other_group_session(session)
    layout = _layout(inputs)
    with comm_seconds(ctx.device, ctx.world_size) as comm:
        if layout is None or (layout.mode == "sequence" and inputs.get("kind", "unet") == "unet"):
            model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, patch_parallel(session))
            model.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, agreed_batching(session, mm.get_free_memory))
            latent = _run(model, session, inputs)
        else:
            latent = _sample_layout(ctx, model, session, inputs, layout)
    session.info["comm_s"] = comm["s"]
    session.info["comm_bytes"] = comm["bytes"]
    if session.info.get("probe") is not None:
        from ...distributed.sampling.exactness import agreed_error

        # per batch row, the best of this rank's calls (the first may hold one-off set-up); the slowest rank's figure
        mine = min((c["ms"] / max(1, c["rows"]) for c in session.info["probe"]), default=float("inf"))
        session.info["probe_row_ms"] = agreed_error(ctx, mine)
    return latent


def _group_size(call, world: int) -> int:
    """The ranks a collective spans, read from its own buffers (a CFG or sequence group is smaller than the world)."""
    a = call.args
    if call.op == "all_gather" and a and isinstance(a[0], (list, tuple)):
        return len(a[0])
    if call.op == "all_gather_into_tensor" and len(a) > 1:
        return max(1, a[0].numel() // max(1, a[1].numel()))
    return int(world)


@contextlib.contextmanager
def comm_seconds(device, world_size: int = 1):
    """The seconds this rank's sampling waits in communication calls and the bytes it puts on its link (yields
    ``{"s": ..., "bytes": ...}``, complete once the block ends). CUDA ranks: a pair of CUDA events around each top-level
    call on the compute stream, read at the end, so nothing synchronizes while the run goes on and an asynchronous call
    counts only the wait it causes there; CPU ranks (gloo): the host time inside each call. Calls made inside another (a
    batch's sends) are the outer call's. The bytes follow the benchmark's rules (``bench.linkmodel.call_wire_bytes``)."""
    import time

    from ...distributed.bench.linkmodel import call_wire_bytes
    from ...distributed.comm import intercept

    cuda = getattr(device, "type", None) == "cuda"
    pairs = []
    stats = {"s": 0.0, "bytes": 0}

    def timer(call, proceed):
        if call.batched:
            return proceed()
        stats["bytes"] += call_wire_bytes(call, _group_size(call, world_size))
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            result = proceed()
            end.record()
            pairs.append((begin, end))
            return result
        start = time.perf_counter()
        result = proceed()
        stats["s"] += time.perf_counter() - start
        return result

    with intercept(timer):
        yield stats
    if pairs:
        torch.cuda.synchronize()
        stats["s"] += sum(b.elapsed_time(e) for b, e in pairs) / 1e3


def probe_calls(counter, record: list):
    """An APPLY_MODEL wrapper for the measured plan: the whole model runs on this rank (counted like
    :func:`_counted`), and each call appends ``{"ms", "rows", "sites", "out_bytes", "itemsize"}`` to ``record``: its
    time (the device synchronized around it), its batch rows, its self-attentions by shape (tokens, heads, head size,
    batch: calls, recorded through ComfyUI's ``optimized_attention_override``) and its output's size."""
    import time

    def wrapper(executor, *args, **kwargs):
        sites = {}
        args = list(args)
        if len(args) > 5:
            to = args[5] = dict(args[5] or {})
        else:
            to = kwargs["transformer_options"] = dict(kwargs.get("transformer_options") or {})
        inner = to.get("optimized_attention_override")

        def attention(func, *a, **kw):
            q, k = a[0], a[1]
            heads = int(a[3] if len(a) > 3 else kw.get("heads", 1))
            if kw.get("skip_reshape", False):  # [B, H, L, D]
                b, tokens, keys, dim = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
            else:  # [B, L, H * D]
                b, tokens, keys, dim = q.shape[0], q.shape[1], k.shape[1], q.shape[-1] // max(1, heads)
            if tokens == keys:  # a self or joint attention (cross-attention keys are the text's, kept whole)
                shape = (int(tokens), heads, int(dim), int(b))
                sites[shape] = sites.get(shape, 0) + 1
            return inner(func, *a, **kw) if inner is not None else func(*a, **kw)

        to["optimized_attention_override"] = attention
        x = args[0]
        cuda = x.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        with counter.call():
            out = executor(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize(x.device)
        record.append({"ms": (time.perf_counter() - start) * 1e3, "rows": int(x.shape[0]),
                       "sites": [list(s) + [n] for s, n in sites.items()],
                       "out_bytes": int(out.numel() * out.element_size()), "itemsize": int(out.element_size())})
        return out

    return wrapper


def _sample_layout(ctx, model, session, inputs: dict, layout) -> torch.Tensor:
    import comfy.model_management as mm
    import comfy.patcher_extension as pe

    from . import dit_rank
    from .dit_models import find_row

    counter = dit_rank.Counter(session)
    undo = []
    group_session = None
    seq = None
    if layout.batch:
        # around BaseModel.apply_model, which every model class goes through (several diffusion models of ComfyUI
        # 0.3.64, SD3's MMDiT among them, never call DIFFUSION_MODEL wrappers); its rows are per-row independent too
        model.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, dit_rank.BATCH_KEY, dit_rank.batch_parallel(ctx, counter))
        agree = ctx
    else:
        if layout.mode == "replicated":  # cfg = 1 on a model without a sequence split: every rank samples it whole
            from ...distributed.context import ParallelContext

            seq_ctx = ParallelContext.single(ctx.device)
        else:
            place = dit_rank.make_groups(ctx, layout.cfg_groups, layout.seq_ranks)  # the library's GroupLayout
            # the groups are kept across runs; this run's band weights (balance) are its members' share of ctx's
            seq_ctx = place.inner.member_weights(ctx.band_weights, ctx.global_ranks or tuple(range(ctx.world_size)))
            if layout.cfg_groups > 1:
                model.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, dit_rank.CFG_KEY, dit_rank.cfg_parallel(place))
        agree = seq_ctx
        dm = model.model.diffusion_model
        if layout.seq_ranks > 1 and inputs.get("kind") == "dit":
            row = find_row(type(dm).__name__)
            if row is None:  # backstop, not the guard: the driver refuses models without a row
                raise NotImplementedError(f"no DiT table row for {type(dm).__name__}")
            if inputs.get("verify"):
                # the runtime exactness check: first use of this (class, ComfyUI, PatchRay, mode); raises on a mismatch
                session.info["exactness"] = verify_sequence(ctx, seq_ctx, model, row, dm, inputs)
            seq = dit_rank.sequence_parallel(seq_ctx, row, dm, attention=inputs.get("attention", "auto"), counter=counter,
                                             config=session.config, linear_rows=comfy_linear_rows)
            undo.append(seq.remove)
            model.add_wrapper_with_key(getattr(pe.WrappersMP, row.entry), dit_rank.SEQ_KEY, seq.wrapper)
        elif layout.seq_ranks > 1:
            group_session = _group_session(seq_ctx, session)
            group_session.begin()
            model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, patch_parallel(group_session))
        elif inputs.get("probe") and layout.mode == "replicated":  # the measured plan's call (parallel_model.measure)
            session.info["probe"] = []
            model.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, dit_rank.SEQ_KEY, probe_calls(counter, session.info["probe"]))
        else:  # the whole model on this rank: counted around apply_model, which every model class goes through
            model.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, dit_rank.SEQ_KEY, _counted(counter))
    if layout.batch or layout.seq_ranks > 1:
        # every rank of a group must batch cond/uncond alike: its model calls hold collectives
        model.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, agreed_batching(dit_rank.Agree(agree), mm.get_free_memory))
    try:
        latent = _run(model, session, inputs)
        if seq is not None:
            # the attention modes the calls ran (auto's choice, and gathered where a mask or stale K/V needed it):
            # the node names them
            session.info["attention_calls"] = dict(seq.state.mode_calls)
            latent = seq.finalize(latent)
        if group_session is not None:
            latent = group_session.finalize(latent)
            session.calls += group_session.calls
            session.entered += group_session.entered
        return latent
    finally:
        for fn in reversed(undo):
            fn()


@contextlib.contextmanager
def fp32_compute(base):
    """Run the ComfyUI model ``base`` in fp32 within the block: its inputs and conditionings are cast to fp32
    (``manual_cast_dtype``, as ComfyUI's ``apply_model`` reads it) and every ComfyUI layer casts its weights to its
    input's dtype as it runs (``comfy_cast_weights``, the protocol ComfyUI's own partial loading uses), so the stored
    weights (bf16, fp8, sharded) are neither copied nor changed; TF32 is off for the block. All are restored on exit."""
    layers = [m for m in base.diffusion_model.modules() if hasattr(m, "comfy_cast_weights")]
    saved = [m.__dict__.get("comfy_cast_weights", _UNSET) for m in layers]
    cast = base.__dict__.get("manual_cast_dtype", _UNSET)
    # full fp32 products: TF32 (10-bit mantissa) puts a deep model's two exact orders 3e-4..1e-3 apart on a GPU
    precision = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        for m in layers:
            m.comfy_cast_weights = True
        base.manual_cast_dtype = torch.float32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = precision
        for m, value in zip(layers, saved):
            if value is _UNSET:
                m.__dict__.pop("comfy_cast_weights", None)
            else:
                m.comfy_cast_weights = value
        if cast is _UNSET:
            base.__dict__.pop("manual_cast_dtype", None)
        else:
            base.manual_cast_dtype = cast


_UNSET = object()


def verify_sequence(ctx, seq_ctx, model, row, dm, inputs: dict) -> dict:
    """The runtime exactness check of a DiT row (``distributed/sampling/exactness.py``): one sampling step of a small
    crop of this run's latent (the smallest token grid that gives every sequence rank two token rows; the run's own
    conditionings, mask and seed), once with the whole model on every rank and once split by the row, compared.
    Every rank agrees on the largest error; above the bound all ranks raise ``ExactnessMismatch``.

    Both calls compute in fp32 (:func:`fp32_compute`: each layer's weights cast up as it runs, stored weights
    untouched), whatever the model's dtype: in bf16 a deep model's rounding alone reaches the size of a wrong layout's
    error (Wan 2.1 14B with random weights: 4.6e-2 between two exact bf16 orders), while in fp32 an exact split stays
    near 1e-6 and a wrong one above 1e-2. A model whose layers cannot compute in fp32 is checked in its own dtype
    against that dtype's bound. Returns what the driver records: the error, the bound, the dtype compared, the seconds
    and this rank's peak memory of the check."""
    import time

    import comfy.model_management as mm
    import comfy.patcher_extension as pe
    import comfy.samplers

    from ...distributed.sampling.exactness import ExactnessMismatch, agreed_error, bound_for, relative_error
    from . import dit_rank

    sigmas = inputs["sigmas"]
    if sigmas.shape[-1] < 2:
        return {}
    _, ph, pw = row.patch(dm)
    latent, noise = inputs["latent_image"], inputs["noise"]
    rows, cols = min(int(latent.shape[-2]), ph * seq_ctx.world_size * 2), min(int(latent.shape[-1]), pw * 4)

    def cut(t):
        return t[..., :rows, :cols].contiguous()

    sampler = comfy.samplers.sampler_object("euler")
    sharded = model.model.__dict__.get("_patchray_shards") is not None
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    start = time.perf_counter()

    portable = _crop_grid_conds(inputs["guider"], row.grid_conds, cut)

    def one_step(m, agree):
        m.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, agreed_batching(dit_rank.Agree(agree), mm.get_free_memory))
        guider = rebuild_guider(portable, m)
        with torch.no_grad() if sharded else torch.inference_mode():
            return guider.sample(cut(noise), cut(latent), sampler, sigmas[:2], denoise_mask=inputs.get("denoise_mask"),
                                 callback=None, disable_pbar=True, seed=inputs.get("seed"))

    def both(agree_ctx):
        whole = one_step(model.clone(), agree_ctx)
        probe = dit_rank.sequence_parallel(seq_ctx, row, dm, attention=inputs.get("attention", "auto"), config=None,
                                           linear_rows=comfy_linear_rows)
        try:
            split_model = model.clone()
            split_model.add_wrapper_with_key(getattr(pe.WrappersMP, row.entry), dit_rank.SEQ_KEY, probe.wrapper)
            split = one_step(split_model, seq_ctx)
        finally:
            probe.remove()
        return whole, split

    base = model.model
    dtype = torch.float32
    failed = None
    try:
        with fp32_compute(base):
            whole, split = both(ctx)
    except (RuntimeError, TypeError) as exc:  # a layer outside ComfyUI's cast protocol met an fp32 input
        failed = exc
    from ...distributed.sampling.exactness import agreed_flag

    if agreed_flag(ctx, failed is not None):  # any rank failed: every rank checks in the model's own dtype
        dtype = getattr(base, "manual_cast_dtype", None) or base.get_dtype()
        whole, split = both(ctx)
    err = agreed_error(ctx, relative_error(whole, split))
    bound = bound_for(dtype)
    seconds = time.perf_counter() - start
    if not err <= bound:
        raise ExactnessMismatch(
            f"PatchRay's exactness check: sequence parallelism on {type(dm).__name__} computes a different step than the "
            f"whole model (relative error {err:.2e} > bound {bound:.0e} for {str(dtype).replace('torch.', '')}): PatchRay's "
            f"table does not match this ComfyUI's {type(dm).__name__}")
    return {"error": err, "bound": bound, "dtype": str(dtype).replace("torch.", ""), "seconds": seconds,
            "peak_bytes": int(torch.cuda.max_memory_allocated(ctx.device)) if cuda else 0,
            "grid": [int(d) for d in cut(latent).shape]}


def _counted(counter):
    """An APPLY_MODEL wrapper that only counts (the whole model runs on this rank: CFG split, no sequence split)."""

    def wrapper(executor, *args, **kwargs):
        with counter.call():
            return executor(*args, **kwargs)

    return wrapper


_GROUP_SESSION = "patchray.sampling.group_session"


def _group_session(ctx, session):
    """The UNet's patch-parallel session over one CFG group (kept across runs like the WORLD session)."""
    from ...distributed.cluster import rank_cache
    from ...distributed.sampling.remote import RankSession

    cache = rank_cache()
    held = cache.get(_GROUP_SESSION)
    if held is not None and (held.key, held.config, held.ctx.global_ranks, held.ctx.band_weights) == (
            session.key, session.config, ctx.global_ranks, ctx.band_weights):
        return held
    if held is not None:
        held.close()
    held = cache[_GROUP_SESSION] = RankSession(ctx, session.key, session.config, session.input_conv)
    return held


def _drop_other_group_session(session) -> None:
    """A group session of another model (or another run's config) holds adapters on that model: release it."""
    from ...distributed.cluster import rank_cache

    held = rank_cache().get(_GROUP_SESSION)
    if held is not None and (held.key, held.config) != (session.key, session.config):
        rank_cache().pop(_GROUP_SESSION).close()


def _crop_grid_conds(portable, keys, cut):
    """``portable`` (a guider's ``(class, state)``) with the conditionings' tensors under ``keys`` (a row's
    ``grid_conds``: a stream on the latent's grid, e.g. Wan VACE's control frames and masks) cut like the latent."""
    if not keys:
        return portable
    cls, state = portable

    def crop(value):
        return type(value)(crop(v) for v in value) if isinstance(value, (list, tuple)) else cut(value)

    conds = {name: [dict(c, **{k: crop(c[k]) for k in keys if c.get(k) is not None}) for c in items]
             for name, items in (state.get("original_conds") or {}).items()}
    return cls, dict(state, original_conds=conds)


def rebuild_guider(portable, model):
    """The driver's guider around this rank's ModelPatcher ``model`` (``portable``: ``(class, state)`` from
    ``parallel_model.portable_guider``). ``CFGGuider.__init__`` sets exactly the model and its options; the rest of
    the state (conditionings, scales, a subclass's own attributes) is the driver's."""
    cls, state = portable
    guider = cls.__new__(cls)
    guider.__dict__.update(state)
    guider.model_patcher = model
    guider.model_options = model.model_options
    return guider


def _run(model, session, inputs: dict) -> torch.Tensor:
    """ComfyUI's own sampling loop on this rank: the driver's guider rebuilt around this rank's model, sampling with the
    driver's sampler object, sigmas, noise, latent and mask. Rank 0 keeps its last denoised estimate for the driver's
    callback (SamplerCustom's denoised output)."""
    guider = rebuild_guider(inputs["guider"], model)
    last = {}

    def callback(step, x0, x, total_steps):
        session.progress(step + 1, total_steps)
        last["x0"] = x0

    # FSDP2's sharded parameters are DTensors, which cannot be detached inside inference mode (ComfyUI's loader sizes
    # modules through state_dict(), which detaches): a sharded model samples under no_grad, which computes the same
    sharded = model.model.__dict__.get("_patchray_shards") is not None
    with torch.no_grad() if sharded else torch.inference_mode():
        out = guider.sample(
            inputs["noise"], inputs["latent_image"], inputs["sampler"], inputs["sigmas"],
            denoise_mask=inputs.get("denoise_mask"), callback=callback, disable_pbar=True, seed=inputs.get("seed"),
        )
    if last.get("x0") is not None and session.ctx.rank == 0:
        session.info["x0"] = last["x0"].detach().to("cpu")
    return out
