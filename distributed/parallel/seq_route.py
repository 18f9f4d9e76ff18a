"""The route from a host attention processor's attention call to :class:`~.seq_attention.SequenceAttention`.

A diffusers DiT attention module computes its q, k, v, RoPE and norms in its *processor* and ends in one call of
``dispatch_attention_fn`` (diffusers >= 0.35: ``[batch, tokens, heads, head_dim]`` tensors and the processor's
backend) or, in older and hand-written processors, ``F.scaled_dot_product_attention``. Sequence parallelism has to
replace that one call by the exchange; everything else in the processor must run as it is.

Design decisions:

* **Rebind the name the processor calls, not the library.** :func:`reroute_processor` gives the processor a
  ``__call__`` with the same code, defaults, closure and signature as its class's, whose globals are a copy of
  the defining module's namespace in which that one name (``dispatch_attention_fn``, or ``F`` with its
  ``scaled_dot_product_attention`` replaced) is PatchRay's route. The processor keeps its identity (it is the same
  object, its class is swapped for a subclass that differs only in ``__call__``), nothing in diffusers' or
  torch's modules is patched, and every torch call of the processor other than the attention runs at full
  speed: the route costs one Python call per attention call. (The earlier route, a ``TorchFunctionMode`` active
  over the module's forward, passed all ~64 torch calls of a FLUX.1 attention module through Python to find the
  one it reroutes: about 40-55 ms of CPU per FLUX.1 call on an H200 host, where the ranks are launch-bound.)
* **Why not a registered diffusers attention backend.** diffusers' registry (``_AttentionBackendRegistry``) is
  keyed by the members of its ``AttentionBackendName`` enum: a new backend means a new member of a library enum
  and an entry in a process-wide registry, and the processor's ``_attention_backend`` then names it for every
  model that shares the processor class. Its context-parallel hook (``parallel_config``) runs diffusers' own ring
  and Ulysses exchanges on a device mesh, not PatchRay's exchange strategies. The rebound name is local to the
  processors PatchRay adapts.
* **The module's forward still brackets the call.** The attention module keeps a forward wrapper
  (:func:`~.plan.replace_forward`) that sets the :class:`RouteSlot` to the module's route for the length of its
  forward and checks that the processor did call it. One processor object may serve several modules (diffusers'
  ``set_attn_processor`` with one instance): they share one rerouted class; a module the plan does not adapt
  finds the slot empty and gets the original function.
* **Refused before any work.** A processor whose ``__call__`` names neither function (a hand-written softmax, a
  flash/sage kernel called directly) is refused when the plan is applied, with its class and module path; the
  call-time check stays as the backstop for a processor that names the function but skips it.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import re
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["RouteSlot", "reroute_processor", "DISPATCH_NAME"]

logger = logging.getLogger(__name__)

#: the diffusers function every DiT processor of diffusers >= 0.35 calls for its attention
DISPATCH_NAME = "dispatch_attention_fn"
#: the class attribute that marks a rerouted processor class (the value is the original class)
_BASE_ATTR = "_patchray_route_base"


class RouteSlot:
    """The route of the adapted module whose forward is running (``None``: run the original function)."""

    __slots__ = ("route", "calls", "original", "ident")

    def __init__(self, original: Optional[Callable] = None):
        self.route: Optional[Callable] = None
        #: routed calls since the last reset (the modules' forward wrappers check that the route was taken)
        self.calls = 0
        #: the function the route replaces (diffusers' dispatch, or ``F.scaled_dot_product_attention``)
        self.original = original
        #: the slot's key in :data:`_SLOTS` (how the compiled graphs' opaque attention op finds it)
        self.ident = next(_SLOT_IDS)
        _SLOTS[self.ident] = self


_SLOT_IDS = itertools.count()
#: live slots by :attr:`RouteSlot.ident` (one per rerouted processor class)
_SLOTS: Dict[int, RouteSlot] = {}
#: the rerouted class of each processor class, shared by every processor object of that class (see below)
_ROUTED: Dict[type, type] = {}
#: ``id(processor) -> [processor, modules using it]`` for rerouted processor objects
_USERS: Dict[int, List[Any]] = {}


# --------------------------------------------------------------------------------------------------
# the attention call inside a compiled graph


#: the operation's name: one per importing package (the pack may be imported under its folder's name in ComfyUI and
#: as ``patchray`` elsewhere in one process; an operation name can be registered once)
_OP_NAME = "routed_attention_" + re.sub(r"\W", "_", __name__.split(".")[0])


@torch.library.custom_op(f"patchray::{_OP_NAME}", mutates_args=())
def _routed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      scale: Optional[float], backend: Optional[str], layout: str, slot: int) -> torch.Tensor:
    """The routed attention call as one operation a compiled graph keeps opaque (its collectives run eagerly, in
    graph order). ``layout`` ``"BLHD"``: diffusers' dispatch call; ``"BHLD"``: SDPA."""
    s = _SLOTS[slot]
    call: Dict[str, Any] = {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "scale": scale}
    if layout == "BLHD":
        if backend is not None:
            from diffusers.models.attention_dispatch import AttentionBackendName

            call["backend"] = AttentionBackendName(backend)
        else:
            call["backend"] = None
    if s.route is None:
        out = s.original(**call)
    else:
        s.calls += 1
        out = s.route(call, layout, s.original if layout == "BLHD" else None)
    # a custom operation returns a fresh tensor in the layout its fake says (contiguous): diffusers' native
    # dispatch returns a transposed view of SDPA's output
    return out if out.is_contiguous() else out.contiguous()


@_routed_attention.register_fake
def _(query, key, value, attn_mask, scale, backend, layout, slot):
    return query.new_empty(tuple(query.shape[:-1]) + (value.shape[-1],))


def _compiled_call(slot: RouteSlot, call: Dict[str, Any], layout: str) -> torch.Tensor:
    """What the route does under ``torch.compile``: the opaque operation above (a graph break at the attention
    would make the compiler resume inside the processor's rebound ``__call__``, whose globals are not its module's)."""
    if call.get("is_causal") or call.get("dropout_p") or call.get("enable_gqa") or call.get("attention_kwargs") \
            or call.get("parallel_config") is not None:
        raise NotImplementedError("a compiled sequence-parallel attention takes query, key, value, mask, scale and "
                                  "backend only (no causal, dropout, GQA, attention_kwargs or parallel_config)")
    backend = call.get("backend")
    return getattr(torch.ops.patchray, _OP_NAME)(
        call["query"], call["key"], call["value"], call.get("attn_mask"), call.get("scale"),
        None if backend is None else str(getattr(backend, "value", backend)), layout, slot.ident)


class _Functional:
    """``torch.nn.functional`` as a rerouted processor sees it: ``scaled_dot_product_attention`` routed, every
    other name the real one."""

    def __init__(self, sdpa: Callable):
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name: str) -> Any:
        return getattr(F, name)


def _code_names(code: types.CodeType) -> Iterator[str]:
    """Global and attribute names a function's code uses, nested code (comprehensions, closures) included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _route_kind(fn: Callable) -> Optional[str]:
    """``"dispatch"`` / ``"sdpa"``: how ``fn`` reaches its attention (``None``: neither way)."""
    if not isinstance(fn, types.FunctionType):
        return None
    names = set(_code_names(fn.__code__))
    if DISPATCH_NAME in names and callable(fn.__globals__.get(DISPATCH_NAME)):
        return "dispatch"
    if "scaled_dot_product_attention" in names and fn.__globals__.get("F") is F:
        return "sdpa"
    return None


def _rebound(fn: types.FunctionType, name: str, value: Any) -> types.FunctionType:
    """``fn`` with the global ``name`` resolved to ``value`` (same code, defaults, closure).

    Its globals are a copy of its module's namespace held by a module object of their own, registered in
    ``sys.modules`` under a private name: ``torch.compile`` finds a function's globals through the module named by
    their ``__name__`` (to guard on them), so a bare copied dict that kept the library module's name would be
    checked against the library's own, unchanged namespace."""
    home = types.ModuleType("_patchray_route_%d_%s" % (next(_SLOT_IDS), re.sub(r"\W", "_", fn.__module__ or "x")))
    scope = home.__dict__
    for key, item in fn.__globals__.items():
        if key not in ("__name__", "__spec__", "__loader__"):
            scope[key] = item
    scope[name] = value
    sys.modules[home.__name__] = home
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    new.__dict__.update(fn.__dict__)
    return new


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _route(slot: RouteSlot, names: Tuple[str, ...], layout: str) -> Callable:
    """The function a rerouted processor calls in place of ``slot.original``: the slot's route while an adapted
    module's forward runs, the original otherwise, the opaque operation under ``torch.compile``. ``names`` are the
    original's positional parameter names; the route gets diffusers' dispatch (``"BLHD"``) or ``None`` (SDPA)."""
    original = slot.original
    handed = original if layout == "BLHD" else None

    def routed(*args, **kwargs):
        call = dict(zip(names, args))
        call.update(kwargs)
        if torch.compiler.is_compiling():
            return _compiled_call(slot, call, layout)
        route = slot.route
        if route is None:  # a module the plan does not adapt, sharing the processor
            return original(*args, **kwargs)
        slot.calls += 1
        return route(call, layout, handed)

    return routed


def reroute_processor(module, path: str) -> Tuple[RouteSlot, Callable[[], None]]:
    """Reroute the attention call of ``module.processor`` through a :class:`RouteSlot`; return it and the undo.

    The slot's ``route`` (set by the caller around the module's forward) is called as ``route(call, layout,
    dispatch)``: ``call`` the attention call's arguments by name (``query``, ``key``, ``value``, ``attn_mask``, ...),
    ``layout`` ``"BLHD"`` (``dispatch_attention_fn``) or ``"BHLD"`` (``F.scaled_dot_product_attention``), and
    ``dispatch`` diffusers' original function (``None`` for SDPA).

    Raises:
        NotImplementedError: the module has no processor, or its processor's ``__call__`` calls neither function.
    """
    processor = getattr(module, "processor", None)
    if processor is None:
        raise NotImplementedError(f"{path}: {type(module).__name__} has no attention processor; sequence parallelism "
                                  f"reroutes a diffusers processor's attention call")
    cls = type(processor)
    if cls.__dict__.get(_BASE_ATTR) is not None:  # already rerouted (one processor object serving several modules)
        _USERS[id(processor)][1] += 1
        cls._patchray_users += 1
        return cls._patchray_slot, _undo(processor, cls, path)
    routed = _ROUTED.get(cls)
    if routed is None:
        routed = _ROUTED[cls] = _routed_class(cls, path)
    routed._patchray_users += 1
    _USERS[id(processor)] = [processor, 1]
    processor.__class__ = routed
    return routed._patchray_slot, _undo(processor, routed, path)


def _routed_class(cls: type, path: str) -> type:
    """The rerouted subclass of processor class ``cls``: one per class, shared by all its processor objects (and so
    one slot per class: the adapted modules' forwards set it in turn), so that a compiler sees one class and one
    ``__call__`` in every block instead of a new one per module."""
    fn = getattr(cls, "__call__", None)
    kind = _route_kind(fn)
    if kind is None:
        raise NotImplementedError(
            f"{path}: its attention processor {cls.__name__} computes attention without diffusers' "
            f"{DISPATCH_NAME} or F.scaled_dot_product_attention (a hand-written or flash/sage kernel called "
            f"directly); sequence parallelism needs a processor that calls one of them (diffusers' own processors, "
            f"on the native backend or another registered one)"
        )
    if kind == "dispatch":
        slot = RouteSlot(fn.__globals__[DISPATCH_NAME])
        call = _rebound(fn, DISPATCH_NAME, _route(slot, tuple(inspect.signature(slot.original).parameters), "BLHD"))
    else:
        slot = RouteSlot(F.scaled_dot_product_attention)
        call = _rebound(fn, "F", _Functional(_route(slot, _SDPA_ARGS, "BHLD")))
    namespace = {"__call__": call, "__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__doc__": cls.__doc__, _BASE_ATTR: cls, "_patchray_slot": slot, "_patchray_users": 0}
    return type(cls)(cls.__name__, (cls,), namespace)


def _undo(processor, routed: type, path: str) -> Callable[[], None]:
    done = [False]

    def undo():
        if done[0]:
            return
        done[0] = True
        routed._patchray_users -= 1
        if not routed._patchray_users and _ROUTED.get(routed.__dict__[_BASE_ATTR]) is routed:
            del _ROUTED[routed.__dict__[_BASE_ATTR]]
            _SLOTS.pop(routed._patchray_slot.ident, None)
            sys.modules.pop(routed.__dict__["__call__"].__globals__["__name__"], None)
        users = _USERS.get(id(processor))
        if users is None or users[0] is not processor:
            return
        users[1] -= 1
        if users[1]:
            return
        del _USERS[id(processor)]
        if type(processor) is not routed:
            # someone changed the processor's class after us: putting the original back would undo theirs
            logger.warning("%s: its attention processor's class was changed after PatchRay rerouted it; left as it is", path)
            return
        processor.__class__ = routed.__dict__[_BASE_ATTR]

    return undo
