"""What a ComfyUI user sees when the ranks fail: the message alone, with the rank; the full trace goes to the log.

An exception raised on a rank reaches the driver through Ray, which wraps it: ``RayTaskError(ValueError)`` as the
type, and as the text the actor's id and address, the rank process's traceback and ANSI colour codes for a
terminal. ComfyUI shows an exception's type and text in its error dialog, so all of that would land there.

Design decision: the library (``distributed.cluster``) reports rank failures as :class:`RankFailure` naming the
rank and the original exception; the bridge still cleans every exception that leaves a node, defensively and in
one place (:func:`user_message`), so the dialog never depends on how Ray formats a given version's errors. The
cleaned exception is raised *from* the original, so ComfyUI's console log (which prints the whole chain) keeps the
full trace. Exceptions that do not come from Ray or the cluster (ComfyUI's own interrupt above all) pass through
untouched.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

__all__ = ["user_message", "for_user", "rank_errors_for_user", "model_name"]

# CSI escape sequences (colours, cursor moves) that Ray puts around the task name
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
# Ray's task header: "ray::_RankActor.call() (pid=123, ip=127.0.0.1, actor_id=..., repr=<...>)"
_RAY_HEADER = re.compile(r"ray::[\w.<>]+\(\)[^\n]*")
# Ray's wrapper type named in a message: "RayTaskError(ValueError): "; the original type follows again below it
_RAY_TYPE = re.compile(r"RayTaskError\(\w+\):[ \t]*")
# process details Ray appends to actor errors: "(pid=123, ip=..., actor_id=...)"
_RAY_PROCESS = re.compile(r"[ \t]*\((?:pid|ip|actor_id|repr)=[^)]*\)")
# Ray's process details written out as fields: "actor_id: 3f2a...", "Worker ID: ...", "ActorID(3f2a...)"
_RAY_IDS = re.compile(r"\b(?:actor_id|actor id|worker_id|worker id|node_id|node id|job_id|task_id)[:=]\s*[0-9a-f]{8,}\b[,;]?\s*|"
                      r"\b(?:ActorID|WorkerID|NodeID|TaskID|JobID)\([0-9a-f]+\)\s*|"
                      r"\b(?:class_name: _RankActor|pid: \d+|namespace: patchray)\b[,;]?\s*", re.IGNORECASE)
# the folders the rank processes import the pack from (a temporary link, Ray's session folders): the user knows
# the pack as "patchray/...", not as "/tmp/patchray-import-0/patchray/..." or ".../runtime_resources/.../patchray/..."
_TEMP_IMPORT = re.compile(r"(?:[A-Za-z]:)?[^\s\"'(]*?(?:patchray-import-\w+|session_[\w-]+|runtime_resources)[/\\](?:[^\s\"']*?[/\\])?(patchray[/\\])")
_TRACE_LINE = re.compile(r"^\s*(Traceback \(most recent call last\):|[\^~\s]+)$")
_FRAME_LINE = re.compile(r'^\s+File "[^"]*", line \d+')
_WRAPPED = ("RayError", "RayTaskError", "RayActorError", "RankFailure", "ClusterSetupError", "SamplingDesync")


def _clean_text(text: str) -> str:
    text = _ANSI.sub("", text)
    text = _RAY_HEADER.sub("", text)
    text = _RAY_TYPE.sub("", text)
    text = _RAY_PROCESS.sub("", text)
    text = _RAY_IDS.sub("", text)
    text = _TEMP_IMPORT.sub(r"\1", text)
    kept, skip_code = [], False
    for line in text.splitlines():
        if _FRAME_LINE.match(line):
            skip_code = True  # the next indented line is the frame's source line
            continue
        if skip_code and line.startswith("    "):
            skip_code = False
            continue
        skip_code = False
        if _TRACE_LINE.match(line):
            continue
        kept.append(line.strip())
    # "rank 1 raised while calling f: " + (the trace that stood here) + "RuntimeError: boom" -> one line
    out = re.sub(r":\s*\n\s*", ": ", "\n".join(kept).strip())
    # the wrapper's own "T: " and the original line "T: msg" may now stand side by side
    return re.sub(r"\b(\w+(?:Error|Exception|Interrupt)): \1: ", r"\1: ", out)


def _ray_cause(exc: BaseException) -> BaseException:
    """The rank's own exception inside Ray's ``RayTaskError`` (Ray keeps it as ``.cause``)."""
    seen = set()
    while type(exc).__name__.startswith("RayTaskError") and getattr(exc, "cause", None) is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.cause
    return exc


def _is_wrapped(exc: BaseException) -> bool:
    names = {k.__name__ for k in type(exc).__mro__}
    text = str(exc)
    return bool(names & set(_WRAPPED)) or "\x1b[" in text or "ray::" in text


def user_message(exc: BaseException) -> str:
    """The text a user should read for ``exc``: no ANSI codes, no Ray wrapping, no traceback.

    A Ray-wrapped rank exception becomes its own message (``RayTaskError(ValueError)`` -> the ValueError's text);
    a :class:`RankFailure` keeps its "rank N ..." context with the original type and message.

    Example:
        >>> user_message(ValueError("\\x1b[36mray::_RankActor.call()\\x1b[39m (pid=1, ip=127.0.0.1)\\nValueError: bad"))
        'ValueError: bad'
    """
    cause = _ray_cause(exc)
    if type(cause).__name__ == "OutOfMemoryError" and type(cause).__module__.startswith("ray"):
        return _ray_oom_message(str(cause))
    return _clean_text(str(cause))


_RAY_OOM_USAGE = re.compile(r"was ([\d.]+\s*GB used / [\d.]+\s*GB limit)")


def _ray_oom_message(text: str) -> str:
    """Ray's memory monitor stopped a rank: its 40-line report (process table, object store counters, tuning
    variables) becomes one sentence with the figure and what to change; the full report stays in the log."""
    usage = _RAY_OOM_USAGE.search(text)
    figure = f" ({usage.group(1)})" if usage else ""
    return (
        f"Ray stopped a rank because the machine ran out of memory{figure}: lower the latent's size or batch_size, use "
        "fewer CPU ranks, or close other programs; the ranks are rebuilt on the next prompt"
    )


def for_user(exc: BaseException) -> BaseException:
    """An exception to raise to ComfyUI in place of ``exc``: the same kind, its text cleaned by :func:`user_message`.

    ``RankFailure`` stays a ``RankFailure`` (same ranks); a rank's own exception (``ValueError``, ``TypeError``,
    ``NotImplementedError``...) comes back as its own type; one that cannot be rebuilt from a message, or Ray's own
    error, as ``RuntimeError``.
    """
    from ...distributed.cluster import RankFailure

    original = _ray_cause(exc)
    message = user_message(exc)
    if isinstance(exc, RankFailure):
        return RankFailure(message, exc.ranks, exc.cause)
    kind = type(original)
    if not kind.__name__.startswith("Ray"):
        try:
            return kind(message)
        except Exception:  # a class that takes other arguments: fall through
            pass
    return RuntimeError(message)


@contextlib.contextmanager
def rank_errors_for_user() -> Iterator[None]:
    """Re-raise errors that come from the ranks (Ray, the cluster) as :func:`for_user` exceptions, chained.

    Everything else, ComfyUI's interrupt included, propagates unchanged.

    A prompt that failed on the ranks also drops what the ranks cached (models, weights): the failed prompt will not
    use them, and idle ranks should not hold memory until some next prompt (that one ships them again). A failure
    that stopped the ranks freed everything already; a refusal the ranks raised (``exc.rank`` set) left them up.
    """
    try:
        yield
    except Exception as exc:
        from_ranks = _is_wrapped(exc) or hasattr(exc, "rank")
        if from_ranks:
            _free_after_failure()
        if not _is_wrapped(exc):
            raise
        raise for_user(exc) from exc


def _free_after_failure() -> None:
    try:
        from ...distributed.cluster import free_rank_caches

        free_rank_caches(timeout_s=5.0)
    except Exception:  # never hide the prompt's own error behind a cleanup error
        pass


def model_name(model) -> str:
    """A ComfyUI MODEL as users know it: ComfyUI's model family (its ``model_config`` class: ``SDXL``, ``SD3``,
    ``Flux``, ``WAN21_T2V``...), not the network's class (``OpenAISignatureMMDITWrapper``); the latter only when the
    family is unknown."""
    inner = getattr(model, "model", None)
    config = getattr(inner, "model_config", None)
    if config is not None and type(config).__name__ not in ("object", "BASE"):
        return type(config).__name__
    network = getattr(inner, "diffusion_model", None)
    return type(network).__name__ if network is not None else type(model).__name__
