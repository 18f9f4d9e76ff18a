"""VAE classes derived from a diffusers class where a host application computes one step differently.

Design decision: PatchRay shards diffusers modules; when a host application runs a released VAE with one
documented difference from its diffusers class, the family's class is a subclass that changes exactly that step
and nothing else (same modules, same parameter names, same state dict), so the adapters, the conversion check and
the row plans stay the diffusers ones. A family names such a class like a diffusers one
(``families.FAMILIES[...].diffusers_class``); :func:`variant_class` resolves it.

* ``AutoencoderKLHunyuanVideoFullAttention``: HunyuanVideo's VAE with the mid-block attention over every token of
  every frame (no frame-causal mask) and the whole clip decoded and encoded at once (no temporal tiles). This
  is how ComfyUI runs the released HunyuanVideo VAE (its 3-D ``AutoencoderKL``: the 2-D ``AttnBlock`` applied to
  ``[B, C, T, H, W]``, one decode call per clip); diffusers' ``AutoencoderKLHunyuanVideo`` masks the mid-block
  attention frame-causally and decodes clips of more than four latent frames in blended temporal tiles.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["VARIANTS", "variant_class"]


@functools.lru_cache(maxsize=None)
def _hunyuan_video_full_attention() -> type:
    from diffusers import AutoencoderKLHunyuanVideo
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoMidBlock3D

    class HunyuanVideoMidBlock3DFullAttention(HunyuanVideoMidBlock3D):
        """``HunyuanVideoMidBlock3D`` whose attention sees every ``(T, H, W)`` token (no mask)."""

        def forward(self, hidden_states):
            hidden_states = self.resnets[0](hidden_states)
            for attn, resnet in zip(self.attentions, self.resnets[1:]):
                if attn is not None:
                    batch_size, num_channels, num_frames, height, width = hidden_states.shape
                    hidden_states = hidden_states.permute(0, 2, 3, 4, 1).flatten(1, 3)
                    hidden_states = attn(hidden_states)
                    hidden_states = hidden_states.unflatten(1, (num_frames, height, width)).permute(0, 4, 1, 2, 3)
                hidden_states = resnet(hidden_states)
            return hidden_states

    class AutoencoderKLHunyuanVideoFullAttention(AutoencoderKLHunyuanVideo):
        """``AutoencoderKLHunyuanVideo`` with full mid-block attention and whole-clip decode/encode (see module)."""

        def __init__(self, **config):
            super().__init__(**config)
            for half in (self.encoder, self.decoder):
                # same parameters and buffers; only the forward changes
                half.mid_block.__class__ = HunyuanVideoMidBlock3DFullAttention
            self.use_framewise_encoding = False
            self.use_framewise_decoding = False

        # the parent's arguments (diffusers' config handling and callers inspect them)
        __init__.__signature__ = inspect.signature(AutoencoderKLHunyuanVideo.__init__)

    return AutoencoderKLHunyuanVideoFullAttention


#: class name -> builder of the derived class (imported lazily, like the diffusers classes)
VARIANTS = {"AutoencoderKLHunyuanVideoFullAttention": _hunyuan_video_full_attention}


def variant_class(name: str):
    """The derived class called ``name``, or ``None`` when no variant has that name."""
    build = VARIANTS.get(name)
    return None if build is None else build()
