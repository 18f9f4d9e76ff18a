"""SDXL UNet builders with synthetic weights, and a small CFG sampler loop, for tests and the benchmark.

``sdxl_unet_config()`` is the SDXL base UNet's architecture (stabilityai/stable-diffusion-xl-base-1.0
``unet/config.json``); ``tiny_sdxl_unet_config()`` keeps the same block types (DownBlock2D, two
CrossAttnDownBlock2D, UNetMidBlock2DCrossAttn, CrossAttnUpBlock2D x2, UpBlock2D, text_time embedding,
linear projections) at a width two CPU cores run in seconds. Weights are random (seeded): the point is the
architecture and the agreement with the single-rank run, not the images.

The sampler here (:func:`sample_euler_cfg`) is deliberately the caller's loop: a plain Euler ODE sampler over a
Karras-free linear sigma schedule with classifier-free guidance, calling a denoiser ``model(x, t, **cond)``. Any
other loop works the same way with :class:`PatchParallelDenoiser`.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

__all__ = ["sdxl_unet_config", "tiny_sdxl_unet_config", "build_unet", "synthetic_cond", "sample_euler_cfg", "unet_denoiser"]


def sdxl_unet_config() -> dict:
    """SDXL base 1.0's UNet2DConditionModel config."""
    return dict(
        sample_size=128,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        mid_block_type="UNetMidBlock2DCrossAttn",
        block_out_channels=(320, 640, 1280),
        layers_per_block=2,
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048,
        norm_num_groups=32,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )


def tiny_sdxl_unet_config() -> dict:
    """The same block types as SDXL at a tiny width (32/64/64 channels, 1 transformer layer per block)."""
    # derived from the full config so the block types cannot drift apart; only widths and depths change
    return {
        **sdxl_unet_config(),
        "sample_size": 32,
        "block_out_channels": (32, 64, 64),
        "layers_per_block": 1,
        "transformer_layers_per_block": (1, 1, 1),
        "attention_head_dim": (2, 4, 4),
        "cross_attention_dim": 32,
        "norm_num_groups": 8,
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 32 + 6 * 8,
    }


def build_unet(tiny: bool, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A UNet2DConditionModel with seeded random weights (identical on every rank for the same seed)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)  # seeds every device's generator: identical weights on every rank of one GPU model
    with torch.device(device):  # initialise on the device: the full SDXL UNet's 2.6 B random draws are slow on CPU
        unet = UNet2DConditionModel(**(tiny_sdxl_unet_config() if tiny else sdxl_unet_config()))
    return unet.to(dtype=dtype).eval()


def synthetic_cond(unet, batch: int, seed: int = 1, tokens: int = 77, device="cpu", dtype=torch.float32) -> Dict:
    """CFG-batched synthetic conditioning ``[uncond, cond]`` (batch ``2 * batch``) for a text_time UNet."""
    cfg = unet.config
    g = torch.Generator().manual_seed(seed)
    ctx_dim = cfg.cross_attention_dim
    text_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    ehs = torch.randn(2 * batch, tokens, ctx_dim, generator=g)
    text = torch.randn(2 * batch, text_dim, generator=g)
    size = cfg.sample_size * 8
    time_ids = torch.tensor([[size, size, 0, 0, size, size]] * (2 * batch), dtype=torch.float32)
    return {
        "encoder_hidden_states": ehs.to(device=device, dtype=dtype),
        "added_cond_kwargs": {"text_embeds": text.to(device=device, dtype=dtype), "time_ids": time_ids.to(device=device, dtype=dtype)},
    }


def unet_denoiser(unet) -> Callable:
    """``model(x, t, **cond)`` for a diffusers UNet (eps prediction)."""

    def model(x, t, **cond):
        return unet(x, t, return_dict=False, **cond)[0]

    return model


def sample_euler_cfg(
    model: Callable,
    latent: torch.Tensor,
    cond: Dict,
    steps: int,
    guidance: float = 5.0,
    sigma_max: float = 14.6,
    sigma_min: float = 0.03,
    on_step: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """Euler (eps-prediction, k-diffusion style) with CFG; ``latent`` is unit noise, scaled by ``sigma_max``.

    The model sees ``x / sqrt(sigma^2 + 1)`` and a timestep from a linear map of sigma (fine for synthetic
    weights). ``on_step(i)`` runs after each model call (the benchmark's timer).
    """
    sigmas = torch.linspace(sigma_max, sigma_min, steps).tolist() + [0.0]
    x = latent * sigmas[0]
    for i in range(steps):
        s = sigmas[i]
        x_in = torch.cat([x, x]) / (s * s + 1) ** 0.5
        t = torch.full((x_in.shape[0],), 999.0 * i / max(1, steps - 1), device=x.device, dtype=x.dtype)
        eps = model(x_in, 999.0 - t, **cond)
        uncond, text = eps.chunk(2)
        guided = uncond + guidance * (text - uncond)
        x = x + guided * (sigmas[i + 1] - s)
        if on_step is not None:
            on_step(i)
    return x
