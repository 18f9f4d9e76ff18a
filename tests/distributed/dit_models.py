"""Tiny random-weight configurations of diffusers' DiT classes and matching inputs, for the sequence-parallel tests.

Every weight, bias and norm scale is drawn (none constant; diffusers zero-initialises several output layers),
from a seed every rank shares. Token grids are chosen to make bands uneven at 2 and 3 ranks (5 or 7 token
rows), videos have an odd frame count, and 6 heads let Ulysses run at 2 and 3 ranks.
"""

from __future__ import annotations

import torch

HEADS, HEAD_DIM = 6, 8
FAMILIES = ("flux", "qwen-image", "wan", "hunyuan-video", "ltx-video")


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.dim() == 1 and "norm" in name and "bias" not in name:
                p.copy_(1.0 + 0.2 * noise)  # norm scales: around 1, not constant
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 16
                p.copy_(noise * (0.8 / fan_in**0.5))
    return model.eval()


def build(family: str, seed: int = 0, heads: int = HEADS, text: int = 5):
    """``(model, inputs)`` for ``family``; ``inputs`` are keyword arguments of the model's forward (``text``
    tokens of prompt; the padded masks of Qwen-Image and HunyuanVideo mask the last two of them)."""
    from diffusers import (
        FluxTransformer2DModel,
        HunyuanVideoTransformer3DModel,
        LTXVideoTransformer3DModel,
        QwenImageTransformer2DModel,
        WanTransformer3DModel,
    )

    g = torch.Generator().manual_seed(seed + 1)
    r = lambda *s: torch.randn(*s, generator=g)
    b, txt = 2, text
    if family == "flux":
        m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
                                   num_attention_heads=heads, joint_attention_dim=16, pooled_projection_dim=8,
                                   guidance_embeds=False, axes_dims_rope=(2, 2, 4))
        h, w = 7, 3  # packed latent of a 14x6 latent (2x2 packing): 7 token rows
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        inputs = dict(hidden_states=r(b, h * w, 8), encoder_hidden_states=r(b, txt, 16), pooled_projections=r(b, 8),
                      timestep=torch.tensor([0.7, 0.3]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(txt, 3))
    elif family == "qwen-image":
        m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                                        num_attention_heads=heads, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
        h, w = 7, 3
        mask = torch.ones(b, txt, dtype=torch.bool)
        mask[1, -2:] = False  # a padded prompt: the joint mask masks text keys
        inputs = dict(hidden_states=r(b, h * w, 16), encoder_hidden_states=r(b, txt, 16), encoder_hidden_states_mask=mask,
                      timestep=torch.tensor([0.7, 0.3]), img_shapes=[[(1, h, w)]] * b)
    elif family == "wan":
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=HEAD_DIM, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
        t, h, w = 3, 14, 6  # 3 frames, 7 token rows, 3 token columns
        inputs = dict(hidden_states=r(b, 4, t, h, w), encoder_hidden_states=r(b, txt, 16),
                      timestep=(torch.rand(b, t * (h // 2) * (w // 2), generator=g) * 900))  # per-token (Wan 2.2 TI2V)
    elif family == "hunyuan-video":
        m = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=HEAD_DIM,
                                           num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1,
                                           patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
                                           guidance_embeds=True)
        t, h, w = 3, 5, 4
        mask = torch.ones(b, txt, dtype=torch.long)
        mask[0, -2:] = 0  # padded prompt: HunyuanVideo builds a key mask over [image, text]
        inputs = dict(hidden_states=r(b, 4, t, h, w), timestep=torch.tensor([700, 300]), encoder_hidden_states=r(b, txt, 16),
                      encoder_attention_mask=mask, pooled_projections=r(b, 8), guidance=torch.tensor([3.5, 3.5]))
    elif family == "ltx-video":
        m = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=heads,
                                       attention_head_dim=HEAD_DIM, cross_attention_dim=heads * HEAD_DIM, num_layers=2,
                                       caption_channels=16, qk_norm="rms_norm_across_heads")
        t, h, w = 3, 5, 4
        inputs = dict(hidden_states=r(b, t * h * w, 4), encoder_hidden_states=r(b, txt, 16), timestep=torch.tensor([700, 300]),
                      encoder_attention_mask=torch.ones(b, txt), num_frames=t, height=h, width=w)
    else:
        raise ValueError(family)
    return _randomize(m, seed), inputs


def token_rows(family: str) -> int:
    return {"flux": 7, "qwen-image": 7, "wan": 7, "hunyuan-video": 5, "ltx-video": 5}[family]
