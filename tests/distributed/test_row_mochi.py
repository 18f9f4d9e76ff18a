"""Mochi's VAE in row mode, beyond the all-family equivalence of test_row.py: the derived class PatchRay shards
(``AutoencoderKLMochiGenmo``, distributed/vae/variants.py) against diffusers' own ``AutoencoderKLMochi``, and the
refusal of diffusers' framewise decoding."""

import pytest
import torch

from patchray.distributed.context import ParallelContext
from patchray.distributed.vae.families import build_vae, resolve_class
from patchray.distributed.vae.row import parallelize_vae


def _pair():
    import diffusers

    ours = build_vae("mochi")
    theirs = diffusers.AutoencoderKLMochi(**{k: v for k, v in ours.config.items() if not k.startswith("_")})
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs.eval()


def test_the_derived_class_changes_only_the_frame_drop_and_the_encoder_mask():
    ours, theirs = _pair()
    assert resolve_class("mochi").__name__ == "AutoencoderKLMochiGenmo"
    g = torch.Generator().manual_seed(5)
    one = torch.randn(1, 8, 1, 3, 2, generator=g)
    clip = torch.randn(1, 8, 3, 3, 2, generator=g)
    frame = torch.rand(1, 3, 1, 24, 16, generator=g) * 2 - 1
    video = torch.rand(1, 3, 13, 24, 16, generator=g) * 2 - 1
    with torch.no_grad():
        a, b = ours.decode(clip).sample, theirs.decode(clip).sample
        assert a.shape == b.shape == (1, 3, 13, 24, 16)  # the same frame count: (T - 1) x 6 + 1
        # dropping frames inside the up blocks gives the early frames other causal context: a different video
        assert (a - b).abs().max() > 1e-2
        # one frame: attention over one key is mask-free, so the encoders agree exactly; a clip's do not
        assert torch.equal(ours.encode(frame).latent_dist.mean, theirs.encode(frame).latent_dist.mean)
        assert (ours.encode(video).latent_dist.mean - theirs.encode(video).latent_dist.mean).abs().max() > 1e-2
        assert ours.decode(one).sample.shape == (1, 3, 1, 24, 16)


def test_framewise_decoding_is_refused_by_name():
    vae = build_vae("mochi")
    vae._enable_framewise_decoding()  # diffusers' chunked decode: constant-padded convs with a temporal cache
    with pytest.raises(NotImplementedError, match="pad_mode='constant'.*whole clip"):
        parallelize_vae(vae, ParallelContext.single(), "decoder")
    assert not any("forward" in m.__dict__ for m in vae.modules())  # refused before anything was patched
