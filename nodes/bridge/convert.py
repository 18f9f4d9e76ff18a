"""Conversions between ComfyUI's objects and what ``distributed/`` takes. No algorithm lives here.

* ComfyUI VAE (``comfy.sd.VAE``) -> ``VaeSpec``: its weights converted to the diffusers layout by
  :mod:`.vae_layouts`, then checked by the library (``distributed.vae.api.spec_from_diffusers``).
* LATENT dict <-> latent tensor, IMAGE ``[B, H, W, C]`` in 0..1 <-> sample ``[B, 3, (T,) H, W]`` in -1..1,
  exactly as the stock VAE Decode / VAE Encode do it (``comfy/sd.py``: ``process_output`` =
  ``clamp((x + 1) / 2, 0, 1)``, ``process_input`` = ``x * 2 - 1``, the centre crop to the compression ratio,
  video frames as the batch dimension of IMAGE).

ComfyUI's LATENT holds what the VAE takes: samplers undo the model's latent scaling (``latent_format``)
before they return, and ``VAE.decode`` feeds ``samples`` to ``first_stage_model.decode`` unscaled. diffusers'
``decode`` takes the same unscaled latent (its pipelines apply ``scaling_factor`` outside the model), so the
latent passes through untouched.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = [
    "DTYPES", "vae_spec", "decoded_to_image", "decoded_to_pixels", "combine_batches", "image_to_sample", "latent_tensor",
    "check_latent", "stock_decode", "stock_encode", "resolve_dtype", "plan_dict", "spatial_ratio", "latent_to_library",
    "latent_from_library", "encode_input", "to_output_device", "first_stage",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# one spec per live ComfyUI VAE object: converting is cheap, but hashing the key every prompt is not free
_SPECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def first_stage(vae):
    """ComfyUI's ``VAE.first_stage_model`` (the torch module holding the weights); ``TypeError`` for anything else."""
    model = getattr(vae, "first_stage_model", None)
    if model is None or not hasattr(model, "state_dict"):
        raise TypeError(f"expected ComfyUI's VAE (from the VAE Loader), got {type(vae).__name__}")
    return model


def vae_spec(vae):
    """The ``VaeSpec`` for a ComfyUI VAE (cached per VAE object). Raises ``UnsupportedVaeError`` with the reason."""
    from ...distributed.vae.api import spec_from_diffusers
    from .vae_layouts import convert_comfy_vae

    try:
        cached = _SPECS.get(vae)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None:
        return cached
    sd = {k: v.detach().to("cpu") for k, v in first_stage(vae).state_dict().items()}
    conv = convert_comfy_vae(sd)
    spec = spec_from_diffusers(conv.family, conv.config, conv.state_dict)
    try:
        _SPECS[vae] = spec
    except TypeError:
        pass
    return spec


def latent_tensor(samples) -> torch.Tensor:
    """The tensor of a LATENT dict, checked."""
    if not isinstance(samples, dict) or "samples" not in samples:
        raise TypeError(f"expected a LATENT (a dict with 'samples'), got {type(samples).__name__}")
    return check_latent(samples["samples"])


def check_latent(z) -> torch.Tensor:
    """A latent tensor as ``VAE.decode`` takes it (``LATENT["samples"]``): 4-D (image) or 5-D (video), checked."""
    if not torch.is_tensor(z) or z.ndim not in (4, 5):
        raise ValueError(f"LATENT samples must be a 4-D or 5-D tensor, got {getattr(z, 'shape', type(z))}")
    return z


def decoded_to_pixels(x: torch.Tensor) -> torch.Tensor:
    """Decoded sample ``[B, 3, H, W]`` / ``[B, 3, T, H, W]`` in -1..1 -> what ComfyUI's ``VAE.decode`` returns:
    ``[B, H, W, 3]`` / ``[B, T, H, W, 3]`` float32 in 0..1 (``process_output`` then channels last)."""
    return torch.clamp((x.float() + 1.0) / 2.0, min=0.0, max=1.0).movedim(1, -1).contiguous()


def combine_batches(images: torch.Tensor) -> torch.Tensor:
    """What the stock VAE Decode does to ``VAE.decode``'s output: a video's ``[B, T, H, W, C]`` becomes IMAGE
    ``[B * T, H, W, C]`` (batch-major); an image batch passes unchanged."""
    if images.ndim == 5:
        images = images.reshape(-1, images.shape[-3], images.shape[-2], images.shape[-1])
    return images


def decoded_to_image(x: torch.Tensor) -> torch.Tensor:
    """Decoded sample ``[B, 3, H, W]`` / ``[B, 3, T, H, W]`` in -1..1 -> IMAGE ``[N, H, W, 3]`` in 0..1.

    Video frames become images in batch-major order, as the stock VAE Decode's "combine batches" reshape.
    """
    return combine_batches(decoded_to_pixels(x))


def to_output_device(vae, x: torch.Tensor) -> torch.Tensor:
    """``x`` on the device ComfyUI's VAE returns its results on (``VAE.output_device``: the CPU unless ComfyUI runs
    with ``--gpu-only``); unchanged for a VAE object without one."""
    device = getattr(vae, "output_device", None)
    return x.to(device) if isinstance(device, (torch.device, str)) else x


def image_to_sample(pixels: torch.Tensor, ratio: int, video: bool) -> torch.Tensor:
    """IMAGE ``[B, H, W, C]`` in 0..1 -> sample in -1..1, centre-cropped to multiples of ``ratio`` like ComfyUI.

    For video VAEs the IMAGE batch is the frame axis: ``[T, H, W, 3]`` -> ``[1, 3, T, H, W]``.
    """
    if not torch.is_tensor(pixels) or pixels.ndim != 4:
        raise ValueError(f"IMAGE must be a [B, H, W, C] tensor, got {getattr(pixels, 'shape', type(pixels))}")
    pixels = pixels[..., :3]
    for d in (1, 2):
        n = pixels.shape[d]
        keep = (n // ratio) * ratio
        if keep == 0:
            raise ValueError(f"IMAGE is {pixels.shape[2]}x{pixels.shape[1]}: smaller than the VAE's {ratio}x compression")
        if keep != n:
            pixels = pixels.narrow(d, (n % ratio) // 2, keep)
    x = pixels.movedim(-1, 1).float() * 2.0 - 1.0
    if video:
        x = x.movedim(1, 0).unsqueeze(0)
    return x.contiguous()


def stock_decode(vae, samples) -> torch.Tensor:
    """ComfyUI's own decode, as the stock VAE Decode node does it (the fallback for families PatchRay cannot shard)."""
    return combine_batches(vae.decode(latent_tensor(samples)))


def stock_encode(vae, pixels) -> torch.Tensor:
    """ComfyUI's own encode, as the stock VAE Encode node does it (the fallback for families PatchRay cannot shard)."""
    return vae.encode(pixels[:, :, :, :3])


def resolve_dtype(name: str, vae=None) -> torch.dtype:
    """``auto`` -> the dtype ComfyUI itself decodes this VAE in (``vae.vae_dtype``), else fp32."""
    if name == "auto":
        dt = getattr(vae, "vae_dtype", None)
        return dt if isinstance(dt, torch.dtype) else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"precision must be auto, fp32, bf16 or fp16 (got {name!r})") from None


def spatial_ratio(spec) -> int:
    """Pixels per latent row of the spec's VAE: its own levels when the config says, else the family's ratio."""
    from ...distributed.vae.families import get_family

    config = spec.config or {}
    if "block_out_channels" in config and not get_family(spec.family).is_video:  # video VAEs also patchify
        return 2 ** (len(config["block_out_channels"]) - 1)
    return get_family(spec.family).spatial_ratio


def plan_dict(plan) -> Optional[dict]:
    """The TILE_PLAN wire's dict, checked (None when the input is not connected)."""
    if plan is None:
        return None
    if not isinstance(plan, dict) or "latent_window" not in plan or "runs" not in plan:
        raise TypeError(f"the plan input must come from PatchRay Tile Planner (got {type(plan).__name__})")
    return plan


def _latent_layout(spec):
    from .vae_layouts import latent_layout

    return latent_layout(spec.family)


def latent_to_library(spec, z: torch.Tensor) -> torch.Tensor:
    """ComfyUI's latent -> the diffusers model's (identity unless the layout row says otherwise, e.g. the
    HunyuanImage refiner's 64-channel packing). Raises ``ValueError`` for a latent the row cannot map."""
    layout = _latent_layout(spec)
    return z if layout is None else layout.to_library(z)


def latent_from_library(spec, z: torch.Tensor) -> torch.Tensor:
    """The diffusers encoder's latent mean -> ComfyUI's latent (the inverse of :func:`latent_to_library`)."""
    layout = _latent_layout(spec)
    return z if layout is None else layout.from_library(z)


def encode_input(pixels: torch.Tensor, spec) -> torch.Tensor:
    """IMAGE -> the encoder's input for ``spec``, as ComfyUI's ``VAE.encode`` shapes it: the frames of one clip for
    video VAEs, a batch of one-frame clips for 5-D VAEs ComfyUI marks ``not_video`` (the layout row says so)."""
    from ...distributed.vae.families import get_family

    layout = _latent_layout(spec)
    video = get_family(spec.family).is_video
    batch = video and layout is not None and layout.images_are_batch
    x = image_to_sample(pixels, spatial_ratio(spec), video and not batch)
    return x.unsqueeze(2) if batch else x
