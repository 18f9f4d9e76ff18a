"""The VAE nodes' one call each: ComfyUI's VAE, LATENT and IMAGE in, the stock nodes' outputs out.

A VAE family PatchRay cannot rebuild as a diffusers model falls back to ComfyUI's own decode/encode; the caller gets
the reason as a note to show on the node (and it is logged as a warning).
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

import torch

from . import convert as cv
from .errors import rank_errors_for_user

__all__ = ["Result", "decode", "encode"]

log = logging.getLogger(__name__)


class Result(NamedTuple):
    """What a VAE node returns: the output and, when ComfyUI's own VAE did the work instead, why (else None)."""

    value: object
    fallback_note: Optional[str]


def _fallback_note(exc: Exception, what: str) -> str:
    msg = f"PatchRay cannot shard this VAE ({exc}); used ComfyUI's own single-device {what} instead."
    log.warning(msg)
    return msg


def decode(
    samples,
    vae,
    cluster_config,
    mode: str = "auto",
    precision: str = "auto",
    gn_sync: bool = False,
    plan=None,
    cancel_check: Optional[Callable[[], None]] = None,
) -> Result:
    """LATENT -> IMAGE ``[N, H, W, 3]`` in 0..1 on the cluster's ranks, like the stock VAE Decode."""
    from ...distributed.cluster import get_cluster
    from ...distributed.vae.api import distributed_decode
    from ...distributed.vae.convert import UnsupportedVaeError

    z = cv.latent_tensor(samples)
    plan = cv.plan_dict(plan)
    try:
        spec = cv.vae_spec(vae)
    except UnsupportedVaeError as exc:
        return Result(cv.stock_decode(vae, samples), _fallback_note(exc, "decode"))
    z = cv.latent_to_library(spec, z)
    with rank_errors_for_user():
        x = distributed_decode(
            get_cluster(cluster_config),
            spec,
            z,
            mode=mode,
            plan=plan,
            dtype=cv.resolve_dtype(precision, vae),
            gn_sync=bool(gn_sync),
            cancel_check=cancel_check,
        )
    return Result(cv.decoded_to_image(x), None)


def encode(pixels, vae, cluster_config, precision: str = "auto", cancel_check: Optional[Callable[[], None]] = None) -> Result:
    """IMAGE -> LATENT ``{"samples": mean}`` on the cluster's ranks, like the stock VAE Encode."""
    from ...distributed.cluster import get_cluster
    from ...distributed.vae.api import distributed_encode
    from ...distributed.vae.convert import UnsupportedVaeError

    try:
        spec = cv.vae_spec(vae)
    except UnsupportedVaeError as exc:
        return Result({"samples": cv.stock_encode(vae, pixels)}, _fallback_note(exc, "encode"))
    x = cv.encode_input(pixels, spec)
    with rank_errors_for_user():
        z: torch.Tensor = distributed_encode(
            get_cluster(cluster_config), spec, x, dtype=cv.resolve_dtype(precision, vae), cancel_check=cancel_check
        )
    return Result({"samples": cv.latent_from_library(spec, z)}, None)
