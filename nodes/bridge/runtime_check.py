"""The driver's side of the runtime exactness check: which verdict a run needs, what the user reads about it.

The ranks run the check (:func:`.ksampler_rank.verify_sequence`); this module keys it by what can change the verdict
(the diffusion model's class, the running ComfyUI's version, PatchRay's version, the mode), keeps the verdicts on disk
(``distributed/sampling/exactness.py``'s :class:`VerdictCache`), refuses a mode whose verdict is a mismatch before
any rank starts, and words the outcome for the node's panel.
"""

from __future__ import annotations

import logging
import re
from typing import Optional, Tuple

__all__ = ["VERIFIED_COMFYUI", "newer_comfyui_note", "comfy_version", "patchray_version", "key_for", "cached_verdict", "record", "refusal", "record_mismatch",
           "line"]

log = logging.getLogger(__name__)

#: the newest ComfyUI this PatchRay was verified on (its opt-in suite run against it); pyproject.toml's
#: ``requires-comfyui`` is the oldest
VERIFIED_COMFYUI = "0.3.64"
_said_newer = []


def _release(version: str) -> tuple:
    parts = []
    for p in version.split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def newer_comfyui_note() -> Optional[str]:
    """Once per process: a note when the running ComfyUI is newer than :data:`VERIFIED_COMFYUI` (``None`` otherwise,
    and every time after the first)."""
    running = comfy_version()
    if _said_newer or running == "unknown" or _release(running) <= _release(VERIFIED_COMFYUI):
        return None
    _said_newer.append(running)
    return (f"ComfyUI {running} is newer than the newest version PatchRay {patchray_version()} was verified on "
            f"({VERIFIED_COMFYUI}): the runtime exactness check compares each model class's split with the whole model "
            "on first use and refuses a split that differs")


def comfy_version() -> str:
    """The running ComfyUI's version (``comfyui_version.__version__``; "unknown" when it cannot be read)."""
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except Exception:  # a ComfyUI without the file: checked every run under "unknown" rather than trusted
        return "unknown"


def patchray_version() -> str:
    from ... import __version__

    return str(__version__)


def key_for(model_class: str, mode: str) -> str:
    from ...distributed.sampling.exactness import verdict_key

    return verdict_key(model_class, comfy_version(), patchray_version(), mode)


def cached_verdict(model_class: str, mode: str) -> Tuple[str, Optional[object]]:
    """``(key, verdict or None)`` for ``model_class`` under ``mode`` in the running versions."""
    from ...distributed.sampling.exactness import VerdictCache

    key = key_for(model_class, mode)
    return key, VerdictCache().get(key)


def refusal(model_class: str, mode: str, verdict) -> NotImplementedError:
    """The error for a mode whose check failed: the class, the ComfyUI version, the modes that still work."""
    return NotImplementedError(
        f"PatchRay: {mode.split('/')[0]} parallelism is refused for {model_class} on ComfyUI {comfy_version()}: PatchRay's "
        f"exactness check found the split differs from the whole model (relative error {verdict.error:.2e}, bound "
        f"{verdict.bound:.0e}), so this ComfyUI builds {model_class} in a way PatchRay {patchray_version()} does not know. "
        "parallelism cfg or batch (they do not depend on the model's internals) work; `python -m patchray exactness "
        "--clear` checks again")


def record(key: str, info: dict) -> object:
    """Keep a passed check's verdict; returns it."""
    from ...distributed.sampling.exactness import Verdict, VerdictCache, now

    verdict = Verdict(ok=True, error=float(info["error"]), bound=float(info["bound"]), seconds=float(info["seconds"]),
                      peak_bytes=int(info.get("peak_bytes", 0)), when=now())
    VerdictCache().put(key, verdict)
    return verdict


def record_mismatch(key: str, message: str) -> object:
    """Keep a failed check's verdict, its figures read from the ranks' message; returns it."""
    from ...distributed.sampling.exactness import Verdict, VerdictCache, now

    found = re.search(r"relative error ([0-9.e+-]+|inf|nan) > bound ([0-9.e+-]+)", message)
    error, bound = (float(found.group(1)), float(found.group(2))) if found else (float("inf"), 0.0)
    verdict = Verdict(ok=False, error=error, bound=bound, seconds=0.0, when=now())
    VerdictCache().put(key, verdict)
    return verdict


def line(model_class: str, mode: str, verdict, fresh: bool) -> str:
    """The node's line about the check."""
    how = (f"checked now in {verdict.seconds:.2f} s" + (f", peak {verdict.peak_bytes / 2**30:.2f} GiB on a rank" if verdict.peak_bytes else "")
           if fresh else "verified earlier (cached)")
    return (f"exactness check: {mode.split('/')[0]} on {model_class} (ComfyUI {comfy_version()}) equals the whole model, "
            f"relative error {verdict.error:.1e} <= {verdict.bound:.0e}; {how}")
