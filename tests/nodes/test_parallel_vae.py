"""PatchRay Parallel VAE on real CPU Ray ranks: the stock nodes' own code (ComfyUI 0.3.64's VAE Decode, VAE Decode
(Tiled), VAE Encode, VAE Encode (Tiled), written out below) run on the Parallel VAE and on the VAE it was made from,
which is a stand-in of ``comfy.sd.VAE`` (its decode/encode contract around a one-process diffusers model, as in
test_vae_nodes.py). An image VAE (KL) and a video VAE (Wan 2.1, in ComfyUI's key layout). The comparison with
ComfyUI's own VAE class is the opt-in test tests/comfyui/test_parallel_vae_server.py."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from .comfy_shapes import ComfyLikeVAE
from .test_vae_nodes import _kl_vae

pytestmark = pytest.mark.usefixtures("ray_session")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "comfy_vae_layouts.json"
#: fp32 bounds, as in test_vae_nodes.py: a row decode is exact up to fp32 reassociation (within one 8-bit level of
#: the one-process decode); the row-sharded encode within 1e-4
IMAGE_TOL, LATENT_TOL = 1 / 255, 1e-4


# ---------------------------------------------------------------------------------------------- the stock nodes
# ComfyUI 0.3.64 nodes.py, the bodies of VAEDecode.decode, VAEDecodeTiled.decode, VAEEncode.encode and
# VAEEncodeTiled.encode, as written there (the widgets' defaults as their INPUT_TYPES give them)


def stock_vae_decode(vae, samples):
    images = vae.decode(samples["samples"])
    if len(images.shape) == 5:  # Combine batches
        images = images.reshape(-1, images.shape[-3], images.shape[-2], images.shape[-1])
    return (images,)


def stock_vae_decode_tiled(vae, samples, tile_size=512, overlap=64, temporal_size=64, temporal_overlap=8):
    if tile_size < overlap * 4:
        overlap = tile_size // 4
    if temporal_size < temporal_overlap * 2:
        temporal_overlap = temporal_overlap // 2
    temporal_compression = vae.temporal_compression_decode()
    if temporal_compression is not None:
        temporal_size = max(2, temporal_size // temporal_compression)
        temporal_overlap = max(1, min(temporal_size // 2, temporal_overlap // temporal_compression))
    else:
        temporal_size = None
        temporal_overlap = None

    compression = vae.spacial_compression_decode()
    images = vae.decode_tiled(samples["samples"], tile_x=tile_size // compression, tile_y=tile_size // compression,
                              overlap=overlap // compression, tile_t=temporal_size, overlap_t=temporal_overlap)
    if len(images.shape) == 5:  # Combine batches
        images = images.reshape(-1, images.shape[-3], images.shape[-2], images.shape[-1])
    return (images,)


def stock_vae_encode(vae, pixels):
    t = vae.encode(pixels[:, :, :, :3])
    return ({"samples": t},)


def stock_vae_encode_tiled(vae, pixels, tile_size=512, overlap=64, temporal_size=64, temporal_overlap=8):
    t = vae.encode_tiled(pixels[:, :, :, :3], tile_x=tile_size, tile_y=tile_size, overlap=overlap, tile_t=temporal_size,
                         overlap_t=temporal_overlap)
    return ({"samples": t},)


# ---------------------------------------------------------------------------------------------- the VAE stand-ins


class StockLikeVAE(ComfyLikeVAE):
    """``comfy.sd.VAE``'s contract (0.3.64) around a diffusers model: ``encode`` crops about the centre to the
    compression and lays a video VAE's frames out as one clip; the ratios, formulas and compression methods other
    nodes read; results float32 on ``output_device``. The tiled methods take ComfyUI's arguments, record them and
    decode/encode whole (ComfyUI's tiling maths is not under test; the frames ``encode_tiled`` keeps are)."""

    def __init__(self, model, ldm_sd, video=False):
        super().__init__(model, ldm_sd)
        self.latent_dim = 3 if video else 2
        self.not_video = False
        self.output_device = torch.device("cpu")
        if video:  # Wan 2.1's, comfy.sd.VAE.__init__
            self.upscale_ratio = (lambda a: max(0, a * 4 - 3), 8, 8)
            self.downscale_ratio = (lambda a: max(0, math.floor((a + 3) / 4)), 8, 8)
        else:
            self.upscale_ratio = self.downscale_ratio = 8
        self.tiled_calls = []
        self.encode_calls = 0
        self.vae_options = None

    def decode(self, samples_in, vae_options={}):  # noqa: B006  (ComfyUI's signature)
        self.vae_options = vae_options
        return super().decode(samples_in)

    def spacial_compression_decode(self):
        try:
            return self.upscale_ratio[-1]
        except TypeError:
            return self.upscale_ratio

    def spacial_compression_encode(self):
        try:
            return self.downscale_ratio[-1]
        except TypeError:
            return self.downscale_ratio

    def temporal_compression_decode(self):
        try:
            return round(self.upscale_ratio[0](8192) / 8192)
        except TypeError:
            return None

    def _layout(self, pixels):
        ratio = self.spacial_compression_encode()
        for d in (1, 2):
            n = pixels.shape[d]
            if n % ratio:
                pixels = pixels.narrow(d, (n % ratio) // 2, n // ratio * ratio)
        x = pixels.movedim(-1, 1)
        if self.latent_dim == 3 and x.ndim < 5:
            x = x.unsqueeze(2) if self.not_video else x.movedim(1, 0).unsqueeze(0)
        return x

    def encode(self, pixel_samples):
        self.encode_calls += 1
        with torch.no_grad():
            return self.model.encode(self._layout(pixel_samples) * 2.0 - 1.0).latent_dist.mean.float()

    def decode_tiled(self, samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        self.tiled_calls.append(("decode_tiled", tile_x, tile_y, overlap, tile_t, overlap_t))
        return self.decode(samples)

    def encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        self.tiled_calls.append(("encode_tiled", tile_x, tile_y, overlap, tile_t, overlap_t))
        x = self._layout(pixel_samples)
        if self.latent_dim == 3:  # comfy.sd.VAE.encode_tiled: whole temporal steps only
            x = x[:, :, : self.upscale_ratio[0](self.downscale_ratio[0](x.shape[2]))]
        with torch.no_grad():
            return self.model.encode(x * 2.0 - 1.0).latent_dist.mean.float()


def _stock_like(vae: ComfyLikeVAE, video=False) -> StockLikeVAE:
    return StockLikeVAE(vae.model, vae.first_stage_model.state_dict(), video=video)


@pytest.fixture(scope="module")
def kl():
    return _stock_like(_kl_vae(4))  # spatial ratio 8, like every KL VAE ComfyUI loads


@pytest.fixture(scope="module")
def wan():
    """A tiny Wan 2.1 VAE in ComfyUI's key layout (``comfy/ldm/wan/vae.py``, recorded in tests/fixtures): ComfyUI's
    key for each diffusers key is found by running diffusers' own Wan converter over those key names (they do not
    depend on the widths) and reading it backwards."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    keys = json.loads(FIXTURE.read_text())["wan21_qwen_image"]["shapes"]
    torch.manual_seed(5)
    model = AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    marks = {k: torch.empty(0) for k in keys}
    comfy_key = {id(v): k for k, v in marks.items()}
    diffusers_sd = model.state_dict()
    ldm = {comfy_key[id(v)]: diffusers_sd[k].clone() for k, v in convert_wan_vae_to_diffusers(dict(marks)).items()}
    assert len(ldm) == len(diffusers_sd)
    return StockLikeVAE(model, ldm, video=True)


@pytest.fixture(scope="module")
def cluster():
    from patchray.nodes.cluster import PatchRayCluster

    return PatchRayCluster.execute(num_ranks=2, device="cpu", address="", gpu_ids="").args[0]  # as test_vae_nodes.py


def _parallel(vae, cluster, **settings):
    from patchray.nodes.vae import PatchRayParallelVAE

    settings = {"mode": "row", "precision": "fp32", "gn_sync": False, **settings}
    return PatchRayParallelVAE.execute(vae=vae, cluster=cluster, **settings)


def _same(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32 and a.device == b.device, (a.shape, b.shape)
    assert (a - b).abs().max() <= tol, float((a - b).abs().max())


# ---------------------------------------------------------------------------------------------- the image VAE


def test_the_stock_nodes_on_the_parallel_vae_give_what_they_give_on_the_vae(cluster, kl, tmp_path):
    out = _parallel(kl, cluster)
    fast = out.args[0]
    assert out.ui is None  # nothing differs from the request: no note
    z = torch.randn(2, 4, 12, 10, generator=torch.Generator().manual_seed(0))
    pixels = torch.rand(2, 100, 84, 4, generator=torch.Generator().manual_seed(1))  # RGBA, not multiples of 8
    before = fast.decode_calls, fast.encode_calls

    decoded = fast.decode(z)  # what VAE.decode returns: [B, H, W, C] float32 on the output device
    _same(decoded, kl.decode(z), IMAGE_TOL)
    assert decoded.shape == (2, 96, 80, 3)
    _same(stock_vae_decode(fast, {"samples": z})[0], stock_vae_decode(kl, {"samples": z})[0], IMAGE_TOL)
    # the tiled node decodes whole on the ranks: the untiled image (row mode is exact), not blended tiles
    _same(stock_vae_decode_tiled(fast, {"samples": z}, tile_size=64, overlap=32)[0], kl.decode(z), IMAGE_TOL)
    latent = stock_vae_encode(fast, pixels)[0]["samples"]
    _same(latent, stock_vae_encode(kl, pixels)[0]["samples"], LATENT_TOL)
    assert latent.shape == (2, 4, 12, 10)
    _same(stock_vae_encode_tiled(fast, pixels, tile_size=64, overlap=0)[0]["samples"], kl.encode(pixels[..., :3]), LATENT_TOL)

    # none of that ran the stand-in's own (one-process) methods on the Parallel VAE: the ranks did it all (the runtime
    # exactness check's one stock decode of a small crop, on the first decode of this layout, ran on the plain VAE)
    assert (fast.decode_calls, fast.encode_calls) == before and not fast.tiled_calls
    assert "VAE " in (tmp_path / "patchray-cache" / "exactness.json").read_text()


def test_the_parallel_vae_decodes_what_the_distributed_vae_decode_node_decodes(cluster, kl):
    from patchray.nodes.vae import PatchRayVAEDecode, PatchRayVAEEncode

    z = torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(2))
    node = PatchRayVAEDecode.execute(samples={"samples": z}, vae=kl, cluster=cluster, mode="row", precision="fp32", gn_sync=False)
    fast = _parallel(kl, cluster).args[0]
    # one decode on the same ranks with the same settings: the same image, bit for bit
    assert torch.equal(stock_vae_decode(fast, {"samples": z})[0], node.args[0])
    pixels = torch.rand(1, 64, 48, 3, generator=torch.Generator().manual_seed(3))
    node = PatchRayVAEEncode.execute(pixels=pixels, vae=kl, cluster=cluster, precision="fp32")
    assert torch.equal(fast.encode(pixels), node.args[0]["samples"])


def test_the_input_vae_is_unchanged_and_its_weights_are_shared(cluster, kl):
    attrs = dict(vars(kl))
    fast = _parallel(kl, cluster).args[0]
    assert fast is not kl and type(kl) is StockLikeVAE and isinstance(fast, StockLikeVAE)
    assert dict(vars(kl)) == attrs and all(vars(kl)[k] is v for k, v in attrs.items())  # no attribute rebound or added
    assert "decode" not in vars(kl) and "decode" not in vars(fast)  # methods come from the classes, none patched in
    # the same weights, not copies: ComfyUI's module (first_stage_model) and every tensor of it
    assert fast.first_stage_model is kl.first_stage_model and fast.model is kl.model
    ours, theirs = fast.first_stage_model.state_dict(), kl.first_stage_model.state_dict()
    assert all(ours[k].data_ptr() == theirs[k].data_ptr() for k in theirs)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(fast.model.parameters(), kl.model.parameters()))
    # what other nodes read from a VAE is the VAE's
    assert (fast.spacial_compression_decode(), fast.temporal_compression_decode(), fast.latent_dim) == (8, None, 2)
    # and the input VAE still decodes on its own, as the stock node does it
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    calls = kl.decode_calls
    kl.decode(z)
    assert kl.decode_calls == calls + 1


def test_a_vae_class_without_tiled_methods_still_decodes_tiled_on_the_ranks(cluster):
    """ComfyUI's own method is looked up only when a call falls back: a VAE-like class with decode/encode alone (the
    plain stand-in of test_vae_nodes.py) serves the tiled nodes too."""
    vae = _kl_vae(4)
    assert not hasattr(vae, "decode_tiled")
    fast = _parallel(vae, cluster).args[0]
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(8))
    _same(fast.decode_tiled(z, tile_x=4, tile_y=4, overlap=1), vae.decode(z).contiguous(), IMAGE_TOL)


def test_a_parallel_vae_given_again_is_made_from_the_vae_it_came_from(cluster, kl):
    from patchray.nodes.bridge.vae import plain_vae

    first = _parallel(kl, cluster, mode="row").args[0]
    second = _parallel(first, cluster, mode="auto").args[0]
    assert plain_vae(second) is kl and type(second) is type(first) and second._patchray.mode == "auto"
    assert first._patchray.mode == "row"  # the first one keeps its own settings


def test_progress_and_cancel_hooks_are_asked_for_at_each_decode(cluster, kl):
    from patchray.nodes.bridge.parallel_vae import Hooks, parallel_vae

    asked, figures = [], []
    hooks = Hooks(cancel_check=lambda: asked.append("cancel") or (lambda: None),
                  progress=lambda: asked.append("progress") or (lambda done, total: figures.append((done, total))))
    fast = parallel_vae(kl, cluster, mode="row", precision="fp32", hooks=hooks).value
    assert asked == []  # nothing runs at patch time
    fast.decode(torch.randn(1, 4, 8, 8))
    assert sorted(asked) == ["cancel", "progress"] and figures[-1] == (1, 1)


# ---------------------------------------------------------------------------------------------- the video VAE


def test_a_video_vae_decodes_and_encodes_clips_as_the_stock_nodes_expect(cluster, wan):
    fast = _parallel(wan, cluster).args[0]
    z = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    decoded = fast.decode(z)
    _same(decoded, wan.decode(z), IMAGE_TOL)
    assert decoded.shape == (1, 9, 64, 64, 3)  # [B, T, H, W, C], as VAE.decode returns a video
    images = stock_vae_decode(fast, {"samples": z})[0]
    _same(images, stock_vae_decode(wan, {"samples": z})[0], IMAGE_TOL)
    assert images.shape == (9, 64, 64, 3)  # the stock node folds the frames into the batch
    _same(stock_vae_decode_tiled(fast, {"samples": z}, tile_size=256, overlap=64, temporal_size=8, temporal_overlap=4)[0],
          images, IMAGE_TOL)

    clip = images[..., :3].contiguous()
    latent = stock_vae_encode(fast, clip)[0]["samples"]
    _same(latent, stock_vae_encode(wan, clip)[0]["samples"], LATENT_TOL)
    assert latent.shape == (1, 4, 3, 8, 8)
    # encode_tiled encodes the frames the stock one does: 10 frames are 2 whole steps of 4 after the first, 9 frames
    longer = torch.cat([clip, clip[-1:]])
    tiled = stock_vae_encode_tiled(fast, longer, temporal_size=8, temporal_overlap=4)[0]["samples"]
    _same(tiled, stock_vae_encode_tiled(wan, longer, temporal_size=8, temporal_overlap=4)[0]["samples"], LATENT_TOL)
    assert tiled.shape == (1, 4, 3, 8, 8)
    assert [c[0] for c in wan.tiled_calls] == ["encode_tiled"]  # the reference call above; the Parallel VAE made none


# ---------------------------------------------------------------------------------------------- what runs as stock


def _unsupported():
    vae = _stock_like(_kl_vae(2))
    vae.first_stage_model._sd = {"taesd_decoder.1.weight": torch.zeros(64, 4, 3, 3)}  # a VAE PatchRay cannot shard
    return vae


def test_a_vae_patchray_cannot_shard_runs_as_stock_with_the_reason_on_the_node_and_in_the_log(cluster, caplog):
    vae = _unsupported()
    with caplog.at_level(logging.WARNING):
        out = _parallel(vae, cluster, mode="auto", precision="auto")
    assert "cannot shard" in out.ui.value and "TAESD" in out.ui.value  # the node's panel, at patch time
    fast = out.args[0]
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(7))
    caplog.clear()
    calls = fast.decode_calls  # ComfyUI's method runs on the Parallel VAE itself (super()), so its counter counts
    with caplog.at_level(logging.WARNING):
        image = fast.decode(z)
    assert fast.decode_calls == calls + 1 and torch.equal(image, vae.decode(z))
    assert any("cannot shard" in r.getMessage() for r in caplog.records)  # and the log, at each decode
    # the tiled and encode calls reach the VAE's own methods with the caller's arguments
    fast.decode_tiled(z, tile_x=8, tile_y=8, overlap=2, tile_t=None, overlap_t=None)
    assert fast.tiled_calls[-1] == ("decode_tiled", 8, 8, 2, None, None)
    pixels = torch.rand(1, 32, 32, 3)
    assert torch.equal(fast.encode(pixels), vae.encode(pixels))
    fast.encode_tiled(pixels, tile_x=512, tile_y=512, overlap=64, tile_t=64, overlap_t=8)
    assert fast.tiled_calls[-1] == ("encode_tiled", 512, 512, 64, 64, 8)


def test_calls_the_ranks_cannot_take_run_as_stock_with_a_warning(cluster, kl, caplog):
    fast = _parallel(kl, cluster).args[0]
    z = torch.randn(1, 4, 8, 8)
    calls = fast.decode_calls
    with caplog.at_level(logging.WARNING):
        image = fast.decode(z, vae_options={"num_chunks": 8})  # options for the model's decode, as Hunyuan3D's node passes
    assert fast.decode_calls == calls + 1 and fast.vae_options == {"num_chunks": 8} and "vae_options" in caplog.text
    assert torch.equal(image, kl.decode(z))
    caplog.clear()
    calls = fast.encode_calls
    clips = torch.rand(2, 8, 16, 16, 3)  # not an IMAGE batch: ComfyUI's own encode decides what it means; an image
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError):  # VAE refuses it (here diffusers' shape check)
        fast.encode(clips)
    assert fast.encode_calls == calls + 1 and "not an IMAGE batch" in caplog.text


def test_a_plan_row_mode_does_not_use_is_noted_on_the_node(cluster, kl):
    from patchray.nodes.planner import PatchRayTilePlanner

    plan = PatchRayTilePlanner.execute(family="kl", width=128, height=256, frames=1, ranks=2, choice="coarse").args[0]
    out = _parallel(kl, cluster, mode="row", plan=plan)
    assert "plan is unused" in out.ui.value and out.args[0]._patchray.plan is None


# ---------------------------------------------------------------------------------------------- refusals


def _untouched_cluster():
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=2, device="cpu", init_timeout_s=119.0)  # a config no test starts


@pytest.mark.parametrize(
    "vae, cluster_of, settings, error, words",
    [
        ("a string", "config", {}, TypeError, "PatchRay Parallel VAE: 'vae' must be ComfyUI's VAE (from Load VAE or a checkpoint loader), got str"),
        ("kl", "a string", {}, TypeError, "PatchRay Parallel VAE: 'cluster' must come from a PatchRay Cluster node (got str)"),
        ("kl", "config", {"mode": "rows"}, ValueError, "PatchRay Parallel VAE: 'mode' must be one of auto, row, tile-runs (got 'rows')"),
        ("kl", "config", {"balance": "fastest"}, ValueError, "PatchRay Parallel VAE: 'balance' must be one of equal, speed"),
        ("kl", "config", {"precision": "fp8"}, ValueError, "PatchRay Parallel VAE: precision must be auto, fp32, bf16 or fp16"),
        ("kl", "config", {"plan": {"tiles": 3}}, TypeError, "PatchRay Parallel VAE: the plan input must come from PatchRay Tile Planner"),
        ("empty", "config", {}, TypeError, "PatchRay Parallel VAE: 'vae' holds no VAE weights"),
    ],
)
def test_bad_input_is_refused_in_the_nodes_terms_before_any_rank_starts(kl, vae, cluster_of, settings, error, words):
    from patchray.distributed.cluster import registry

    if vae == "kl":
        vae = kl
    elif vae == "empty":  # a checkpoint without a VAE: ComfyUI's VAE object with no model
        vae = _stock_like(_kl_vae(2))
        vae.first_stage_model = None
    config = _untouched_cluster() if cluster_of == "config" else cluster_of
    before = registry._current
    with pytest.raises(error) as info:
        _parallel(vae, config, **settings)
    assert str(info.value).startswith(words), str(info.value)
    assert registry._current is before, "no cluster was started"


def test_a_latent_the_ranks_cannot_decode_is_refused_naming_the_parallel_vae(kl):
    from patchray.distributed.cluster import registry

    fast = _parallel(kl, _untouched_cluster()).args[0]
    before = registry._current
    with pytest.raises(ValueError) as info:
        fast.decode(torch.randn(1, 4, 1, 8))  # one latent row for two ranks
    assert str(info.value).startswith("PatchRay Parallel VAE: 'samples' has 1 latent rows, fewer than the 2 ranks"), str(info.value)
    assert registry._current is before


# ---------------------------------------------------------------------------------------------- the schema


def test_the_inputs_are_the_distributed_vae_decodes():
    from patchray.nodes.vae import PatchRayParallelVAE, PatchRayVAEDecode

    schema = PatchRayParallelVAE.define_schema()
    inputs = {i.id: i for i in schema.inputs}
    # written out here, not read from the code under test
    assert list(inputs) == ["vae", "cluster", "mode", "precision", "gn_sync", "plan", "balance"]
    assert (list(inputs["mode"].options), inputs["mode"].default) == (["auto", "row", "tile-runs"], "auto")
    assert (list(inputs["precision"].options), inputs["precision"].default) == (["auto", "fp32", "bf16", "fp16"], "auto")
    assert (list(inputs["balance"].options), inputs["balance"].default) == (["equal", "speed"], "equal")
    assert inputs["gn_sync"].default is False
    assert [k for k, i in inputs.items() if i.optional] == ["plan", "balance"]
    assert [(i.id, i.io_type) for i in schema.inputs[:2]] == [("vae", "VAE"), ("cluster", "PATCHRAY_CLUSTER")]
    assert inputs["plan"].io_type == "PATCHRAY_TILE_PLAN"
    # and the same as the Distributed VAE Decode's, widget for widget
    decode = {i.id: i for i in PatchRayVAEDecode.define_schema().inputs if i.id != "samples"}
    assert list(decode) == list(inputs)
    for name, ours in inputs.items():
        theirs = decode[name]
        for field in ("io_type", "optional", "tooltip", "default", "options"):
            assert getattr(ours, field, None) == getattr(theirs, field, None), (name, field)
    (output,) = schema.outputs
    assert output.io_type == "VAE" and "tiled" in output.tooltip.lower()
    assert "tile sizes are not used" in schema.description


# ---------------------------------------------------------------------------------------------- the row-tiled retry


def test_a_row_tiled_retry_is_logged(kl, caplog):
    """The cluster's per-rank memory cap (test_vae_robust.py: 8 MiB) makes a 32x16 latent's row decode run out of
    memory, so the decode retries row-tiled: the stock node gets the image, the log says why it is row-tiled."""
    from patchray.distributed.cluster import ClusterConfig

    from ..conftest import TEST_PYTHONPATH

    capped = ClusterConfig(num_ranks=2, device="cpu", rank_memory_mb=8, extra_pythonpath=(TEST_PYTHONPATH,))
    fast = _parallel(kl, capped).args[0]
    z = torch.randn(1, 4, 32, 16, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING):
        image = stock_vae_decode(fast, {"samples": z})[0]
    assert image.shape == (1, 256, 128, 3)
    assert any(r.getMessage().startswith("PatchRay Parallel VAE: ") and "row-tiled" in r.getMessage() for r in caplog.records)
