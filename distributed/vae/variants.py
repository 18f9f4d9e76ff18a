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
* ``AutoencoderKLMochiGenmo``: Mochi's VAE as genmo's release computes it (and ComfyUI, whose
  ``comfy/ldm/genmo/vae`` is that code): each upsampling block drops its first ``temporal_expansion - 1`` frames right
  after its depth-to-space step, so the next block's causal convolutions replicate the new first frame; diffusers'
  ``AutoencoderKLMochi`` keeps every frame through the decoder and drops ``temporal_compression_ratio - 1`` frames
  at the end, which computes the early frames from other context. The encoder's attention over the frames of each
  pixel is not causal in the release; diffusers masks it causally.
* ``AutoencoderKLHunyuanImageRefinerConv3d``: the 32-channel 16x Hunyuan VAE built without the refiner's causal
  convolutions (ComfyUI's ``vae_refiner.py`` with ``refiner_vae=False``): the refiner's modules with zero-padded,
  non-causal 3x3x3 convolutions, GroupNorm(32, eps 1e-6) where the refiner has RMS norms, resamplers that fold
  every pair of frames alike (no first-frame case), one input frame repeated to ``temporal_compression_ratio``
  frames before encoding, and only the last decoded frame kept when the latent holds one frame.
* ``AutoencoderKLCosmosLatentStats``: NVIDIA's Cosmos tokenizer (CV8x8x8) as released and as ComfyUI runs it: the
  model itself normalises its latent by per-(channel, frame) statistics (``latent_mean`` / ``latent_std``, 16 frames
  repeated along time) and ``sigma_data = 0.5``, in ``encode`` and ``decode``; diffusers' ``AutoencoderKLCosmos``
  leaves that to the pipeline. Every step is pointwise per (channel, frame), so a row band gets exactly what the
  whole latent would.
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


@functools.lru_cache(maxsize=None)
def _mochi_genmo() -> type:
    from diffusers import AutoencoderKLMochi
    from diffusers.models.autoencoders.autoencoder_kl_mochi import MochiUpBlock3D

    class MochiUpBlock3DFrameDrop(MochiUpBlock3D):
        """``MochiUpBlock3D`` that drops its first ``temporal_expansion - 1`` output frames (genmo's depth-to-space)."""

        def forward(self, hidden_states, conv_cache=None):
            hidden_states, new_conv_cache = super().forward(hidden_states, conv_cache=conv_cache)
            if self.temporal_expansion > 1:
                hidden_states = hidden_states[:, :, self.temporal_expansion - 1 :]
            return hidden_states, new_conv_cache

    class AutoencoderKLMochiGenmo(AutoencoderKLMochi):
        """``AutoencoderKLMochi`` with genmo's per-block frame drop and non-causal encoder attention (see module)."""

        def __init__(self, **config):
            super().__init__(**config)
            for block in self.decoder.up_blocks:
                block.__class__ = MochiUpBlock3DFrameDrop  # same parameters; only the forward changes
            for module in self.encoder.modules():
                if hasattr(module, "is_causal"):
                    module.is_causal = False
            self.drop_last_temporal_frames = False  # the up blocks dropped them already

        __init__.__signature__ = inspect.signature(AutoencoderKLMochi.__init__)

    return AutoencoderKLMochiGenmo


@functools.lru_cache(maxsize=None)
def _hunyuan_refiner_conv3d() -> type:
    import torch.nn as nn
    from diffusers import AutoencoderKLHunyuanImageRefiner
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as base

    class HunyuanImageRefinerUpsampleUniform(base.HunyuanImageRefinerUpsampleDCAE):
        """Depth-to-space over ``(frames, rows, columns)`` alike, with the repeating shortcut (no first-frame case)."""

        def forward(self, x):
            r1 = 2 if self.add_temporal_upsample else 1
            h = self._dcae_upsample_rearrange(self.conv(x), r1=r1, r2=2, r3=2)
            shortcut = self._dcae_upsample_rearrange(x.repeat_interleave(repeats=self.repeats, dim=1), r1=r1, r2=2, r3=2)
            return h + shortcut

    class HunyuanImageRefinerDownsampleUniform(base.HunyuanImageRefinerDownsampleDCAE):
        """Space-to-depth over ``(frames, rows, columns)`` alike, with the averaging shortcut (no first-frame case)."""

        def forward(self, x):
            r1 = 2 if self.add_temporal_downsample else 1
            h = self._dcae_downsample_rearrange(self.conv(x), r1=r1, r2=2, r3=2)
            shortcut = self._dcae_downsample_rearrange(x, r1=r1, r2=2, r3=2)
            b, _, t, hh, ww = shortcut.shape
            return h + shortcut.view(b, h.shape[1], self.group_size, t, hh, ww).mean(dim=2)

    class AutoencoderKLHunyuanImageRefinerConv3d(AutoencoderKLHunyuanImageRefiner):
        """The refiner's architecture with plain zero-padded 3-D convolutions and GroupNorm (see module)."""

        def __init__(self, **config):
            super().__init__(**config)
            for module in list(self.modules()):
                if isinstance(module, base.HunyuanImageRefinerCausalConv3d):
                    kt, kh, kw = module.conv.kernel_size
                    module.time_causal_padding = (kw // 2, kw // 2, kh // 2, kh // 2, kt // 2, kt // 2)
                    module.pad_mode = "constant"  # zeros on every side: nn.Conv3d(padding=k // 2)
                elif type(module) is base.HunyuanImageRefinerUpsampleDCAE:
                    module.__class__ = HunyuanImageRefinerUpsampleUniform
                elif type(module) is base.HunyuanImageRefinerDownsampleDCAE:
                    module.__class__ = HunyuanImageRefinerDownsampleUniform
                for name, child in list(module.named_children()):
                    if isinstance(child, base.HunyuanImageRefinerRMS_norm):
                        setattr(module, name, nn.GroupNorm(32, child.gamma.shape[0], eps=1e-6))

        __init__.__signature__ = inspect.signature(AutoencoderKLHunyuanImageRefiner.__init__)

        def _encode(self, x):
            if x.shape[2] == 1:  # one frame stands for a still clip of one latent frame's length
                x = x.expand(-1, -1, self.config.temporal_compression_ratio, -1, -1)
            return super()._encode(x)

        def _decode(self, z):
            dec = super()._decode(z)
            return dec[:, :, -1:] if z.shape[2] == 1 else dec

    return AutoencoderKLHunyuanImageRefinerConv3d


@functools.lru_cache(maxsize=None)
def _cosmos_latent_stats() -> type:
    import torch
    from diffusers import AutoencoderKLCosmos
    from diffusers.models.autoencoders import autoencoder_kl_cosmos as base
    from diffusers.models.autoencoders.vae import IdentityDistribution

    class _HaarConstants:
        """The Haar filters are constants of the class, kept as non-persistent buffers: a model built on the meta
        device (PatchRay's ranks) has them unallocated or uninitialised, so every call sets them first (two numbers)."""

        # diffusers' own table is a module-level tensor, made on the meta device when the module is first imported
        # under ``torch.device("meta")`` (as the ranks build models): the values are written out here
        _FILTERS = {"haar": (0.7071067811865476, 0.7071067811865476), "rearrange": (1.0, 1.0)}

        def forward(self, hidden_states):
            values = self._FILTERS[self.patch_method]
            self.wavelets = torch.tensor(values, device=hidden_states.device)  # the registered buffer, replaced
            self._arange = torch.arange(len(values), device=hidden_states.device)
            return super().forward(hidden_states)

    class CosmosPatchEmbed3dConstants(_HaarConstants, base.CosmosPatchEmbed3d):
        pass

    class CosmosUnpatcher3dConstants(_HaarConstants, base.CosmosUnpatcher3d):
        pass

    class LatentPosterior(IdentityDistribution):
        """The tokenizer's deterministic latent, answering ``mean`` and ``mode()`` alike."""

        @property
        def mean(self):
            return self.parameters

    class AutoencoderKLCosmosLatentStats(AutoencoderKLCosmos):
        """``AutoencoderKLCosmos`` with the tokenizer's own latent statistics inside encode/decode (see module)."""

        _stats_frames = 16  # the released tokenizer's statistics cover 16 latent frames, repeated along time
        sigma_data = 0.5

        def __init__(self, **config):
            super().__init__(**config)
            self.encoder.patch_embed.__class__ = CosmosPatchEmbed3dConstants
            self.decoder.unpatch_embed.__class__ = CosmosUnpatcher3dConstants
            n = self.config.latent_channels * self._stats_frames
            self.register_buffer("latent_mean", torch.zeros(n))
            self.register_buffer("latent_std", torch.ones(n))

        __init__.__signature__ = inspect.signature(AutoencoderKLCosmos.__init__)

        def _stats(self, like):
            channels, frames = like.shape[1], like.shape[2]
            view = lambda t: t.view(channels, -1).repeat(1, -(-frames // self._stats_frames))[:, :frames]  # noqa: E731
            shape = (1, channels, frames, 1, 1)
            return (view(self.latent_mean).reshape(shape).to(like), view(self.latent_std).reshape(shape).to(like))

        def _encode(self, x):
            z = super()._encode(x)
            mean, std = self._stats(z)
            return (z - mean) / std * self.sigma_data

        def encode(self, x, return_dict=True):
            out = super().encode(x, return_dict=return_dict)
            posterior = out.latent_dist if return_dict else out[0]
            posterior.__class__ = LatentPosterior  # also answers ``.mean``, as a KL posterior does
            return out

        def _decode(self, z, return_dict=True):
            mean, std = self._stats(z)
            return super()._decode(z / self.sigma_data * std + mean, return_dict=return_dict)

    return AutoencoderKLCosmosLatentStats


#: class name -> builder of the derived class (imported lazily, like the diffusers classes)
VARIANTS = {
    "AutoencoderKLHunyuanVideoFullAttention": _hunyuan_video_full_attention,
    "AutoencoderKLMochiGenmo": _mochi_genmo,
    "AutoencoderKLHunyuanImageRefinerConv3d": _hunyuan_refiner_conv3d,
    "AutoencoderKLCosmosLatentStats": _cosmos_latent_stats,
}


def variant_class(name: str):
    """The derived class called ``name``, or ``None`` when no variant has that name."""
    build = VARIANTS.get(name)
    return None if build is None else build()
