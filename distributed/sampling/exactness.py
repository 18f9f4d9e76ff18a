"""The runtime exactness check: a mode whose correctness rests on another project's model internals is compared, on the
ranks, against the same call run whole, before it is trusted; the verdict is kept on disk.

Why at run time: a split along the sequence is exact only while PatchRay's table (where the image and text tokens sit,
where the rotary table is cut, where the tokens are gathered) matches the model class as the host application builds
it. A newer host version can move a token or change a layout with every length still matching, and the split would
then compute a wrong image with no error. Tests pin the versions PatchRay was checked on; this check covers the one a
user runs.

Design decisions:

* **One small call, both ways, on the run's own inputs.** The caller runs one sampling step on a small crop of the
  run's latent, once on the whole model and once split, and hands both results here. Every rank compares its own
  pair; the ranks agree on the largest error (one tiny all-gather), so every rank takes the same branch.
* **A bound per compute dtype** (:data:`BOUNDS`). An exact split only reorders sums (attention over gathered keys in
  another order, GEMMs over fewer rows); its error after one step sits at the dtype's rounding. A wrong layout moves
  tokens against their positions or another token's rotary angles and gives an error of order one. The bounds sit
  between the two with a margin on each side (figures in :data:`BOUNDS`).
* **Verdicts are keyed by everything that can change them** (:func:`verdict_key`: the model class, the host's version,
  PatchRay's version, the mode) and kept in one JSON file (:class:`VerdictCache`), so the check runs once per key and
  a new version of either program checks again. ``python -m patchray exactness --list / --clear`` shows or forgets
  them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import NamedTuple, Optional

import torch

__all__ = ["BOUNDS", "ExactnessMismatch", "Verdict", "VerdictCache", "bound_for", "relative_error", "agreed_error",
           "agreed_flag", "verdict_key", "cache_dir", "JsonFileCache", "main"]

#: relative L2 bound of a split call against the whole call after one step, by compute dtype. fp32: a split reorders
#: sums only, measured at 1e-7..1e-6 on the table's random-weight models (tests/comfyui), so 1e-4 leaves two orders of
#: margin, while a misplaced text block or rotary cut measured > 1e-2. bf16 / fp16: the same reorders round at the
#: dtype's epsilon (7.8e-3 / 9.8e-4) in every layer; 5e-2 / 1e-2 sit above that for shallow models, but a deep model's
#: rounding reaches a wrong layout's error (bf16 Wan 2.1 14B, random weights: 4.6e-2), so checks compute in fp32
#: wherever the model can, and use the bf16 / fp16 bounds only where it cannot.
BOUNDS = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class ExactnessMismatch(NotImplementedError):
    """The split call and the whole call disagree beyond the dtype's bound: the mode is refused for this model."""


class Verdict(NamedTuple):
    """One check's outcome."""

    ok: bool
    error: float
    bound: float
    seconds: float
    peak_bytes: int = 0
    when: float = 0.0


def bound_for(dtype: torch.dtype) -> float:
    """The bound for a call computed in ``dtype`` (fp32's for dtypes not listed, e.g. fp8 weights cast to fp32)."""
    return BOUNDS.get(dtype, BOUNDS[torch.float32])


def relative_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``inf`` when the shapes differ or the result is not finite)."""
    if ref.shape != out.shape:
        return float("inf")
    a, b = ref.detach().double().cpu(), out.detach().double().cpu()
    scale = a.norm().item()
    err = (b - a).norm().item() / (scale if scale > 0 else 1.0)
    return err if err == err else float("inf")


def agreed_error(ctx, err: float) -> float:
    """The largest ``err`` over ``ctx``'s ranks (every rank gets the same figure, so every rank decides alike)."""
    if ctx.world_size == 1:
        return float(err)
    from .. import comm

    t = torch.tensor([[float(err) if err == err else float("inf")]], dtype=torch.float64, device=ctx.device)
    return float(comm.all_gather_padded(t, ctx, dim=0, sizes=[1] * ctx.world_size).max().item())


def agreed_flag(ctx, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank of ``ctx`` (one tiny all-gather)."""
    return agreed_error(ctx, 1.0 if flag else 0.0) > 0.0


def verdict_key(model_class: str, host_version: str, patchray_version: str, mode: str) -> str:
    """The cache key of a check: the verdict holds only while none of these changes."""
    return f"{model_class}|{host_version}|{patchray_version}|{mode}"


def cache_dir() -> Path:
    """``$PATCHRAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/patchray``, else ``~/.cache/patchray``."""
    explicit = os.environ.get("PATCHRAY_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "patchray"


class JsonFileCache:
    """Records keyed by strings in one JSON file (``NAME`` in :func:`cache_dir`). Reads are tolerant: a missing or
    unreadable file is an empty cache (what it held is measured or checked again); writes replace the file
    atomically. Subclasses type the records (:class:`VerdictCache`, ``bench.auto_plan.ProbeCache``)."""

    NAME = "cache.json"

    def __init__(self, folder: Optional[Path] = None):
        self.path = Path(folder or cache_dir()) / self.NAME

    def load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _raw(self, key: str) -> Optional[dict]:
        raw = self.load().get(key)
        return raw if isinstance(raw, dict) else None

    def _write(self, key: str, record: dict) -> None:
        data = self.load()
        data[key] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def clear(self) -> int:
        """Forget every record; returns how many there were."""
        n = len(self.load())
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        return n


class VerdictCache(JsonFileCache):
    """The checks' verdicts (``exactness.json``): a missing or unreadable one means the check runs again."""

    NAME = "exactness.json"

    def get(self, key: str) -> Optional[Verdict]:
        raw = self._raw(key)
        if raw is None:
            return None
        try:
            return Verdict(**{k: raw[k] for k in Verdict._fields if k in raw})
        except TypeError:
            return None

    def put(self, key: str, verdict: Verdict) -> None:
        self._write(key, verdict._asdict())


def now() -> float:
    return time.time()


def main(argv=None) -> int:
    """``python -m patchray exactness [--list | --clear]``: the runtime exactness check's verdicts."""
    import argparse

    p = argparse.ArgumentParser(prog="patchray exactness", description=main.__doc__)
    p.add_argument("--clear", action="store_true", help="forget every verdict (each mode is checked again on first use)")
    args = p.parse_args(argv)
    cache = VerdictCache()
    if args.clear:
        print(f"forgot {cache.clear()} verdict(s) in {cache.path}")
        return 0
    data = cache.load()
    print(f"{len(data)} verdict(s) in {cache.path}")
    for key, v in sorted(data.items()):
        model, host, ours, mode = (key.split("|") + ["?"] * 4)[:4]
        state = "exact" if v.get("ok") else "REFUSED"
        print(f"  {state:8s} {model} {mode} (host {host}, PatchRay {ours}): relative error {v.get('error', float('nan')):.2e} "
              f"<= {v.get('bound', float('nan')):.0e}? checked in {v.get('seconds', 0):.2f} s")
    return 0
