"""Weights in transit from the driver to the ranks: numpy arrays in Ray's shared-memory store, viewed, not copied.

Design decision: a state dict of torch tensors put into Ray is pickled, and every rank that gets it unpickles a
private copy (N ranks on one machine: N full copies in host memory, plus the store's). A numpy array is stored once
in Ray's shared-memory object store and ``ray.get`` on the same node returns a read-only view of it, so the ranks of
one machine share one host copy; a rank that shards the weights copies only its 1/N of each block out of the view,
and a whole copy is made only where a rank keeps the whole model in host memory. dtypes numpy lacks (bfloat16,
the float8 types) travel as integers of the same width and are viewed back, bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Dict, Tuple

import numpy as np
import torch

__all__ = ["to_arrays", "from_arrays"]

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))
#: dtypes numpy lacks: they travel as same-width integers and are viewed back on the rank
_WIRE = {torch.bfloat16: torch.int16, **{t: torch.uint8 for t in _FP8}}


def to_arrays(weights: Dict[str, torch.Tensor]) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """``(arrays, views)``: the weights as numpy arrays (zero-copy views of contiguous CPU tensors; others are copied
    to the host once) and, for dtypes numpy lacks, the torch dtype name to view each back in."""
    arrays, views = {}, {}
    for k, t in weights.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        wire = _WIRE.get(t.dtype)
        if wire is not None:
            views[k] = str(t.dtype).replace("torch.", "")
            t = t.view(wire)
        arrays[k] = t.contiguous().numpy()
    return arrays, views


def from_arrays(arrays: Dict[str, np.ndarray], views: Dict[str, str], *, copy: bool) -> Dict[str, torch.Tensor]:
    """Tensors over :func:`to_arrays`' arrays: views of them (read-only when they come from Ray's store: for weights
    that are copied out before anything writes, e.g. sharded blocks) or private copies with ``copy``."""
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for k, a in arrays.items():
            t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
            if k in views:
                t = t.view(getattr(torch, views[k]))
            out[k] = t.clone() if copy else t
    return out
