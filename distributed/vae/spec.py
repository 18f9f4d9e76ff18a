"""What the ranks need to build one VAE: the spec, its dtype, and the shapes derived from it.

Design decisions:

* **Weights travel once per VAE.** A :class:`VaeSpec` carries a content key; equal keys mean equal models, so a
  rank that already holds the key is sent nothing (see :mod:`.rank_tasks`).
* **One weight format.** A spec holds a diffusers config and a diffusers-layout state dict
  (:func:`spec_from_diffusers`, checked by ``convert.check_state_dict``); host applications convert their own
  layouts before they call here.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import torch

__all__ = ["VaeSpec", "spec_for_family", "spec_from_diffusers", "latent_channels", "resolve_dtype", "latent_frames_hw"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class VaeSpec(NamedTuple):
    """What the ranks need to build one VAE.

    Args:
        family: a key of ``families.FAMILIES``.
        config: keyword arguments for the family's diffusers class (``None``: the family's ``size`` config).
        state_dict: diffusers-layout weights (``None``: deterministic synthetic weights, seeded from ``key``).
        key: content key; equal keys mean equal models (see ``convert.state_dict_key``).
        size: ``"full"`` or ``"tiny"``, used only when ``config`` is ``None``.
    """

    family: str
    config: Optional[dict]
    state_dict: Optional[Mapping[str, torch.Tensor]]
    key: str
    size: str = "full"


def spec_for_family(family: str, size: str = "full", seed: int = 0) -> VaeSpec:
    """A spec with synthetic weights (benchmarks, demos, tests)."""
    from .families import get_family

    get_family(family)  # unknown family -> ValueError listing the known ones
    return VaeSpec(family=family, config=None, state_dict=None, key=f"synthetic:{family}:{size}:{seed}", size=size)


def spec_from_diffusers(family: str, config: dict, state_dict: Mapping[str, torch.Tensor]) -> VaeSpec:
    """A spec for real weights in the diffusers format, checked against the family's diffusers class.

    Args:
        family: a key of ``families.FAMILIES`` (``"kl"``, ``"wan"``...).
        config: keyword arguments for the family's diffusers class.
        state_dict: that model's weights, diffusers layout (the tensors are kept, not copied).

    Raises:
        ValueError: unknown family.
        UnsupportedVaeError: the weights do not fit ``diffusers.<class>(**config)`` (the message names what differs).

    Example:
        >>> vae = diffusers.AutoencoderKL(**cfg)  # doctest: +SKIP
        >>> spec = spec_from_diffusers("kl", cfg, vae.state_dict())  # doctest: +SKIP
    """
    from .convert import check_state_dict, state_dict_key
    from .families import get_family

    check_state_dict(get_family(family).diffusers_class, config, state_dict)
    return VaeSpec(family=family, config=dict(config), state_dict=state_dict, key=state_dict_key(state_dict, family))


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype (got {dtype!r})")
    return _DTYPES[dtype]


def latent_channels(spec: VaeSpec) -> Optional[int]:
    """The latent channels the ranks' VAE will expect (None when only the diffusers class default knows)."""
    from .families import get_family

    fam = get_family(spec.family)
    if spec.config is None and spec.size == "full":
        return fam.latent_channels
    config = fam.tiny_config if spec.config is None else spec.config
    for key in ("latent_channels", "z_dim"):
        if key in config:
            return int(config[key])
    # a tiny config without the key builds the released width (families.latent_shape); a given config without it
    # leaves the diffusers class default, which only the ranks see: their own check decides
    return fam.latent_channels if spec.config is None else None


def latent_frames_hw(spec_family: str, z: torch.Tensor):
    """The output's (height, width, frames) for latent ``z`` of ``spec_family``."""
    from .families import get_family

    fam = get_family(spec_family)
    frames_lat = z.shape[2] if z.dim() == 5 else 1
    frames = (frames_lat - 1) * fam.temporal_ratio + 1 if fam.is_video else 1
    return fam.spatial_ratio * z.shape[-2], fam.spatial_ratio * z.shape[-1], frames
