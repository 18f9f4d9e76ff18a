"""The one interception layer of PatchRay's communication: count, throttle and time ``torch.distributed`` calls.

Design decisions:

* **Part of comm, in its own file.** :mod:`.comm` is the door every other module uses (it re-exports every name
  here); this file holds only the patcher, because it is a different job from making calls: it replaces public
  ``torch.distributed`` functions for the length of a ``with`` block. It is one of the three comm modules the
  structure test (tests/distributed/test_structure.py) lets use ``torch.distributed``, and only :mod:`.comm`
  imports it.
* **Hooks on one patcher.** Counting (:func:`log_comm`), the benchmark's link throttle and its timer of
  communication are *hooks* on one patcher (:func:`intercept`): while at least one hook is installed, the public
  ``torch.distributed`` operations in :data:`COUNTED_OPS` are replaced by one wrapper that hands each call, as a
  :class:`CommCall`, through the hooks (the first installed runs innermost, next to the real call); when none
  is installed nothing is wrapped, so interception costs nothing when off. A call made from inside PyTorch's
  ``distributed_c10d`` module (the sends inside ``batch_isend_irecv``, the tensor collectives inside
  ``all_gather_object``) is marked *batched*: counting adds its tensor bytes but not a call, and the throttle
  and the timer leave it to the top-level call that contains it. The records themselves (:class:`CommLog`,
  :class:`CommCall`) are plain data in :mod:`.accounting`; the counting rules are written down in
  ``docs/benchmark.md``.
* **Why not ``torch.distributed.tensor.debug.CommDebugMode``.** It was tried (torch 2.13, two gloo ranks): it
  is a ``TorchDispatchMode``, so it sees ``c10d.allreduce_``, ``c10d.allgather_`` and ``c10d.gather_`` at the
  dispatcher, but not ``batch_isend_irecv``'s sends and receives nor ``barrier``, and it cannot tell the user's
  ``all_gather`` from the ones ``all_gather_object`` makes inside (it counted three where the rules count one
  call and two batched). Every aten operation would also pass through Python while it is on, which would bill
  the timed compute for the dispatch. The counting rules need the public API call and its caller, so the
  layer wraps the public functions.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Dict, Iterator, List

import torch.distributed as dist

from .accounting import _C10D_MODULE, COUNTED_OPS, CommCall, CommHook, CommLog

__all__ = ["intercept", "log_comm", "unwrapped"]

#: the attribute under which a wrapper keeps the function it replaced (:func:`unwrapped` reads it)
_WRAPPED_ATTR = "__patchray_wrapped__"

_hooks: List[CommHook] = []
_patch_lock = threading.Lock()
_originals: Dict[str, object] = {}


def _make_wrapper(op: str, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        call = CommCall(op, args, kwargs, caller == _C10D_MODULE)
        proceed = functools.partial(original, *args, **kwargs)
        for hook in tuple(_hooks):  # the first installed is innermost
            proceed = functools.partial(hook, call, proceed)
        return proceed()

    setattr(wrapper, _WRAPPED_ATTR, original)
    return wrapper


def _install():
    import torch.distributed.distributed_c10d as c10d

    for op in COUNTED_OPS:
        original = getattr(c10d, op)
        _originals[op] = original
        wrapped = _make_wrapper(op, original)
        setattr(c10d, op, wrapped)
        setattr(dist, op, wrapped)


def _uninstall():
    import torch.distributed.distributed_c10d as c10d

    for op, original in _originals.items():
        setattr(c10d, op, original)
        setattr(dist, op, original)
    _originals.clear()


def unwrapped(fn):
    """``fn`` itself, or the ``torch.distributed`` function it wraps while a hook is installed (for the calls that
    must bypass the hooks, e.g. :func:`.comm.uncounted_barrier`)."""
    return getattr(fn, _WRAPPED_ATTR, fn)


@contextlib.contextmanager
def intercept(hook: CommHook) -> Iterator[None]:
    """Pass every call of :data:`COUNTED_OPS` made in this process through ``hook`` while the block runs.

    Hooks nest: one installed inside another's block runs outside it (it sees the inner hook's effect, e.g. a
    timer installed after the throttle bills the throttle's sleep to communication).
    """
    with _patch_lock:
        if not _hooks:
            _install()
        _hooks.append(hook)
    try:
        yield
    finally:
        with _patch_lock:
            _hooks.remove(hook)
            if not _hooks:
                _uninstall()


@contextlib.contextmanager
def log_comm() -> Iterator[CommLog]:
    """Count ``torch.distributed`` calls and bytes made inside the block (this process only).

    Example:
        >>> with log_comm() as log:
        ...     pass  # run one decode
        >>> log.total_calls
        0
    """
    log = CommLog()

    def count(call: CommCall, proceed):
        log.record(call.op, call.nbytes, call.batched)
        return proceed()

    with intercept(count):
        yield log
