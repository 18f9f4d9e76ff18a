"""The VAE families PatchRay shards: one table, one row per family.

Design decision: everything family-specific that is *data* lives in :data:`FAMILIES` (the diffusers class, named
as a string and resolved lazily so a missing class disables only its family; the compression ratios; a reduced
CI config of the same architecture; the released model's config). Which adapter each layer type gets lives in
``distributed/vae/row.py`` (``ROW_PLANS``), so adding a family is one row here plus whatever adapter
its layers still lack.

``tiny_config`` keeps every block type, the number of resolution levels (so the spatial/temporal ratios hold)
and the padding modes of the released model; only widths (and, where the released depth is large, the number of
layers per block) shrink so the CPU tests stay fast.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple, Optional

import torch

__all__ = ["FamilySpec", "FAMILIES", "build_vae", "latent_shape", "family_of", "resolve_class", "get_family"]


class FamilySpec(NamedTuple):
    """One row of the family table.

    Args:
        name: the family key (``"kl"``, ``"wan"``...).
        diffusers_class: the class name inside ``diffusers`` (resolved lazily by :func:`resolve_class`).
        spatial_ratio: pixels per latent row/column.
        temporal_ratio: frames per latent frame (1 for images); latent frames are ``(F - 1) // ratio + 1``.
        latent_channels: channels of the (full-size) latent.
        is_video: whether the VAE takes 5-D ``[B, C, T, H, W]`` inputs (qwen_image does, with ``T == 1``).
        tiny_config: a reduced-width config of the same architecture, for CI.
        full_config: overrides of the class defaults that give the released model's shape.
    """

    name: str
    diffusers_class: str
    spatial_ratio: int
    temporal_ratio: int
    latent_channels: int
    is_video: bool
    tiny_config: dict
    full_config: dict


_KL_FULL = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
    sample_size=1024,
)

FAMILIES: dict = {
    spec.name: spec
    for spec in (
        FamilySpec(
            "kl",
            "AutoencoderKL",
            8,
            1,
            16,
            False,
            tiny_config=dict(_KL_FULL, block_out_channels=(8, 8, 16, 16), norm_num_groups=4, sample_size=64),
            full_config=_KL_FULL,
        ),
        FamilySpec(
            "flux2",
            "AutoencoderKLFlux2",
            8,
            1,
            32,
            False,
            tiny_config=dict(block_out_channels=(8, 8, 16, 16), norm_num_groups=4, sample_size=64),
            full_config={},
        ),
        FamilySpec(
            "qwen_image",
            "AutoencoderKLQwenImage",
            8,
            4,
            16,
            True,
            tiny_config=dict(base_dim=8, num_res_blocks=1),
            full_config={},
        ),
        FamilySpec(
            "wan",
            "AutoencoderKLWan",
            8,
            4,
            16,
            True,
            # the released Wan 2.1 VAE has no attention outside the mid-block; attn_scales stays empty as there
            tiny_config=dict(base_dim=8, num_res_blocks=1),
            full_config={},
        ),
        FamilySpec(
            "hunyuan_video",
            "AutoencoderKLHunyuanVideo",
            8,
            4,
            16,
            True,
            tiny_config=dict(block_out_channels=(8, 8, 16, 16), norm_num_groups=4, layers_per_block=1),
            full_config={},
        ),
        FamilySpec(
            "hunyuan_video_15",
            "AutoencoderKLHunyuanVideo15",
            16,
            4,
            32,
            True,
            tiny_config=dict(block_out_channels=(8, 8, 16, 32, 32), layers_per_block=1, latent_channels=8),
            full_config={},
        ),
        FamilySpec(
            "ltx2",
            "AutoencoderKLLTX2Video",
            32,
            8,
            128,
            True,
            tiny_config=dict(
                latent_channels=8,
                block_out_channels=(8, 16, 32, 32),
                decoder_block_out_channels=(8, 16, 32),
                layers_per_block=(1, 1, 1, 1, 1),
                decoder_layers_per_block=(1, 1, 1, 1),
            ),
            full_config={},
        ),
        # --- Hunyuan image VAEs (HunyuanImage-2.1's 32x VAE and its refiner's 16x VAE) ---
        FamilySpec(
            "hunyuan_image",
            "AutoencoderKLHunyuanImage",
            32,
            1,
            64,
            False,
            # GroupNorm(32) is hard-coded in this class: widths stay multiples of 32; the channel-matching
            # pixel-(un)shuffle resamplers keep every resnet's input and output widths equal, as released
            tiny_config=dict(
                in_channels=3,
                out_channels=3,
                latent_channels=8,
                block_out_channels=(32, 32, 64, 64, 64, 64),
                layers_per_block=1,
                spatial_compression_ratio=32,
                sample_size=256,
            ),
            full_config=dict(
                in_channels=3,
                out_channels=3,
                latent_channels=64,
                block_out_channels=(128, 256, 512, 512, 1024, 1024),
                layers_per_block=2,
                spatial_compression_ratio=32,
                sample_size=384,
            ),
        ),
        FamilySpec(
            "hunyuan_image_refiner",
            "AutoencoderKLHunyuanImageRefiner",
            16,
            # diffusers' refiner class packs time into channels only on the first frame: T frames in, T out
            1,
            32,
            True,
            tiny_config=dict(block_out_channels=(8, 8, 16, 32, 32), layers_per_block=1, latent_channels=8),
            full_config={},
        ),
        # HunyuanVideo's VAE as ComfyUI runs it: full mid-block attention, whole clips (distributed/vae/variants.py)
        FamilySpec(
            "hunyuan_video_full_attention",
            "AutoencoderKLHunyuanVideoFullAttention",
            8,
            4,
            16,
            True,
            tiny_config=dict(block_out_channels=(8, 8, 16, 16), norm_num_groups=4, layers_per_block=1),
            full_config={},
        ),
    )
}


def get_family(family: str) -> FamilySpec:
    """The table row of ``family``; ``ValueError`` naming the known families otherwise."""
    try:
        return FAMILIES[family]
    except (KeyError, TypeError):
        raise ValueError(f"unknown VAE family {family!r}; known families: {', '.join(sorted(FAMILIES))}") from None


def resolve_class(family: str) -> type:
    """The diffusers class of ``family``, imported on first use.

    Raises:
        ImportError: when the installed diffusers lacks the class (this disables only that family).
    """
    spec = get_family(family)
    diffusers = importlib.import_module("diffusers")
    cls = getattr(diffusers, spec.diffusers_class, None)
    if cls is None:
        from .variants import variant_class

        cls = variant_class(spec.diffusers_class)
    if cls is None:
        raise ImportError(
            f"family {family!r} needs diffusers.{spec.diffusers_class}, which diffusers "
            f"{getattr(diffusers, '__version__', '?')} lacks; install diffusers>=0.42"
        )
    return cls


def build_vae(
    family: str,
    size: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device="cpu",
) -> torch.nn.Module:
    """Build a VAE of ``family`` with deterministic synthetic weights.

    Args:
        family: a key of :data:`FAMILIES`.
        size: ``"tiny"`` (CI config) or ``"full"`` (the released model's architecture).
        seed: the weights' RNG seed (the global RNG state is left untouched).
        dtype: parameter dtype.
        device: where the parameters live.

    Example:
        >>> vae = build_vae("kl")
        >>> family_of(vae)
        'kl'
    """
    spec = get_family(family)
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full' (got {size!r})")
    cls = resolve_class(family)
    config = spec.tiny_config if size == "tiny" else spec.full_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = cls(**config)
        # diffusers zero-initialises nothing we rely on, but some default inits are degenerate (all-ones norms):
        # a small deterministic perturbation makes every parameter matter in the exactness tests.
        for p in vae.parameters():
            p.data.add_(torch.randn_like(p) * 0.02)
    # nn.Module.to: ModelMixin.to warns about modules "to keep in float32", which none of these VAEs has
    return torch.nn.Module.to(vae, device=device, dtype=dtype).eval()


def latent_shape(family: str, height: int, width: int, frames: int = 1, batch: int = 1, size: str = "full") -> tuple:
    """The latent shape ``family``'s VAE produces for a ``height x width`` (x ``frames``) input.

    Video families (and qwen_image, a video-shaped VAE used with one frame) give 5-D ``[B, C, T, h, w]``.
    """
    spec = get_family(family)
    r = spec.spatial_ratio
    if height % r or width % r:
        raise ValueError(
            f"{family} needs height and width divisible by {r} (got {height}x{width}); "
            f"round to {height // r * r}x{width // r * r}"
        )
    channels = spec.latent_channels if size == "full" else _tiny_latent_channels(spec)
    h, w = height // spec.spatial_ratio, width // spec.spatial_ratio
    if not spec.is_video:
        return (batch, channels, h, w)
    if (frames - 1) % spec.temporal_ratio:
        raise ValueError(f"{family} needs frames = {spec.temporal_ratio}k + 1 (got {frames})")
    return (batch, channels, (frames - 1) // spec.temporal_ratio + 1, h, w)


def _tiny_latent_channels(spec: FamilySpec) -> int:
    for key in ("latent_channels", "z_dim"):
        if key in spec.tiny_config:
            return spec.tiny_config[key]
    return spec.latent_channels


def family_of(vae) -> str:
    """The family key of a diffusers VAE instance (matched on its class name).

    Raises:
        ValueError: for a VAE class no family covers; the message lists the known families.
    """
    name = type(vae).__name__
    for spec in FAMILIES.values():
        if spec.diffusers_class == name:
            return spec.name
    raise ValueError(
        f"no PatchRay VAE family covers {name}; known families: "
        + ", ".join(f"{s.name} ({s.diffusers_class})" for s in FAMILIES.values())
    )
