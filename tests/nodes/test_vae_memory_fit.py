"""The VAE nodes' host-memory refusal follows the decode's shape and says what fits, before any rank starts.

ComfyUI 0.3.64's own estimates (comfy/sd.py, ``VAE.memory_used_decode`` / ``memory_used_encode``) are written out here
by hand for the two kinds of video VAE: Wan 2.1 decodes one latent frame at a time with a feature cache (ComfyUI's
figure is per chunk: no frame count in it), HunyuanVideo decodes the whole clip at once (its figure grows with the
frames). The measured peaks of CPU ranks behind the check are in results/cpu-vae-memory/: their live tensors reached
0.66-0.73 of ComfyUI's figure for Wan 2.1 and 0.55-0.68 for HunyuanVideo, so the check counts 0.75 and 0.7 of it for
those decodes (written out below, beside the frames counted twice).
"""

from types import SimpleNamespace

import pytest
import torch

GIB = 2**30


def _cpu_cluster():
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=2, device="cpu")


def _size(dtype):
    return torch.empty((), dtype=dtype).element_size()


class _Wan21:
    """What the decode check reads of ComfyUI's Wan 2.1 VAE object (comfy/sd.py, 0.3.64)."""

    upscale_ratio = (lambda a: max(0, a * 4 - 3), 8, 8)
    upscale_index_formula = (4, 8, 8)

    @staticmethod
    def memory_used_decode(shape, dtype):
        return 7000 * shape[3] * shape[4] * (8 * 8) * _size(dtype)

    @staticmethod
    def memory_used_encode(shape, dtype):
        return 6000 * shape[3] * shape[4] * _size(dtype)


class _HunyuanVideo:
    """What the checks read of ComfyUI's HunyuanVideo VAE object (comfy/sd.py, 0.3.64: the 3-D AutoencoderKL)."""

    upscale_ratio = (lambda a: max(0, a * 4 - 3), 8, 8)
    upscale_index_formula = (4, 8, 8)

    @staticmethod
    def memory_used_decode(shape, dtype):
        return 1500 * shape[2] * shape[3] * shape[4] * (4 * 8 * 8) * _size(dtype)

    @staticmethod
    def memory_used_encode(shape, dtype):
        return 900 * max(shape[2], 2) * shape[3] * shape[4] * _size(dtype)


@pytest.fixture
def free_memory(monkeypatch):
    """Set what this machine reports free (the checks read ``limits.this_machine()``), in bytes."""
    import patchray.distributed.cluster.limits as limits

    def set_free(available):
        monkeypatch.setattr(limits, "this_machine", lambda: SimpleNamespace(available_bytes=available, gpus=0))

    return set_free


def _decode_check(vae, family, latent):
    from patchray.nodes.bridge import vae as bridge_vae

    spec = SimpleNamespace(family=family, config={})
    bridge_vae._check_decode_memory(vae, {"samples": latent}, latent, spec, torch.float32, _cpu_cluster())


def test_a_long_wan_clip_that_fits_per_chunk_is_not_refused(free_memory):
    """480x832 px, 161 frames (41 latent frames): ComfyUI's per-chunk figure (10.4 GiB, 0.75 of it counted) plus the
    frames (0.72 GiB, counted twice) is 9.3 GiB; 10 GiB free holds it, as it holds 5 frames (the decode's peak does not
    grow with the frames beyond the frames themselves)."""
    long_clip = torch.zeros(1, 16, 41, 60, 104)
    free_memory(10 * GIB)
    _decode_check(_Wan21, "wan", long_clip)
    _decode_check(_Wan21, "wan", long_clip[:, :, :2])
    # 7.9 GiB: the per-chunk figure (7.8 GiB counted) and a few frames fit
    need = lambda t: 7000 * 60 * 104 * 64 * 4 * 3 // 4 + 2 * (4 * t - 3) * 480 * 832 * 12  # noqa: E731
    fit = max(t for t in range(1, 42) if need(t) <= int(7.9 * GIB))
    assert 4 * fit - 3 == 9
    free_memory(int(7.9 * GIB))
    with pytest.raises(ValueError, match="holds about 9 frame"):
        _decode_check(_Wan21, "wan", long_clip)


def test_a_clip_that_does_not_fit_is_refused_with_the_frames_that_do(free_memory):
    """The shipped HunyuanVideo workflow's size, 848x480 px, 73 frames (19 latent frames): whole-clip decode, ComfyUI's
    figure grows with the frames; on 20 GiB free the node names the most frames that fit, counted by hand below."""
    latent = torch.zeros(1, 16, 19, 60, 106)
    free_memory(20 * GIB)
    with pytest.raises(ValueError) as info:
        _decode_check(_HunyuanVideo, "hunyuan_video", latent)
    msg = str(info.value)
    # need(t latent frames) = 0.7 x 1500 * t * 60 * 106 * 256 * 4 + 2 * frames(t) * 480 * 848 * 12
    need = lambda t: 1500 * t * 60 * 106 * 256 * 4 * 7 // 10 + 2 * (4 * t - 3) * 480 * 848 * 12  # noqa: E731
    fit = max(t for t in range(1, 20) if need(t) <= 20 * GIB)
    assert (fit, 4 * fit - 3) == (3, 9)
    assert msg.startswith("PatchRay Distributed VAE Decode: 'samples' is 1 x 73 frame(s) of 848x480 px to decode"), msg
    assert f"about {need(19) / GIB:.1f} GiB" in msg, msg
    assert "at 848x480 px this machine's free memory holds about 9 frame(s) per call: decode at most that many" in msg, msg
    assert "shorter length" in msg and "use GPU ranks (device on the PatchRay Cluster node)" in msg, msg
    assert "bf16" not in msg  # CPU bf16 convolutions are many times slower: not advice for CPU ranks


def test_when_not_even_one_frame_fits_a_smaller_image_is_named(free_memory):
    latent = torch.zeros(1, 16, 19, 60, 106)
    free_memory(2 * GIB)
    with pytest.raises(ValueError, match=r"even one frame at 848x480 px needs about 6\.\d GiB: decode a smaller image \(about \d+x\d+ px or less\)"):
        _decode_check(_HunyuanVideo, "hunyuan_video", latent)


def test_the_encode_names_the_frames_that_fit(free_memory):
    """The HunyuanVideo workflow's encode (73 frames of 848x480 px) comes first in it: refused naming 4k + 1 frames."""
    from patchray.nodes.bridge import vae as bridge_vae

    pixels = torch.zeros(()).expand(73, 480, 848, 3)  # shapes only: the check reads sizes, not values
    x = torch.zeros(()).expand(1, 3, 73, 480, 848)
    free_memory(20 * GIB)
    with pytest.raises(ValueError) as info:
        bridge_vae._check_encode_memory(_HunyuanVideo, pixels, x, torch.float32, _cpu_cluster())
    msg = str(info.value)
    need = lambda f: 900 * max(f, 2) * 480 * 848 * 4 // 2 + 2 * f * 480 * 848 * 3 * 4  # noqa: E731
    fit = max(f for f in range(1, 74, 4) if need(f) <= 20 * GIB)
    assert msg.startswith("PatchRay Distributed VAE Encode: 'pixels' is 73 frame(s) of 848x480 px to encode"), msg
    assert f"holds about {fit} frame(s) per call: encode at most that many" in msg, msg


def test_the_encode_names_frames_whose_decode_fits_too(free_memory):
    """The encode's advice and the decode after it agree: the frame count the encode names is one the decode of its
    latent accepts on the same free memory (HunyuanVideo's whole-clip decode needs far more than its encode: at 848x480
    px on 20 GiB the encode alone would hold 25 frames, the decode 9)."""
    import re

    from patchray.nodes.bridge import vae as bridge_vae
    from patchray.nodes.bridge.vae_layouts import LAYOUTS

    family = next(row.family for row in LAYOUTS if row.name == "HunyuanVideo VAE")  # what the node sees
    spec = SimpleNamespace(family=family, config={})
    pixels = torch.zeros(()).expand(73, 480, 848, 3)
    x = torch.zeros(()).expand(1, 3, 73, 480, 848)
    free_memory(20 * GIB)
    with pytest.raises(ValueError) as info:
        bridge_vae._check_encode_memory(_HunyuanVideo, pixels, x, torch.float32, _cpu_cluster(), spec=spec)
    msg = str(info.value)
    named = int(re.search(r"holds about (\d+) frame\(s\) per call: encode at most that many", msg).group(1))
    assert "that count leaves room for decoding them" in msg, msg
    # the decode's own count on 20 GiB, by hand (test_a_clip_that_does_not_fit_is_refused_with_the_frames_that_do)
    assert named == 9, msg
    _decode_check(_HunyuanVideo, family, torch.zeros(1, 16, (named - 1) // 4 + 1, 60, 106))  # accepted
    with pytest.raises(ValueError):  # and the next 4k + 1 count is not
        _decode_check(_HunyuanVideo, family, torch.zeros(1, 16, (named - 1) // 4 + 2, 60, 106))


def test_the_encode_of_an_image_batch_names_images_whose_decode_fits_too(free_memory):
    """The same for a batch of images with the KL VAE, whose decode estimate (2178 x 64 per latent element) is above
    its encode's (1767 per pixel): the batch size the encode names decodes on the same free memory."""
    import re

    from patchray.nodes.bridge import vae as bridge_vae

    class _KL:
        upscale_ratio = 8
        upscale_index_formula = None

        @staticmethod
        def memory_used_decode(shape, dtype):
            return 2178 * shape[2] * shape[3] * 64 * _size(dtype)

        @staticmethod
        def memory_used_encode(shape, dtype):
            return 1767 * shape[2] * shape[3] * _size(dtype)

    spec = SimpleNamespace(family="kl", config={})
    pixels = torch.zeros(()).expand(64, 1024, 1024, 3)
    x = torch.zeros(()).expand(64, 3, 1024, 1024)
    # encode alone: 0.5 x 1767 x 4 + 24 = 3558 B per pixel; decode: 0.5 x 2178 x 4 + 24 = 4380 B per pixel
    free_memory(int(4380 * 2**20 * 20.5))  # 20 images decode, 25 encode
    with pytest.raises(ValueError) as info:
        bridge_vae._check_encode_memory(_KL, pixels, x, torch.float32, _cpu_cluster(), spec=spec)
    msg = str(info.value)
    named = int(re.search(r"holds about (\d+) image\(s\) per call: encode at most that many", msg).group(1))
    assert named == 20, msg
    _decode_check(_KL, "kl", torch.zeros(named, 4, 128, 128))
    with pytest.raises(ValueError):
        _decode_check(_KL, "kl", torch.zeros(named + 1, 4, 128, 128))


def test_the_family_comfyuis_hunyuan_video_vae_converts_to_is_counted_at_its_measured_share(free_memory):
    """The node sees the family the layout table converts ComfyUI's HunyuanVideo VAE to (whole-clip decode with
    full attention), not the library's causal ``hunyuan_video``: the measured share (0.7, results/cpu-vae-memory/, run
    on ComfyUI's own class) must apply to that family, so the node names 9 frames on 20 GiB, as counted by hand in
    test_a_clip_that_does_not_fit_is_refused_with_the_frames_that_do (at 0.5 it would name 13)."""
    from patchray.nodes.bridge.vae_layouts import LAYOUTS

    family = next(row.family for row in LAYOUTS if row.name == "HunyuanVideo VAE")
    free_memory(20 * GIB)
    with pytest.raises(ValueError, match="holds about 9 frame"):
        _decode_check(_HunyuanVideo, family, torch.zeros(1, 16, 19, 60, 106))
