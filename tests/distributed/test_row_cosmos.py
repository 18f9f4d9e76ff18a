"""The Cosmos tokenizer in row mode, beyond the all-family equivalence of test_row.py: the derived class PatchRay shards
(``AutoencoderKLCosmosLatentStats``, distributed/vae/variants.py) against diffusers' own ``AutoencoderKLCosmos``, a
model built on the meta device as the ranks build it, and the attention processors the adapter refuses."""

import pytest
import torch

from patchray.distributed.context import ParallelContext
from patchray.distributed.vae.families import build_vae, instantiate
from patchray.distributed.vae.row import parallelize_vae


def test_the_derived_class_adds_only_the_latent_statistics():
    import diffusers

    ours = build_vae("cosmos")
    config = {k: v for k, v in ours.config.items() if not k.startswith("_")}
    theirs = diffusers.AutoencoderKLCosmos(**config).eval()
    theirs.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("latent_")}, strict=True)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(1, ours.config.latent_channels, 2, 3, 2, generator=g)
    x = torch.rand(1, 3, 9, 24, 16, generator=g) * 2 - 1
    t = z.shape[2]
    mean = ours.latent_mean.view(z.shape[1], -1)[:, :t].reshape(1, -1, t, 1, 1)
    std = ours.latent_std.view(z.shape[1], -1)[:, :t].reshape(1, -1, t, 1, 1)
    assert std.std() > 1e-2  # build_vae gives the statistics non-trivial values
    with torch.no_grad():
        # the same network once the statistics are applied as the tokenizer applies them (sigma_data 0.5)
        assert (ours.decode(z).sample - theirs.decode(z / 0.5 * std + mean).sample).abs().max() < 1e-5
        assert (ours.encode(x).latent_dist.mode() - (theirs.encode(x).latent_dist.mode() - mean) / std * 0.5).abs().max() < 1e-5
        assert (ours.decode(z).sample - theirs.decode(z).sample).abs().max() > 1e-2


def test_a_model_built_on_the_meta_device_gets_its_haar_constants():
    ref = build_vae("cosmos")
    with torch.device("meta"):
        vae = instantiate("cosmos", dict(ref.config))
    vae.load_state_dict(ref.state_dict(), strict=True, assign=True)  # the Haar filters are not in the state dict
    z = torch.randn(1, ref.config.latent_channels, 2, 3, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(vae.eval().decode(z).sample, ref.decode(z).sample)


def test_an_unknown_attention_processor_is_refused_by_name():
    vae = build_vae("cosmos")
    attention = next(m for m in vae.decoder.modules() if type(m).__name__ == "CosmosCausalAttention")
    attention.processor = object()
    with pytest.raises(NotImplementedError, match="processor object"):
        parallelize_vae(vae, ParallelContext.single(), "decoder")
    assert not any("forward" in m.__dict__ for m in vae.modules())  # refused before anything was patched
