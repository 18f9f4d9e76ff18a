"""The accounting records of PatchRay's communication: what was called, how often, with how many bytes.

Design decision: these are plain data and arithmetic (no ``torch.distributed``), split from the comm modules so
those that talk to ``torch.distributed`` hold only the calls (:mod:`.comm`) and the one interception layer that fills
these records (:mod:`.comm_intercept`). The counting rules (which operations count, what a *batched* call is, which bytes count) are written
down in ``docs/benchmark.md``; :mod:`.comm` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, NamedTuple

import torch

__all__ = ["COUNTED_OPS", "CommLog", "CommCall", "CommHook", "tensor_bytes"]

COUNTED_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "isend",
    "irecv",
    "send",
    "recv",
    "barrier",
    "batch_isend_irecv",
    # PatchRay gathers outputs to the caller only, with gather
    "gather",
    # Ulysses sequence parallelism (DiTs): sequence-sharded heads <-> head-sharded sequence
    "all_to_all_single",
)

_C10D_MODULE = "torch.distributed.distributed_c10d"

#: operations logged under another operation's name: the flat all-gather (one output buffer) is an all-gather with
#: the same bytes on the wire as the list form, and PatchRay uses whichever the shapes allow
LOGGED_AS = {"all_gather_into_tensor": "all_gather"}


@dataclass
class CommLog:
    """Calls and tensor bytes per operation, for one rank.

    ``calls[op]`` counts API calls; ``batched_calls[op]`` counts calls made from inside
    ``distributed_c10d`` (they add bytes but not calls); ``bytes[op]`` sums both.
    """

    calls: Dict[str, int] = field(default_factory=dict)
    batched_calls: Dict[str, int] = field(default_factory=dict)
    bytes: Dict[str, int] = field(default_factory=dict)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def record(self, op: str, nbytes: int, batched: bool) -> None:
        op = LOGGED_AS.get(op, op)
        target = self.batched_calls if batched else self.calls
        target[op] = target.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + nbytes

    def to_dict(self) -> dict:
        return {
            "total_calls": self.total_calls,
            "total_bytes": self.total_bytes,
            "calls": dict(sorted(self.calls.items())),
            "batched_calls": dict(sorted(self.batched_calls.items())),
            "bytes": dict(sorted(self.bytes.items())),
        }


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or nested lists/tuples of them); anything else counts 0."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        # a P2POp list (batch_isend_irecv) is no tensor buffer: its sends and receives count as batched calls
        return sum(tensor_bytes(o) for o in obj)
    return 0


class CommCall(NamedTuple):
    """One intercepted ``torch.distributed`` call, as the hooks see it.

    Args:
        op: the operation's name (one of :data:`COUNTED_OPS`).
        args, kwargs: what the caller passed.
        batched: made from inside ``distributed_c10d`` (part of a batch or of an object collective).
    """

    op: str
    args: tuple
    kwargs: dict
    batched: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the positional tensor buffers (keyword tensors, like ``gather_list``, do not count)."""
        return sum(tensor_bytes(a) for a in self.args)


#: a hook: ``hook(call, proceed)`` runs ``proceed()`` (the real call, or the next hook) and returns its result
CommHook = Callable[[CommCall, Callable[[], Any]], Any]
