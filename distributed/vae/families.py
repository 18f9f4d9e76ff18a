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

__all__ = ["FamilySpec", "FAMILIES", "build_vae", "latent_shape", "family_of", "resolve_class", "get_family", "image_channels",
           "instantiate", "split_options", "OPTIONS", "plain_decode"]


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
        config_match: ``(key, value)`` pairs a model's config must hold for this row to claim it, for families
            that share a diffusers class (Wan 2.1 and Wan 2.2 are both ``AutoencoderKLWan``): the row with the
            most matching pairs wins (:func:`family_of`).
        input_patch: the config's ``in_channels`` counts the input after a ``p x p`` patchify (Wan 2.2: 12 = 3 x 2 x 2);
            the image itself has ``in_channels // p**2`` channels (:func:`image_channels`).
        input_features: the config's ``in_channels`` counts this many features per image channel (Mochi: 5, the value
            and the sine and cosine of two frequencies: 15 = 3 x 5); the image has ``in_channels // input_features``.
    """

    name: str
    diffusers_class: str
    spatial_ratio: int
    temporal_ratio: int
    latent_channels: int
    is_video: bool
    tiny_config: dict
    full_config: dict
    config_match: tuple = ()
    input_patch: int = 1
    input_features: int = 1


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

#: Wan 2.2 (the TI2V-5B model's VAE): 2x2 patchify to 12 channels, residual up/down blocks, 16x spatial
_WAN22_FULL = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_temporal=4,
    scale_factor_spatial=16,
)

#: LTX-Video 0.9.5 / 0.9.7 / 0.9.8 (what ComfyUI builds as its VAE "version 2"): space-to-depth encoder, residual
#: depth-to-space decoder conditioned on the decode timestep; ComfyUI pads the decoder's convolutions by reflection
#: and hands the decoder latents normalised by the per-channel statistics (options below, see :func:`instantiate`)
_LTX095_FULL = dict(
    block_out_channels=(128, 256, 512, 1024, 2048),
    down_block_types=("LTXVideo095DownBlock3D",) * 4,
    decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=True,
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
    patchray_decoder_padding_mode="reflect",
    patchray_latents_normalized=True,
    patchray_decode_timestep=0.05,
)
#: LTX-Video 0.9.0 (ComfyUI's VAE "version 0"): strided-conv encoder, plain depth-to-space decoder, no timestep
_LTX090_FULL = dict(
    timestep_conditioning=False,
    patchray_decoder_padding_mode="reflect",
    patchray_latents_normalized=True,
)
_LTX_TINY = dict(
    latent_channels=8,
    block_out_channels=(8, 8, 16, 16, 32),
    decoder_block_out_channels=(8, 16, 32),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
)

_VIDEO_ROWS = (
    FamilySpec(
        "wan22",
        "AutoencoderKLWan",
        16,
        4,
        48,
        True,
        tiny_config=dict(_WAN22_FULL, base_dim=8, decoder_base_dim=8, z_dim=8, num_res_blocks=1),
        full_config=_WAN22_FULL,
        config_match=(("is_residual", True),),
        input_patch=2,
    ),
    FamilySpec(
        "ltx_video",
        "AutoencoderKLLTXVideo",
        32,
        8,
        128,
        True,
        tiny_config=dict(_LTX095_FULL, **_LTX_TINY),
        full_config=_LTX095_FULL,
        config_match=(("timestep_conditioning", True),),
    ),
    FamilySpec(
        "ltx_video_090",
        "AutoencoderKLLTXVideo",
        32,
        8,
        128,
        True,
        tiny_config=dict(_LTX090_FULL, latent_channels=8, block_out_channels=(8, 16, 32, 32),
                         decoder_block_out_channels=(8, 16, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
                         decoder_layers_per_block=(1, 1, 1, 1, 1)),
        full_config=_LTX090_FULL,
        config_match=(("timestep_conditioning", False),),
    ),
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
        # --- Wan 2.2 and LTX-Video (rebuilt from ComfyUI's classes by nodes/bridge/vae_layouts/{wan,ltx}.py)
        *_VIDEO_ROWS,
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
        # Mochi's VAE as genmo's release computes it: frames dropped inside each upsampling block, non-causal
        # encoder attention (distributed/vae/variants.py). GroupNorm(32) is fixed in the class: widths stay multiples
        # of 32; the tiny config keeps both halves' depth per group at one resnet, the released attention pattern
        FamilySpec(
            "mochi",
            "AutoencoderKLMochiGenmo",
            8,
            6,
            12,
            True,
            tiny_config=dict(
                encoder_block_out_channels=(32, 32, 64, 64),
                decoder_block_out_channels=(32, 32, 64, 64),
                layers_per_block=(1, 1, 1, 1, 1),
                latent_channels=8,
            ),
            full_config={},
            input_features=5,
        ),
        # the refiner's architecture with plain zero-padded Conv3d and GroupNorm(32) (distributed/vae/variants.py):
        # an image VAE, one frame in and out (repeated to four frames before encoding); widths multiples of 32
        FamilySpec(
            "hunyuan_refiner_conv3d",
            "AutoencoderKLHunyuanImageRefinerConv3d",
            16,
            1,
            32,
            True,
            tiny_config=dict(block_out_channels=(32, 32, 32, 64, 64), layers_per_block=1, latent_channels=32),
            full_config={},
        ),
        # NVIDIA's Cosmos tokenizer (CV8x8x8) with its own latent statistics (distributed/vae/variants.py); the tiny
        # config keeps attention at the first level (resolution 128 / patch 4 = 32) and GroupNorm(1)
        FamilySpec(
            "cosmos",
            "AutoencoderKLCosmosLatentStats",
            8,
            8,
            16,
            True,
            tiny_config=dict(encoder_block_out_channels=(8, 16, 32, 32), decode_block_out_channels=(16, 32, 32, 32),
                             attention_resolutions=(32,), resolution=128, num_layers=1),
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


#: PatchRay's own model options, kept in a family's config next to the diffusers arguments (``patchray_`` keys):
#: what the host application does around or inside the model that the diffusers class does not express.
#:
#: * ``patchray_decoder_padding_mode`` / ``patchray_encoder_padding_mode``: the spatial padding of every convolution
#:   of that half (``"zeros"``, ``"reflect"``, ``"replicate"``); diffusers' LTX-Video class only builds zeros.
#: * ``patchray_latents_normalized``: the latent the model decodes (and the mean it encodes to) is normalised by the
#:   model's ``latents_mean`` / ``latents_std`` buffers, as ComfyUI's LTX-Video VAE does inside ``decode``/``encode``.
#: * ``patchray_decode_timestep``: the timestep a timestep-conditioned decoder is given (ComfyUI: 0.05).
OPTIONS = ("patchray_decoder_padding_mode", "patchray_encoder_padding_mode", "patchray_latents_normalized", "patchray_decode_timestep")


def split_options(config: Optional[dict]) -> tuple:
    """``(diffusers keyword arguments, PatchRay options)`` of a family config; unknown ``patchray_`` keys raise."""
    kwargs, options = {}, {}
    for key, value in (config or {}).items():
        if key.startswith("patchray_"):
            if key not in OPTIONS:
                raise ValueError(f"unknown PatchRay model option {key!r}; known: {', '.join(OPTIONS)}")
            options[key] = value
        else:
            kwargs[key] = value
    return kwargs, options


def instantiate(family: str, config: Optional[dict]) -> torch.nn.Module:
    """``diffusers.<class>(**config)`` for ``family``, with the config's PatchRay options applied and recorded.

    The options stay readable as ``vae.config["patchray_..."]`` (diffusers' ``register_to_config``), so the row
    code and :func:`family_of` see them on the model itself. Builds wherever the current default device is (e.g. the
    meta device).
    """
    kwargs, options = split_options(config)
    vae = resolve_class(family)(**kwargs)
    for half in ("decoder", "encoder"):
        mode = options.get(f"patchray_{half}_padding_mode")
        if mode is None:
            continue
        if mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"patchray_{half}_padding_mode must be zeros, reflect, replicate or circular (got {mode!r})")
        for module in getattr(vae, half).modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
                module.padding_mode = mode
    if options:
        vae.register_to_config(**options)
    return vae


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
    config = spec.tiny_config if size == "tiny" else spec.full_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = instantiate(family, config)
        # diffusers zero-initialises nothing we rely on, but some default inits are degenerate (all-ones norms):
        # a small deterministic perturbation makes every parameter matter in the exactness tests.
        for p in vae.parameters():
            p.data.add_(torch.randn_like(p) * 0.02)
        if hasattr(vae, "latent_std") and hasattr(vae, "latent_mean"):  # a model normalising its own latent (Cosmos)
            vae.latent_mean.copy_(torch.randn_like(vae.latent_mean) * 0.3)
            vae.latent_std.copy_(torch.rand_like(vae.latent_std) + 0.5)
        if vae.config.get("patchray_latents_normalized"):  # the latent statistics matter too (zeros/ones by default)
            vae.latents_mean.copy_(torch.randn_like(vae.latents_mean) * 0.3)
            vae.latents_std.copy_(torch.rand_like(vae.latents_std) + 0.5)
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


def image_channels(family: str, config: Optional[dict]) -> int:
    """Channels of the image/video the VAE of ``family`` with ``config`` encodes (3 unless the config says)."""
    spec = get_family(family)
    per_channel = spec.input_patch**2 * spec.input_features
    return int((config or {}).get("in_channels", 3 * per_channel)) // per_channel


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
    config = getattr(vae, "config", None) or {}
    best = None
    for spec in FAMILIES.values():
        if spec.diffusers_class != name or any(config.get(k) != v for k, v in spec.config_match):
            continue
        if best is None or len(spec.config_match) > len(best.config_match):
            best = spec
    if best is not None:
        return best.name
    raise ValueError(
        f"no PatchRay VAE family covers {name}; known families: "
        + ", ".join(f"{s.name} ({s.diffusers_class})" for s in FAMILIES.values())
    )


def plain_decode(vae, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z).sample`` with the model's PatchRay options (:data:`OPTIONS`): un-normalise latents stored
    normalised, pass the decode timestep of a timestep-conditioned decoder. Every option is pointwise or global per
    sample, so a band or a tile of ``z`` gets exactly what the whole latent would. Every decode path (row bands, one
    rank, tiles, the benchmarks' references) goes through here."""
    config = vae.config
    if config.get("patchray_latents_normalized"):
        view = (1, -1) + (1,) * (z.dim() - 2)
        z = z * vae.latents_std.view(view).to(z) + vae.latents_mean.view(view).to(z)
    kwargs = {}
    timestep = config.get("patchray_decode_timestep")
    if timestep is not None and config.get("timestep_conditioning"):
        kwargs["temb"] = torch.full((z.shape[0],), float(timestep), device=z.device, dtype=z.dtype)
    return vae.decode(z, **kwargs).sample
