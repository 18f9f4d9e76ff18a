"""Row mode against the unsharded diffusers decode/encode, for every family, on real gloo ranks.

One 4-rank spawn runs every family (decode and encode) on sub-groups of N = 2, 3 and 4 ranks, plus each world
size's extra checks, so process start-up (importing diffusers) is paid once. References are computed once, in the
test process.

Tolerance: 1e-4 absolute on outputs in about [-1, 1] (fp32). The sharded computation differs from the
unsharded one only in summation order (GroupNorm statistics merged across ranks, attention over gathered
keys, convolutions on strips); measured differences are ~1e-5.
"""

import functools
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from patchray.distributed.comm import context_for_group, gather_to, log_comm
from patchray.distributed.context import ParallelContext
from patchray.distributed.spawn import run_ranks
from patchray.distributed.vae.families import FAMILIES, build_vae, latent_shape
from patchray.distributed.vae.row import parallelize_vae, row_bands, row_decode, row_encode

TOL = 1e-4
LATENT_HW = (7, 5)  # odd height and width; 7 rows give uneven bands at N = 2, 3 and 4
IMAGE_LATENT_HW = (7, 3)


def _tiny_channels(family):
    config = FAMILIES[family].tiny_config
    return config.get("latent_channels", config.get("z_dim", FAMILIES[family].latent_channels))


#: longer videos: Wan's two-frame feature caches, HunyuanVideo's framewise (temporal-tile) decode beyond 4 frames
LONG_VIDEO_FRAMES = {"wan": 3, "hunyuan_video": 6}
# whole clips beyond four latent frames (where diffusers' own HunyuanVideo class would tile in time)
LONG_VIDEO_FRAMES["hunyuan_video_full_attention"] = 6
# Mochi: every upsampling block drops its first frames, then the causal convolutions replicate the new first one
LONG_VIDEO_FRAMES["mochi"] = 3


def _latent(family, batch=2, seed=1, frames=2):
    spec = FAMILIES[family]
    shape = (batch, _tiny_channels(family)) + ((frames,) if spec.is_video else ()) + LATENT_HW
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


#: families that encode one frame per image only (the plain-Conv3d Hunyuan VAE repeats it to a four-frame clip)
ONE_FRAME_ENCODE = ("hunyuan_refiner_conv3d",)


def _image(family, batch=2, seed=2):
    spec = FAMILIES[family]
    r = spec.spatial_ratio
    frames = (1 if family in ONE_FRAME_ENCODE else 1 + spec.temporal_ratio,) if spec.is_video else ()
    shape = (batch, 3) + frames + (IMAGE_LATENT_HW[0] * r, IMAGE_LATENT_HW[1] * r)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _stats(vae, like):
    view = (1, -1) + (1,) * (like.dim() - 2)
    return vae.latents_mean.view(view), vae.latents_std.view(view)


def _decode_ref(vae, z):
    # diffusers' HunyuanVideo-1.5 attention broadcasts its [B, L, L] mask against the heads dim and fails for
    # batch > 1 (its own bug), so the references run sample by sample; row mode handles batches directly.
    kwargs = {}
    if vae.config.get("patchray_latents_normalized"):  # ComfyUI's LTX-Video: un-normalise, then decode
        mean, std = _stats(vae, z)
        z = z * std + mean
    if vae.config.get("timestep_conditioning"):  # and a timestep-conditioned decoder gets t = 0.05
        kwargs["temb"] = torch.tensor([0.05])
    return torch.cat([vae.decode(z[i : i + 1], **kwargs).sample for i in range(z.shape[0])])


def _encode_ref(vae, x):
    mean = torch.cat([vae.encode(x[i : i + 1]).latent_dist.mean for i in range(x.shape[0])])
    if vae.config.get("patchray_latents_normalized"):
        latents_mean, latents_std = _stats(vae, mean)
        mean = (mean - latents_mean) / latents_std
    return mean


@functools.lru_cache(maxsize=None)
def _references():
    refs = {}
    with torch.no_grad():
        for family in FAMILIES:
            vae = build_vae(family)
            refs[family] = (_decode_ref(vae, _latent(family)), _encode_ref(vae, _image(family)))
        for family, frames in LONG_VIDEO_FRAMES.items():
            refs["long", family] = _decode_ref(build_vae(family), _latent(family, batch=1, frames=frames))
    return refs


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of live CPU tensor storages allocated inside the block: a CPU stand-in for max_memory_allocated.

    Every op's fresh output storage is counted until the last tensor using it is collected; views count nothing.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages = {}

    def _release(self, key):
        entry = self._storages.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self._storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.untyped_storage().nbytes():
                continue
            key = t.untyped_storage().data_ptr()
            if key in self._storages:
                self._storages[key][1] += 1
            elif aliases:
                continue
            else:
                self._storages[key] = [t.untyped_storage().nbytes(), 1]
                self.live += self._storages[key][0]
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out


MEMORY_CASES = {"kl": 32, "flux2": 32, "qwen_image": 16, "hunyuan_video": 16, "hunyuan_video_15": 16, "ltx2": 8}
MEMORY_CASES.update({"hunyuan_image": 8, "hunyuan_image_refiner": 16, "hunyuan_video_full_attention": 16})


def _memory(ctx):
    """Peak live bytes of row_decode vs a plain decode of the same band (no adapters), per family."""
    out = {}
    for family, rows in MEMORY_CASES.items():
        vae = build_vae(family)
        spec = FAMILIES[family]
        z = torch.randn((1, _tiny_channels(family)) + ((2,) if spec.is_video else ()) + (rows, rows))
        start, stop = row_bands(rows, ctx.world_size)[ctx.rank]
        with torch.no_grad():
            sharded, band = _LiveBytes(), _LiveBytes()
            with sharded:
                row_decode(vae, z, ctx)
            with band:
                vae.decode(z[..., start:stop, :])
        out[family] = (sharded.peak, band.peak)
    return out


# ---------------------------------------------------------------------------------------------- rank tasks


def _errors(ctx):
    """Bad inputs: every rank reports (exception type, message)."""
    out = {}
    vae = build_vae("kl")
    cases = {
        "channels": lambda: row_decode(vae, torch.randn(1, 4, 8, 8), ctx),
        "rank_of_tensor": lambda: row_decode(vae, torch.randn(1, 16, 1, 8, 8), ctx),
        "too_few_rows": lambda: row_decode(vae, torch.randn(1, 16, ctx.world_size - 1, 8), ctx),
        "unknown_family": lambda: row_decode(torch.nn.Conv2d(16, 3, 3), torch.randn(1, 16, 8, 8), ctx),
        "image_not_divisible": lambda: row_encode(vae, torch.randn(1, 3, 60, 64), ctx),
    }
    bad = build_vae("kl")
    bad.decoder.conv_act = torch.nn.GELU()
    cases["uncovered_layer"] = lambda: row_decode(bad, torch.randn(1, 16, 8, 8), ctx)
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except Exception as exc:  # the test compares type and message across ranks
            out[name] = (type(exc).__name__, str(exc))
    # the refused VAE is unchanged and still decodes
    out["uncovered_left_unpatched"] = not any("forward" in m.__dict__ for m in bad.modules())
    return out


def _row_task(ctx, extras):
    result = {"decode": {}, "encode": {}}
    for family in FAMILIES:
        vae = build_vae(family)
        result["decode"][family] = row_decode(vae, _latent(family), ctx)
        result["encode"][family] = row_encode(vae, _image(family), ctx)
    if "comm" in extras:
        vae = build_vae("kl")
        with log_comm() as log:
            row_decode(vae, _latent("kl"), ctx)
        result["comm"] = log.to_dict()
    if "seams" in extras:
        # negative control: the same bands decoded without adapters (no halos, local statistics)
        vae = build_vae("kl")
        z = _latent("kl")
        bands = row_bands(z.shape[-2], ctx.world_size)
        start, stop = bands[ctx.rank]
        with torch.no_grad():
            out = vae.decode(z[..., start:stop, :]).sample
        result["seams"] = gather_to(out, ctx, 2, [8 * (b - a) for a, b in bands])
    if "low_precision" in extras:
        result["low_precision"] = {}
        for dtype in (torch.bfloat16, torch.float16):
            vae = build_vae("kl", dtype=dtype)
            result["low_precision"][str(dtype)] = row_decode(vae, _latent("kl"), ctx)
    if "long_video" in extras:
        result["long_video"] = {
            family: row_decode(build_vae(family), _latent(family, batch=1, frames=frames), ctx)
            for family, frames in LONG_VIDEO_FRAMES.items()
        }
    if "errors" in extras:
        result["errors"] = _errors(ctx)
    if "memory" in extras:
        result["memory"] = _memory(ctx)
    return result


def _to_numpy(obj):
    # run_ranks hands results back through a torch.multiprocessing queue, which shares tensors by file
    # descriptor: a rank that exits right after returning leaves the parent unable to open them. numpy
    # arrays travel by value.
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), obj.detach().float().numpy())
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    return obj


def _from_numpy(obj):
    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "tensor":
        return torch.from_numpy(obj[2]).to(getattr(torch, obj[1].split(".")[1]))
    if isinstance(obj, dict):
        return {k: _from_numpy(v) for k, v in obj.items()}
    return obj


_EXTRAS = {2: ("comm", "seams", "low_precision", "memory"), 3: ("long_video",), 4: ("errors",)}
WORLD_SIZES = tuple(_EXTRAS)


def _all_world_sizes(ctx):
    """Run the task on sub-groups of 2, 3 and 4 ranks inside one 4-rank spawn.

    Importing diffusers costs each fresh process ~10 s of CPU; one spawn instead of three saves most of it.
    """
    import torch.distributed as dist

    groups = {n: dist.new_group(list(range(n))) if n < ctx.world_size else ctx.group for n in WORLD_SIZES}
    out = {}
    for n, group in groups.items():
        if ctx.rank < n:
            sub = context_for_group(group, ctx.device)
            out[n] = _to_numpy(_row_task(sub, _EXTRAS[n]))
    return out


@functools.lru_cache(maxsize=None)
def _spawned():
    return run_ranks(_all_world_sizes, max(WORLD_SIZES))


def _run(world_size):
    """Per-rank results (group ranks 0..world_size-1) of the sub-group of ``world_size`` ranks."""
    return [_from_numpy(r[world_size]) for r in _spawned()[:world_size]]


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("half", ["decode", "encode"])
def test_row_mode_matches_unsharded(world_size, half):
    results = _run(world_size)
    refs = _references()
    for family in FAMILIES:
        ref = refs[family][0 if half == "decode" else 1]
        got = results[0][half][family]
        assert got is not None and got.shape == ref.shape, family
        # the reference must be a non-trivial tensor, or a match would prove nothing
        assert ref.std() > 1e-3, family
        diff = (got - ref).abs().max().item()
        assert diff <= TOL, f"{family} {half} at N={world_size}: max abs diff {diff:.3g}"
        for rank in range(1, world_size):
            assert results[rank][half][family] is None, f"{family}: rank {rank} got an output (only rank 0 should)"


def test_long_videos_keep_temporal_caches_and_framewise_decoding_exact():
    for family, got in _run(3)[0]["long_video"].items():
        ref = _references()["long", family]
        assert got.shape == ref.shape and (got - ref).abs().max() <= TOL, family


def test_world_size_one_equals_diffusers():
    ctx = ParallelContext.single()
    refs = _references()
    for family in ("kl", "wan", "ltx2"):
        vae = build_vae(family)
        assert (row_decode(vae, _latent(family), ctx) - refs[family][0]).abs().max() <= TOL
        assert (row_encode(vae, _image(family), ctx) - refs[family][1]).abs().max() <= TOL


def test_unadapted_bands_do_not_match():
    # the accuracy test can fail: plain per-band decodes (no halo, local GroupNorm) are far off at the seams
    seams = _run(2)[0]["seams"]
    assert (seams - _references()["kl"][0]).abs().max() > 100 * TOL


def test_output_is_gathered_once_and_no_metadata_collectives():
    vae = build_vae("kl")
    modules = list(vae.decoder.modules())
    group_norms = sum(isinstance(m, torch.nn.GroupNorm) for m in modules)
    attentions = sum(type(m).__name__ == "Attention" for m in modules)
    halo_convs = sum(isinstance(m, torch.nn.Conv2d) and m.kernel_size[0] > 1 for m in modules)
    resnets = sum(type(m).__name__ == "ResnetBlock2D" for m in modules)
    assert resnets and group_norms and attentions and halo_convs > 2 * resnets  # the counts below mean something
    for rank_result in _run(2):
        calls = rank_result["comm"]["calls"]
        # one output gather; ONE all_reduce per GroupNorm (its power sums) and one all_gather for K and V together;
        # one batched exchange per conv outside the resnet blocks and ONE per resnet block (its two convs share a
        # two-row halo); nothing else (no metadata collectives)
        assert calls == {"gather": 1, "all_reduce": group_norms, "all_gather": attentions,
                         "batch_isend_irecv": halo_convs - resnets}


def test_low_precision_runs_and_stays_close():
    lowp = _run(2)[0]["low_precision"]
    ref = _references()["kl"][0]
    for name, out in lowp.items():
        dtype = getattr(torch, name.split(".")[1])
        assert out.dtype == dtype and out.shape == ref.shape
        assert torch.isfinite(out).all()
        with torch.no_grad():
            single = build_vae("kl", dtype=dtype).decode(_latent("kl").to(dtype)).sample.float()
        # not an exactness check (bf16 keeps 8 mantissa bits, so the unsharded low-precision decode is itself
        # ~0.1 off fp32 here): row mode must not be materially worse than the unsharded decode of that dtype
        own_error = (single - ref).abs().max().item()
        assert (out.float() - ref).abs().max().item() <= 2 * own_error + 1e-3, name


def test_row_mode_holds_no_more_than_a_plain_band_decode():
    # CPU stand-in for the GPU memory criterion (per-rank peak <= 1.15x the band_1/N decode): counted by the
    # tensors' own sizes, so it catches extra band-sized copies (a concatenated halo, a second padding pass).
    # Rank 1 only: rank 0 also receives the gathered output, which dwarfs the tiny models' activations here
    # but not the full-size ones (measured on the GPU by row_memory).
    for family, (sharded, band) in _run(2)[1]["memory"].items():
        assert sharded <= 1.05 * band, f"{family}: row mode peak {sharded} B vs band decode {band} B"


def test_bad_inputs_raise_the_same_error_on_every_rank():
    results = [r["errors"] for r in _run(4)]
    first = results[0]
    for other in results[1:]:
        assert other == first
    assert first["channels"][0] == "ValueError" and "expects 16" in first["channels"][1]
    assert first["rank_of_tensor"][0] == "ValueError" and "4-D" in first["rank_of_tensor"][1]
    assert first["too_few_rows"][0] == "ValueError" and "at most 3 ranks" in first["too_few_rows"][1]
    assert first["unknown_family"][0] == "ValueError" and "known families" in first["unknown_family"][1]
    assert "kl" in first["unknown_family"][1]
    assert first["image_not_divisible"][0] == "ValueError" and "56x64" in first["image_not_divisible"][1]
    kind, message = first["uncovered_layer"]
    assert kind == "NotImplementedError" and "decoder.conv_act" in message and "GELU" in message
    assert first["uncovered_left_unpatched"]


def _snapshot(vae):
    return {k: (v.data_ptr(), v.dtype, tuple(v.shape)) for k, v in vae.state_dict().items()}


@pytest.mark.parametrize("family", ["kl", "wan", "hunyuan_video", "hunyuan_video_15", "ltx2"])
def test_remove_restores_the_model(family):
    vae = build_vae(family)
    z = _latent(family, batch=1)
    with torch.no_grad():
        before_out = vae.decode(z).sample
    before = _snapshot(vae)
    before_dict = set(vae.__dict__)
    handles = [parallelize_vae(vae, ParallelContext.single(), half) for half in ("decoder", "encoder")]
    patched = [m for m in vae.modules() if "forward" in m.__dict__ or m._forward_pre_hooks]
    assert patched, "the plan patched nothing"
    # adapters reuse the module's own parameters: the same tensors, nothing added
    assert _snapshot(vae) == before
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_vae(vae, ParallelContext.single(), "decoder")
    for h in handles:
        h.remove()
        h.remove()  # idempotent
    assert _snapshot(vae) == before
    assert set(vae.__dict__) == before_dict
    assert not [m for m in vae.modules() if "forward" in m.__dict__ or m._forward_pre_hooks]
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, before_out)


def test_latent_shape_matches_what_the_tiny_vae_encodes():
    for family in FAMILIES:
        spec = FAMILIES[family]
        x = _image(family, batch=1)
        frames = x.shape[2] if spec.is_video else 1
        want = latent_shape(family, x.shape[-2], x.shape[-1], frames=frames, size="tiny")
        assert tuple(_references()[family][1].shape[1:]) == want[1:], family
