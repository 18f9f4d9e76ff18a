"""Weight sharding of blocks that hold 0-d (scalar) parameters: ComfyUI's scaled-fp8 layout, on 2 real gloo ranks.

ComfyUI loads a scaled-fp8 checkpoint (a ``scaled_fp8`` marker key and a ``scale_weight`` per layer) with
``comfy.ops.scaled_fp8_ops``: every Linear stores its weight (and bias) in float8_e4m3fn and holds ``scale_weight``
and ``scale_input`` as 0-d float32 parameters; the layer computes ``linear(x, weight * scale_weight, bias)`` in the
input's dtype. FSDP2 refuses 0-d parameters ("fully_shard doesn't support scalar parameters"), so before the fix
``sharding=blocks`` failed on every rank. The stand-in here has that layout without importing ComfyUI (its forward is
ComfyUI 0.3.64's non-fp8-matmul path), and the tests show: the scales stay whole on every rank (plain tensors with
their loaded values, on the rank's device, also with ``blocks+offload``), the weights stay fp8 in the shards and on
the wire, and a few sampling steps of the sharded model (in place, and built the node's way: a meta skeleton whose
weights arrive in parts) equal the unsharded ones bit for bit: no sequence split, so the same ops run on the same
bytes.
"""

from __future__ import annotations

import functools

import torch

from patchray.distributed.spawn import run_ranks

FP8 = torch.float8_e4m3fn


class ScaledFp8Linear(torch.nn.Module):
    """ComfyUI's ``scaled_fp8_op.Linear`` as loaded: fp8 weight and bias, 0-d float32 ``scale_weight`` and
    ``scale_input`` parameters; the weight is cast to the input's dtype and scaled per call."""

    def __init__(self, d_in, d_out, g=None, device=None):
        super().__init__()
        kw = {"device": device}
        self.weight = torch.nn.Parameter(torch.empty(d_out, d_in, dtype=FP8, **kw), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(d_out, dtype=FP8, **kw), requires_grad=False)
        self.scale_weight = torch.nn.Parameter(torch.ones((), dtype=torch.float32, **kw), requires_grad=False)
        self.scale_input = torch.nn.Parameter(torch.ones((), dtype=torch.float32, **kw), requires_grad=False)
        if g is not None:  # the checkpoint's way: weight / scale in fp8, the scale beside it
            w = torch.randn(d_out, d_in, generator=g) / d_in**0.5
            scale = w.abs().max() / 448.0 * (1 + torch.rand((), generator=g))
            with torch.no_grad():
                self.weight.copy_((w / scale).to(FP8))
                self.bias.copy_((0.1 * torch.randn(d_out, generator=g)).to(FP8))
                self.scale_weight.fill_(scale.item())

    def forward(self, x):
        w = self.weight.to(x.dtype)
        b = self.bias.to(x.dtype)
        s = self.scale_weight.to(device=x.device, dtype=x.dtype)
        if w.numel() < x.numel():
            return torch.nn.functional.linear(x, w * s, b)
        return torch.nn.functional.linear(x * s, w, b)


class ScaledNet(torch.nn.Module):
    """A DiT-like stand-in: an input layer, three blocks of scaled-fp8 layers with a float32 norm between them (mixed
    dtypes: FSDP2 gathers them as bytes), one block of scaled-fp8 layers only (all its shards fp8: gathered in float8,
    which comm sends as uint8), and a scaled-fp8 head outside the blocks (whole on every rank)."""

    def __init__(self, seed=5, device=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed) if device is None else None
        self.inp = torch.nn.Linear(12, 24, device=device)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(ScaledFp8Linear(24, 48, g, device), torch.nn.LayerNorm(48, device=device),
                                ScaledFp8Linear(48, 24, g, device)) for _ in range(3))
        self.blocks.append(torch.nn.Sequential(ScaledFp8Linear(24, 24, g, device)))
        self.head = ScaledFp8Linear(24, 12, g, device)
        if g is not None:
            with torch.no_grad():
                for blk in self.blocks[:3]:
                    blk[1].weight.copy_(1 + 0.2 * torch.randn(48, generator=g))
                    blk[1].bias.copy_(0.1 * torch.randn(48, generator=g))
                self.inp.weight.copy_(torch.randn(24, 12, generator=g) * 0.3)
                self.inp.bias.copy_(torch.randn(24, generator=g) * 0.1)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = torch.tanh(blk(h)) + h
        return self.head(h)


def _sample(net, x, steps=3):
    """A few Euler-like steps: every step gathers every block anew."""
    with torch.no_grad():
        for _ in range(steps):
            x = x - 0.25 * net(x)
    return x


def _scales(net):
    return {n: p for n, p in net.named_parameters() if p.dim() == 0}


def _task(ctx):
    from patchray.distributed import comm
    from patchray.distributed.parallel.shard import shard_model
    from patchray.distributed.sampling.ship import fill_tensors, materialize_meta, parts_by_bytes

    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(9))
    ref_net = ScaledNet()
    ref = _sample(ref_net, x)
    state = ref_net.state_dict()
    want_scales = {n: p.clone() for n, p in _scales(ref_net).items()}
    res = {}
    for offload in (False, True):
        for how in ("in place", "parts"):
            if how == "in place":
                net = ScaledNet()
                handle = shard_model(net, ctx, ["blocks.*"], offload=offload)
            else:  # the node's rank path: a meta skeleton, shards allocated (on the host with offload), weights in parts
                net = ScaledNet(device="meta")
                shard_dev = torch.device("cpu") if offload else ctx.device
                handle = shard_model(net, ctx, ["blocks.*"], offload=offload,
                                     init=lambda m, d=shard_dev: materialize_meta(m, ctx.device, d))
                for group in parts_by_bytes(((k, v.numel() * v.element_size()) for k, v in state.items()), 600):
                    fill_tensors(net, {k: state[k] for k in group}, ctx)
            handle.tally.reset()
            out = _sample(net, x)
            scales = _scales(net)
            res[(offload, how)] = {
                "equal": torch.equal(out, ref),
                "units": sum(comm.is_sharded(u) for _, u in handle.units),
                "scales_in_units": sum(1 for n in scales if n.startswith("blocks.")),
                "scales_plain": not any(comm.is_sharded_tensor(p) for p in scales.values()),
                "scales_equal": sorted(scales) == sorted(want_scales)
                and all(torch.equal(scales[n].detach().cpu(), want_scales[n]) for n in scales),
                "scale_devices": sorted({p.device.type for p in scales.values()}),
                "fp8_local": sorted({str(dt) for _, (_, _, dt) in handle.local_shapes().items() if "float8" in str(dt)}),
                "shard_names": sorted(handle.local_shapes()),
                "gathered": handle.tally.gathered,
                "sharded_bytes": handle.sharded_bytes,
                "calls": handle.tally.calls,
            }
    return res


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_task, 2)


def test_scaled_fp8_blocks_shard_and_sample_exactly():
    for rank, res in enumerate(_results()):
        for (offload, how), r in res.items():
            key = (rank, "blocks+offload" if offload else "blocks", how)
            # the same fp8 bytes gathered, the same scales, the same ops: bit-identical to the unsharded steps
            assert r["equal"], key
            assert r["units"] == 4, (key, r)
            # the scales stay whole on every rank with their loaded values (2 per layer, 7 layers in the blocks), on the
            # rank's device (its compute device, also with the shards in host memory)
            assert r["scales_in_units"] == 14 and r["scales_plain"] and r["scales_equal"], (key, r)
            assert r["scale_devices"] == ["cpu"], (key, r)
            assert not any(n.endswith(("scale_weight", "scale_input")) for n in r["shard_names"]), (key, r)
            # fp8 stays fp8 in the shards
            assert r["fp8_local"] == ["torch.float8_e4m3fn"], (key, r)


def test_scaled_fp8_blocks_gather_bytes_not_scales():
    for rank, res in enumerate(_results()):
        for key, r in res.items():
            # 3 steps, 4 blocks: one gather per block and step, of the blocks' bytes without the scales (one byte per
            # fp8 element; dim 0 even at 2 ranks: no padding)
            assert r["calls"] == 12, (rank, key, r)
            assert r["gathered"] == 3 * r["sharded_bytes"], (rank, key, r)
