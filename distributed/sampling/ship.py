"""Shipping a model to the ranks: the one way a model (a sampling UNet or DiT, a VAE) gets onto every rank.

:func:`ship_model` makes every rank hold model ``key`` in a named slot of its
:func:`~patchray.distributed.cluster.rank_cache`, **once per key**: the driver first asks the ranks what they hold
(one small call), and sends nothing when they all hold ``key``. Otherwise the ranks receive the weightless skeleton
first (``begin``: build it, shard its blocks on the meta device, allocate what the rank holds), then the weights part
by part (each a few hundred MB of numpy arrays, ``sampling.weights``): every rank copies its shard of each sharded
parameter (or the whole tensor of an unsharded one) out of the store's read-only view, and the part is freed before
the next is put. The peak above the driver's own copy is one part in the store plus what the ranks keep.

Design decisions:

* **One transport for every model.** Putting a whole payload into Ray's object store at once holds the driver's
  model, the store's full copy and whatever the ranks copy out of it, together, on the host; parts bound that to one
  part. A model small enough not to care (a test's tiny UNet) ships the same way, with its weights inside the
  skeleton and no parts.
* **A slot per kind of model.** A rank holds one model per slot (:data:`MODEL_SLOT` for sampling, the VAE's own
  slot for decode and encode): a new key replaces the slot's old model, which is freed before the new one arrives,
  and the sampling session bound to the sampling model (:data:`SESSION_SLOT`) is closed with it.
* **Parameters are filled in place**: a sharded parameter's local piece (FSDP2's dim-0 chunk of this rank) is copied
  from the matching rows of the full tensor, so a rank never holds a block whole; every other tensor is copied into
  its allocation (in the allocation's dtype).
* ``begin``/``end``/``prepare`` are the caller's functions, sent by reference (``cluster.fn_ref``) or pickled by Ray:
  nothing here imports a host application.
"""

from __future__ import annotations

import gc
import math
from typing import Any, Callable, Dict, Hashable, Iterable, Optional, Sequence

import torch
import torch.nn as nn

from .. import comm
from ..cluster import fn_ref, rank_cache, resolve_fn
from ..context import ParallelContext
from .weights import from_arrays, to_arrays

__all__ = ["ship_model", "rank_model", "MODEL_SLOT", "SESSION_SLOT", "parts_by_bytes", "materialize_meta", "fill_tensors",
           "whole_model_device", "tensor_bytes"]

#: rank_cache() entry of the sampling model: ``(key, model)``
MODEL_SLOT = "patchray.sampling.model"
#: rank_cache() entry of the sampling session bound to the sampling model (closed when that model is replaced)
SESSION_SLOT = "patchray.sampling.session"
#: the rank_cache() entry of a slot's model while it arrives: ``(key, built, module)``
_PARTIAL = "{}.partial"


def parts_by_bytes(names_and_bytes: Iterable[tuple], part_bytes: int) -> list:
    """Consecutive groups of names whose bytes add up to at most ``part_bytes`` (a larger tensor is a part alone)."""
    parts, cur, size = [], [], 0
    for name, nbytes in names_and_bytes:
        if cur and size + nbytes > part_bytes:
            parts.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    if cur:
        parts.append(cur)
    return parts


def materialize_meta(module: nn.Module, device: torch.device, shard_device: Optional[torch.device] = None) -> None:
    """Allocate (uninitialised) every meta parameter and buffer of ``module`` on ``device``; sharded units through
    ``to_empty`` (FSDP2 allocates only the local shard) on ``shard_device`` (default ``device``; the host for shards
    offloaded to host memory, where FSDP2's CPU offload requires them), other tensors one by one (real tensors are
    left alone). The scalars a sharded unit keeps whole (``comm.kept_whole``: ComfyUI's scaled-fp8 scales) are not
    shards: they go to ``device``, where their layer computes, also when the shards are on the host."""
    for m in module.modules():
        if comm.is_sharded(m):
            if any(p.is_meta for p in m.parameters()):
                m.to_empty(device=shard_device if shard_device is not None else device)
                for sub in m.modules():
                    for name, p in list(sub._parameters.items()):
                        if p is not None and comm.kept_whole(p) and not hasattr(p, "to_local") and p.device != device:
                            sub._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta and not hasattr(p, "to_local"):
                m._parameters[name] = _keep_attributes(p, nn.Parameter(_empty(p, device), requires_grad=p.requires_grad))
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = _keep_attributes(b, _empty(b, device))


def _empty(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like ``meta`` on ``device``. A tensor subclass (a quantized weight, e.g. the
    ComfyUI-GGUF pack's tensors) is allocated by its storage size and given its class back: ``empty_like`` of a meta
    tensor reads the Python ``shape``, which such a subclass redefines (the pack's answers the dequantized shape)."""
    if type(meta) in (torch.Tensor, nn.Parameter):
        return torch.empty_like(meta, device=device)
    return torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device=device).as_subclass(type(meta))


def _keep_attributes(meta: torch.Tensor, allocated: torch.Tensor) -> torch.Tensor:
    """``allocated`` with the Python attributes of tensor subclass ``meta`` (a quantized weight's type and logical
    shape): the allocation keeps the subclass but not what its instance carries, and the layer that reads the tensor
    needs both."""
    state = {k: v for k, v in getattr(meta, "__dict__", {}).items() if k != "_is_param"}
    if state and type(allocated) is type(meta):
        allocated.__dict__.update(state)
    return allocated


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (meta tensors count as allocated)."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def whole_model_device(ctx: ParallelContext, module: nn.Module) -> torch.device:
    """Where a rank that holds ``module`` whole (sharding ``none``) allocates it before the parts arrive: its GPU when
    the GPU's free memory (counting what PyTorch holds cached there) holds the weights and the activation reserve
    (``topology.shard_advice.activation_reserve``, the rule ``auto`` sharding decides ``none`` by), else the host.

    Why: allocated on the host and moved to the GPU once sampling starts (ComfyUI's loader), the weights would exist
    once per GPU rank in host memory while they arrive: N ranks on one machine, N whole host copies beside the
    driver's, for a model that ends on the GPUs. Filled on the GPU, a part goes from Ray's store straight to the card
    and the host holds the driver's copy plus the part in flight. A model that does not fit stays on the host, where
    ComfyUI's loader decides what to offload."""
    if ctx.device.type != "cuda":
        return torch.device("cpu")
    from ..topology.shard_advice import activation_reserve

    free, total = torch.cuda.mem_get_info(ctx.device)
    free += torch.cuda.memory_reserved(ctx.device) - torch.cuda.memory_allocated(ctx.device)
    return ctx.device if tensor_bytes(module) + activation_reserve(total) <= free else torch.device("cpu")


def _tensor_at(module: nn.Module, name: str):
    mod, _, leaf = name.rpartition(".")
    owner = module.get_submodule(mod) if mod else module
    if leaf in owner._parameters:
        return owner, leaf, owner._parameters[leaf], True
    if leaf in owner._buffers:
        return owner, leaf, owner._buffers[leaf], False
    raise KeyError(f"{type(module).__name__} has no parameter or buffer {name!r}")


def fill_tensors(module: nn.Module, tensors: Dict[str, torch.Tensor], ctx: ParallelContext) -> int:
    """Copy ``tensors`` (full tensors by state-dict name) into ``module``'s allocated parameters and buffers; a
    sharded parameter takes only this rank's rows. Returns the bytes this rank kept."""
    kept = 0
    with torch.no_grad():
        for name, full in tensors.items():
            owner, leaf, target, is_param = _tensor_at(module, name)
            if hasattr(target, "to_local"):  # an FSDP2 shard: dim-0 chunks of ceil(d0/N) rows, rank r the r-th
                local = target.to_local()
                rows = math.ceil(full.shape[0] / ctx.world_size)
                start = min(ctx.rank * rows, full.shape[0])
                local.copy_(full[start : start + local.shape[0]])
                kept += local.numel() * local.element_size()
            else:
                if tuple(target.size()) != tuple(full.size()):
                    # backstop, not the guard: copy_ would broadcast (and a quantized tensor subclass may swallow the
                    # error), leaving the weight wrong without a word
                    raise ValueError(f"{name}: the shipped tensor has size {tuple(full.size())}, the rank's "
                                     f"{tuple(target.size())}")
                target.copy_(full)
                kept += target.numel() * target.element_size()
    return kept


def rank_model(key: Hashable, slot: str = MODEL_SLOT) -> Any:
    """The model this rank holds in ``slot`` under ``key`` (raises a clear error if another key, or none, is held)."""
    entry = rank_cache().get(slot)
    if entry is None or entry[0] != key:
        held = None if entry is None else entry[0]
        raise RuntimeError(f"this rank holds model {held!r}, not {key!r}: call ship_model() before using it")
    return entry[1]


def _has_model(ctx: ParallelContext, slot: str, key: Hashable) -> bool:
    entry = rank_cache().get(slot)
    return entry is not None and entry[0] == key


_has_model.patchray_task = "checking the ranks' cached model"


def _drop_previous(slot: str) -> None:
    cache = rank_cache()
    old = cache.pop(slot, None)
    cache.pop(_PARTIAL.format(slot), None)
    if slot == MODEL_SLOT:
        session = cache.pop(SESSION_SLOT, None)
        if session is not None:
            session.close()
    del old  # free the previous model before the new one arrives
    gc.collect()  # host-application modules may hold reference cycles


def _begin(ctx: ParallelContext, slot: str, key: Hashable, begin, payload_ref, prepare, prepare_args) -> bool:
    import ray

    _drop_previous(slot)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    if prepare is not None:
        resolve_fn(prepare)(ctx, *prepare_args)
    built, module = resolve_fn(begin)(ctx, ray.get(payload_ref))
    rank_cache()[_PARTIAL.format(slot)] = (key, built, module)
    return True


_begin.patchray_task = "receiving the model"


def _part(ctx: ParallelContext, slot: str, key: Hashable, part_ref) -> int:
    import ray

    entry = rank_cache().get(_PARTIAL.format(slot))
    if entry is None or entry[0] != key:  # backstop, not the guard: the driver sends begin first
        raise RuntimeError(f"a part of model {key!r} arrived before its skeleton")
    part = ray.get(part_ref)
    kept = fill_tensors(entry[2], from_arrays(part["arrays"], part["views"], copy=False), ctx)
    del part
    return kept


_part.patchray_task = "receiving the model"


def _end(ctx: ParallelContext, slot: str, key: Hashable, end) -> bool:
    key_, built, module = rank_cache().pop(_PARTIAL.format(slot))
    model = resolve_fn(end)(ctx, built) if end is not None else built
    rank_cache()[slot] = (key, model)
    return True


_end.patchray_task = "receiving the model"


def ship_model(
    cluster,
    key: Hashable,
    make_skeleton: Callable[[], Any],
    begin: Any,
    *,
    names: Sequence[str] = (),
    tensor: Optional[Callable[[str], torch.Tensor]] = None,
    end: Any = None,
    part_bytes: int = 256 * 1024**2,
    sizes: Optional[Dict[str, int]] = None,
    prepare: Any = None,
    prepare_args: Sequence[Any] = (),
    slot: str = MODEL_SLOT,
    timeout_s: Optional[float] = None,
    cancel_check: Optional[Callable[[], None]] = None,
) -> bool:
    """Make every rank hold model ``key`` in ``slot``, the weights sent in parts of at most ``part_bytes``; returns
    True when it had to be sent.

    Args:
        cluster: a :class:`~patchray.distributed.cluster.RankCluster`.
        key: identifies the model's weights (hashable, picklable); equal keys must mean equal weights.
        make_skeleton: builds the payload ``begin`` receives (called only when some rank lacks ``key``): the
            weightless skeleton, or a small model whole.
        begin: ``begin(ctx, skeleton) -> (built, module)`` on each rank (a function or ``"module:function"``): the
            rank's object and the module whose state-dict names ``names`` are, its blocks sharded and every tensor
            allocated (``materialize_meta``).
        names: the state-dict names of the weights to send after the skeleton, in order (default none).
        tensor: ``tensor(name)`` -> the weight (a CPU tensor; computed per part, so a patched weight exists on the
            driver one part at a time). Required with ``names``.
        end: ``end(ctx, built) -> model`` once every part arrived (default: ``built``).
        sizes: bytes per name (to cut the parts without computing the tensors first); default: computed.
        prepare: ``prepare(ctx, *prepare_args)`` on each rank before the skeleton is unpickled (e.g. make the host
            application importable).
        slot: the rank_cache() entry the model goes to (:data:`MODEL_SLOT`: the sampling model).

    Example::

        >>> ship_model(cluster, ("unet", digest), lambda: {"config": cfg}, build_on_meta,
        ...            names=list(sd), tensor=sd.__getitem__)
        True
    """
    import ray

    if names and tensor is None:
        raise ValueError("ship_model: names need tensor= (a function returning each named weight)")
    have = cluster.run(_has_model, slot, key, timeout_s=timeout_s, cancel_check=cancel_check)
    if all(have):
        return False
    ref = ray.put(make_skeleton())
    try:
        cluster.run(_begin, slot, key, fn_ref(begin), ref, fn_ref(prepare) if prepare is not None else None,
                    tuple(prepare_args), timeout_s=timeout_s, cancel_check=cancel_check)
    finally:
        del ref
    names = list(names)
    if names and sizes is None:
        sizes = {n: tensor(n).numel() * tensor(n).element_size() for n in names}
    for group in parts_by_bytes(((n, sizes[n]) for n in names), part_bytes):
        arrays, views = to_arrays({n: tensor(n) for n in group})
        ref = ray.put({"arrays": arrays, "views": views})
        del arrays
        try:
            cluster.run(_part, slot, key, ref, timeout_s=timeout_s, cancel_check=cancel_check)
        finally:
            del ref
    cluster.run(_end, slot, key, fn_ref(end) if end is not None else None, timeout_s=timeout_s, cancel_check=cancel_check)
    return True
