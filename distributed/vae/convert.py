"""The library's VAE input format, checked: a diffusers config and a diffusers-layout state dict.

Design decision: PatchRay shards *diffusers* VAE modules, so the one weight format the library takes is the
diffusers one: a family of ``families.FAMILIES``, keyword arguments for its diffusers class, and that class's
state dict (what ``model.state_dict()`` of the diffusers model holds, or what ``diffusers`` single-file converters
return). A host application whose VAE weights use another layout converts them first (ComfyUI's layout is
converted by the node pack's bridge, ``nodes/bridge/vae_layouts/``); this module knows no such layout.

:func:`check_state_dict` makes the format a contract: the keys and shapes must equal those of the diffusers model
built from the config (built on the meta device, so the check costs no memory). A state dict that does not match
raises :class:`UnsupportedVaeError` naming the first differences, instead of producing a model with silently
missing weights. :func:`state_dict_key` names weights for the ranks' cache.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

__all__ = ["UnsupportedVaeError", "check_state_dict", "state_dict_key"]


class UnsupportedVaeError(NotImplementedError):
    """PatchRay cannot build this VAE as a diffusers model it shards; the message says why."""


def check_state_dict(class_name: str, config: dict, sd: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`UnsupportedVaeError` unless ``sd`` is exactly the state dict of ``diffusers.<class_name>(**config)``.

    Args:
        class_name: a diffusers VAE class name (``"AutoencoderKL"``, ``"AutoencoderKLWan"``...).
        config: keyword arguments for that class.
        sd: the weights, diffusers layout.

    Raises:
        UnsupportedVaeError: the class is missing from the installed diffusers, or keys are missing, unexpected or
            of another shape (the message names the first of each).
    """
    import diffusers

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        from .variants import variant_class

        cls = variant_class(class_name)
    if cls is None:
        raise UnsupportedVaeError(f"diffusers {diffusers.__version__} has no {class_name}; upgrade diffusers")
    from .families import split_options

    kwargs, _ = split_options(config)  # PatchRay's own options change no weight
    with torch.device("meta"):
        model = cls(**kwargs)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in sd.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} unexpected (e.g. {extra[:3]})")
        if wrong:
            parts.append(f"{len(wrong)} with other shapes (e.g. {wrong[0]}: {have[wrong[0]]} vs {want[wrong[0]]})")
        raise UnsupportedVaeError(f"the converted {class_name} weights do not fit the inferred model: " + "; ".join(parts))


def state_dict_key(sd: Mapping[str, torch.Tensor], extra: str = "") -> str:
    """A content key for caching weights on the ranks: names, shapes, dtypes and a sample of every tensor.

    Hashing every byte of a 300 MB VAE per prompt would cost seconds; hashing names, shapes and a strided
    sample of each tensor's values tells different checkpoints apart (they differ almost everywhere) in
    milliseconds. ``extra`` folds in anything else that changes the model (dtype, config).
    """
    h = hashlib.sha256(extra.encode())
    for k in sorted(sd):
        t = sd[k]
        h.update(f"{k}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            step = max(1, flat.numel() // 64)
            h.update(flat[::step][:64].to(torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()[:24]
