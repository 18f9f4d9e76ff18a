"""The cluster's errors, and how a rank's exception becomes one clean message for the user.

Design decisions:

* **The user reads the rank, the original type and the original message; nothing of Ray's wrapping.** Ray
  delivers a rank's exception as ``RayTaskError(ValueError)``, whose text holds ANSI colour codes, actor ids,
  process ids and the rank's import paths. :func:`describe_rank_error` reduces it to ``ValueError: <message>``
  and keeps the full trace (colour codes removed) for the log and for :attr:`RankFailure.trace`.
* **The root cause first.** When one rank fails, its peers often fail after it: their collectives time out or
  lose the connection. Those are consequences, raised from inside ``torch.distributed``
  (:func:`is_communication_error`), and they can reach the driver before the root cause does. The message
  names the first error that is not such a consequence, then the ranks left waiting and the ranks that
  failed after it.
"""

from __future__ import annotations

import re
from typing import List, NamedTuple, Optional, Sequence

__all__ = [
    "ClusterSetupError",
    "RankFailure",
    "RankError",
    "caused_by",
    "describe_rank_error",
    "is_communication_error",
    "strip_ansi",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text)


class ClusterSetupError(RuntimeError):
    """The cluster could not be formed: Ray unreachable or of another version, too few resources, nodes whose
    PatchRay/torch/diffusers differ, or a rendezvous that did not complete. The message says what to fix."""


class RankFailure(RuntimeError):
    """A rank died, raised, hung or was interrupted during a call.

    ``str(exc)`` names the rank that failed first and its original exception (``rank 2 raised ValueError: ...``);
    ``ranks`` lists that rank first, then the others involved; ``cause`` is the original exception (when it could
    be rebuilt on the driver); ``trace`` holds the full trace(s) from the ranks, also written to the log.
    """

    def __init__(self, message: str, ranks: Sequence[int] = (), cause: Optional[BaseException] = None, trace: str = ""):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.cause = cause
        self.trace = trace


class RankError(NamedTuple):
    """One rank's exception, reduced to what the user needs, plus the full trace for the log."""

    rank: int
    summary: str  #: what happened, after "rank N": ``"raised ValueError: <message>"``, ``"died: ..."``
    cause: Optional[BaseException]  #: the original exception object, when Ray could rebuild it here
    trace: str  #: the rank's traceback without colour codes ("" when Ray gave none)
    communication: bool  #: raised from inside torch.distributed: usually a consequence of another rank's failure


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in strip_ansi(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def describe_rank_error(rank: int, exc: BaseException) -> RankError:
    """Reduce what ``ray.get`` raised for ``rank`` (a ``RayTaskError``, an actor death, ...) to a :class:`RankError`."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        trace = _task_trace(exc)
        if isinstance(cause, BaseException) and not isinstance(cause, RayTaskError):
            summary = f"raised {type(cause).__name__}: {cause}"
        else:  # the exception could not be rebuilt here: its last trace line still names its type and message
            cause, summary = None, f"raised {_last_line(trace) or type(exc).__name__}"
        return RankError(rank, summary, cause, trace, _raised_in_torch_distributed(cause, trace))
    if isinstance(exc, RayActorError):
        text = strip_ansi(getattr(exc, "error_msg", "") or str(exc))
        if getattr(exc, "actor_init_failed", False):
            # its creation failed (e.g. the node cannot import patchray): the last line is the exception
            summary = f"could not start: {_last_line(text)}"
        else:
            summary = "died: its process exited or was killed before finishing"
        return RankError(rank, summary, None, text, False)
    return RankError(rank, f"raised {type(exc).__name__}: {strip_ansi(str(exc))}", exc, "", isinstance(exc, _dist_error_types()))


def _task_trace(exc: BaseException) -> str:
    """The rank's traceback from a ``RayTaskError``: Ray's text without colour codes and its ``ray::...`` headline."""
    text = strip_ansi(getattr(exc, "traceback_str", None) or str(exc)).strip("\n")
    lines = text.splitlines()
    if lines and lines[0].lstrip().startswith("ray::"):
        lines = lines[1:]  # "ray::_RankActor.call() (pid=..., ip=..., actor_id=..., repr=...)"
    if lines and not lines[0].startswith("Traceback"):
        lines.insert(0, "Traceback (most recent call last):")
    return "\n".join(lines)


def _dist_error_types() -> tuple:
    from .. import comm

    return comm.comm_error_types()


def _raised_in_torch_distributed(cause: Optional[BaseException], trace: str) -> bool:
    if cause is not None and _dist_error_types() and isinstance(cause, _dist_error_types()):
        return True
    frames = re.findall(r'File "([^"]+)"', trace)
    return bool(frames) and ("torch/distributed/" in frames[-1].replace("\\", "/"))


def root_cause(errors: Sequence[RankError]) -> RankError:
    """The first error (in arrival order) that is not a communication consequence; else the first one."""
    for err in errors:
        if not err.communication:
            return err
    return errors[0]


def failure_message(errors: Sequence[RankError], what: str, waiting: Sequence[int] = ()) -> str:
    """``rank R raised T: msg (while <what>); ranks [...] were left waiting; ranks [...] failed after it``."""
    root = root_cause(errors)
    parts = [f"rank {root.rank} {root.summary} (while {what})"]
    if waiting:
        parts.append(f"ranks {sorted(waiting)} were left waiting")
    others = sorted(e.rank for e in errors if e is not root)
    if others:
        parts.append(f"ranks {others} failed after it")
    return "; ".join(parts)


def all_traces(errors: Sequence[RankError]) -> str:
    return "\n".join(f"--- rank {e.rank}: {e.summary}\n{e.trace}".rstrip() for e in errors)


def involved_ranks(errors: Sequence[RankError], waiting: Sequence[int] = ()) -> List[int]:
    root = root_cause(errors)
    rest = sorted({e.rank for e in errors if e is not root} | set(waiting))
    return [root.rank] + [r for r in rest if r != root.rank]


def caused_by(exc: Optional[BaseException], cls: type) -> bool:
    """Whether ``exc`` or a cause in its chain is a ``cls``, also across Ray (a rank's exception arrives as
    ``RayTaskError(cls)``, a subclass named after it, or as :class:`RankFailure`'s ``cause``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, cls) or cls.__name__ in type(exc).__name__:
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False
