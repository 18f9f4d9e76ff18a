"""Weight sharding (FSDP2 per block) composed with sequence parallelism, on real gloo ranks.

With every block sharded over the same ranks as the token shards, the full_sync (exact K/V) forward of diffusers'
FLUX.1 and Wan classes (and Qwen-Image, HunyuanVideo, LTX-Video at 2 ranks) equals the unsharded stock forward to
1e-5 relative L2 in fp32 at 2, 3 and 4 ranks: a gathered parameter is the original tensor byte for byte, so the only
difference left is the order of the keys in each softmax sum, which sequence parallelism already has (see
test_dit.py). Each rank holds ceil(d0/N) (or the remainder) of every block parameter's first dimension, fp8
parameters stay fp8 in the shard and on the wire (one byte per element gathered), and the gathered bytes equal the
model's block bytes once per forward.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from patchray.distributed.spawn import run_ranks

from .dit_models import build

TOL = 1e-5  # fp32; see the module docstring (same bound and reason as test_dit.py)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


class _CastLinear(torch.nn.Module):
    """A Linear holding an fp8 weight and a bf16 bias, cast to the input's dtype per call (ComfyUI's weight casting)."""

    def __init__(self, w, b, bias_dtype=torch.bfloat16):
        super().__init__()
        self.weight = torch.nn.Parameter(w.to(torch.float8_e4m3fn), requires_grad=False)
        self.bias = torch.nn.Parameter(b.to(bias_dtype), requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class _Fp8Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.inp = torch.nn.Linear(12, 24)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(_CastLinear(torch.randn(24, 24, generator=g) * 0.3, torch.randn(24, generator=g)),
                                torch.nn.LayerNorm(24)) for _ in range(3))
        # a block whose parameters are all fp8 (ComfyUI's fp8 loading can leave no other dtype in a block): FSDP2 then
        # gathers in float8 itself, which gloo cannot carry; comm sends the bytes as uint8
        self.blocks.append(torch.nn.Sequential(_CastLinear(torch.randn(24, 24, generator=g) * 0.3, torch.randn(24, generator=g),
                                                           bias_dtype=torch.float8_e4m3fn)))
        with torch.no_grad():
            for blk in self.blocks[:3]:
                blk[1].weight.copy_(1 + 0.2 * torch.randn(24, generator=g))
                blk[1].bias.copy_(0.1 * torch.randn(24, generator=g))
            self.inp.weight.copy_(torch.randn(24, 12, generator=g) * 0.3)
            self.inp.bias.copy_(torch.randn(24, generator=g) * 0.1)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = torch.tanh(blk(x)) + x
        return x


def _shard_expectations(handle, n):
    """Per sharded parameter: the local first dimension is FSDP2's chunk (ceil(d0/N), the last ranks the rest)."""
    wrong = []
    for name, (full, local, _) in handle.local_shapes().items():
        chunk = math.ceil(full[0] / n)
        want = max(0, min(chunk, full[0] - handle.ctx.rank * chunk))
        if local[0] != want or tuple(local[1:]) != tuple(full[1:]):
            wrong.append((name, tuple(full), tuple(local)))
    return wrong


def _task(ctx, families, modes, fp8=False, ulysses=()):
    from patchray.distributed.parallel.shard import block_bytes, shard_model
    from patchray.distributed.sampling.dit_families import shard_blocks_for
    from patchray.distributed.sampling.dit import parallelize_dit

    n = ctx.world_size
    res = {}
    for fam in families:
        for mode in modes + (("ulysses",) if fam in ulysses else ()):
            torch.manual_seed(0)
            model, inputs = build(fam)
            with torch.no_grad():
                ref = model(**inputs, return_dict=False)[0]
            whole = sum(p.numel() * p.element_size() for p in model.parameters())
            handle = shard_model(model, ctx, shard_blocks_for(model))
            unit_bytes = handle.sharded_bytes
            seq = parallelize_dit(model, ctx, mode=mode)
            handle.tally.reset()
            with torch.no_grad():
                out = model(**inputs, return_dict=False)[0]
            gathered = handle.tally.gathered
            with torch.no_grad():
                again = model(**inputs, return_dict=False)[0]  # the blocks were freed and gathered anew
            seq.remove()
            unit_local = sum(
                comm_local.numel() * comm_local.element_size()
                for _, u in handle.units for comm_local in (p.to_local() for p in u.parameters())
            )
            res[(fam, mode)] = {
                "err": _rel(out, ref),
                "again_equal": torch.equal(again, out),
                "shape_ok": out.shape == ref.shape,
                "wrong_shards": _shard_expectations(handle, n),
                "unit_bytes": unit_bytes,
                "unit_local": unit_local,
                "whole": whole,
                "local": handle.local_bytes(),
                "gathered": gathered,
                "units": len(handle.units),
                "unit_blocks": sum(block_bytes(u) for _, u in handle.units),
            }
    if fp8:
        res["fp8"] = _fp8_task(ctx)
        res["offload"] = _offload_task(ctx)
    res["parts"] = _parts_task(ctx)
    return res


def _offload_task(ctx):
    """``blocks+offload``: FSDP2's CPUOffloadPolicy (shards in host memory, copied to the device per block). On CPU ranks
    the copy to the device is a no-op transfer, but the offload path runs: FSDP2 checks the shards are on the host,
    keeps them there, and gathers from them."""
    from patchray.distributed.parallel.shard import shard_model
    from patchray.distributed.sampling.dit_families import shard_blocks_for
    from patchray.distributed.sampling.dit import parallelize_dit
    from patchray.distributed.sampling.ship import fill_tensors, materialize_meta, parts_by_bytes

    torch.manual_seed(0)
    model, inputs = build("flux")
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
    state = model.state_dict()
    handle = shard_model(model, ctx, shard_blocks_for(model), offload=True)
    seq = parallelize_dit(model, ctx, mode="gathered")
    handle.tally.reset()
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    seq.remove()
    policies = set()
    for _, unit in handle.units:
        group = unit._get_fsdp_state()._fsdp_param_group
        policies.add(type(group.offload_policy).__name__)
        policies.update(f"offload_to_cpu={fp.offload_to_cpu}" for fp in group.fsdp_params)
    # the node's rank path: a meta skeleton, shards allocated on the host, the rest on the device, weights in parts
    with torch.device("meta"):
        skeleton = type(model)(**model.config)
    sk = shard_model(skeleton, ctx, shard_blocks_for(skeleton), offload=True, init=lambda m: materialize_meta(m, ctx.device, torch.device("cpu")))
    for group in parts_by_bytes(((k, v.numel() * v.element_size()) for k, v in state.items()), 20_000):
        fill_tensors(skeleton, {k: state[k] for k in group}, ctx)
    with torch.no_grad():
        parts_out = skeleton(**inputs, return_dict=False)[0]
    return {
        "err": _rel(out, ref),
        "policies": sorted(policies),
        "shard_devices": sorted({p.to_local().device.type for _, u in handle.units for p in u.parameters()}),
        "gathered": handle.tally.gathered,
        "unit_bytes": handle.sharded_bytes,
        "offload": handle.offload and sk.offload,
        "parts_equal": torch.equal(parts_out, ref),
        "parts_policy": type(sk.units[0][1]._get_fsdp_state()._fsdp_param_group.offload_policy).__name__,
    }


def _parts_task(ctx):
    """The weights arriving part by part into a model built and sharded on the meta device (sampling/ship.py's rank
    side): each rank keeps only its rows, and the forward equals the stock one."""
    from patchray.distributed.parallel.shard import shard_model
    from patchray.distributed.sampling.dit_families import shard_blocks_for
    from patchray.distributed.sampling.ship import fill_tensors, materialize_meta, parts_by_bytes

    torch.manual_seed(0)
    model, inputs = build("flux")
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
    state = model.state_dict()
    with torch.device("meta"):
        skeleton = type(model)(**model.config)
    handle = shard_model(skeleton, ctx, shard_blocks_for(skeleton), init=lambda m: materialize_meta(m, ctx.device))
    kept = 0
    for group in parts_by_bytes(((k, v.numel() * v.element_size()) for k, v in state.items()), 20_000):
        kept += fill_tensors(skeleton, {k: state[k] for k in group}, ctx)
    with torch.no_grad():
        out = skeleton(**inputs, return_dict=False)[0]
    return {"equal": torch.equal(out, ref), "kept": kept, "local": handle.local_bytes(),
            "whole": sum(v.numel() * v.element_size() for v in state.values())}


def _fp8_task(ctx):
    from patchray.distributed.parallel.shard import shard_model
    from patchray.distributed.sampling.dit_families import shard_blocks_for

    torch.manual_seed(0)
    net = _Fp8Net()
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = net(x)
    fp8_bytes = sum(b[0].weight.numel() for b in net.blocks) + net.blocks[3][0].bias.numel()  # one byte each
    other = sum(p.numel() * p.element_size() for b in net.blocks for p in b.parameters()) - fp8_bytes
    handle = shard_model(net, ctx, ["blocks.*"])
    dtypes = {name: dt for name, (_, _, dt) in handle.local_shapes().items()}
    handle.tally.reset()
    with torch.no_grad():
        out = net(x)
    return {
        "equal": torch.equal(out, ref),
        "dtypes": {k: str(v) for k, v in dtypes.items()},
        "gathered": handle.tally.gathered,
        "expected_min": fp8_bytes + other,
        "fp32_if_upcast": 4 * (fp8_bytes) + other,
    }


@functools.lru_cache(maxsize=None)
def _results(n):
    families = ("flux", "wan", "qwen-image", "hunyuan-video", "ltx-video") if n == 2 else ("flux", "wan")
    return run_ranks(_task, n, families, ("gathered",), fp8=n == 2, ulysses=("flux",) if n == 2 else ())


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_sequence_parallel_equals_the_unsharded_forward(n):
    for rank, res in enumerate(_results(n)):
        for (fam, mode), r in ((k, v) for k, v in res.items() if k not in ("fp8", "parts", "offload")):
            assert r["shape_ok"] and r["err"] <= TOL, (n, rank, fam, mode, r["err"])
            assert r["again_equal"], (n, rank, fam, mode)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_rank_holds_its_share_of_every_block(n):
    for rank, res in enumerate(_results(n)):
        for key, r in ((k, v) for k, v in res.items() if k not in ("fp8", "parts", "offload")):
            assert r["units"] > 0
            assert not r["wrong_shards"], (n, rank, key, r["wrong_shards"][:3])
            # a rank keeps 1/N of the block bytes (FSDP2 pads dim 0 to a multiple of N: at most one row per param)
            assert r["unit_local"] <= r["unit_bytes"] / n * 1.25, (n, rank, key, r["unit_local"], r["unit_bytes"])
            assert r["unit_local"] >= r["unit_bytes"] / n * 0.5, (n, rank, key)
            # what is not in a block stays whole: the rank holds exactly its shards plus the rest
            assert r["local"] == r["whole"] - r["unit_bytes"] + r["unit_local"], (n, rank, key)
            # one forward gathers every block once: N padded shards of each unit
            assert r["unit_bytes"] <= r["gathered"] <= r["unit_bytes"] * 1.25, (n, rank, key, r["gathered"])
    # the shards of the ranks add up to the blocks
    for key in (k for k in _results(n)[0] if k not in ("fp8", "parts", "offload")):
        assert sum(res[key]["unit_local"] for res in _results(n)) == _results(n)[0][key]["unit_bytes"], key


@pytest.mark.parametrize("n", [2, 3, 4])
def test_weights_arriving_in_parts_fill_only_the_ranks_shards(n):
    for rank, res in enumerate(_results(n)):
        r = res["parts"]
        assert r["equal"], (n, rank)  # same values, same ops: bit-identical to the stock forward (no sequence split)
        assert r["kept"] == r["local"] < r["whole"], (n, rank, r)


def test_fp8_weights_stay_fp8_in_the_shard_and_on_the_wire():
    for rank, res in enumerate(_results(2)):
        r = res["fp8"]
        assert r["equal"], rank  # the gathered fp8 bytes are the original ones: bit-identical output
        fp8 = {k: v for k, v in r["dtypes"].items() if k.endswith("0.weight")}
        assert fp8 and set(fp8.values()) == {"torch.float8_e4m3fn"}, r["dtypes"]
        assert {v for k, v in r["dtypes"].items() if k.endswith("0.bias")} == {"torch.bfloat16", "torch.float8_e4m3fn"}
        assert r["dtypes"]["blocks.3.0.bias"] == "torch.float8_e4m3fn"  # the all-fp8 block
        # gathered bytes: one byte per fp8 element (padding aside), far below an upcast
        assert r["expected_min"] <= r["gathered"] < r["fp32_if_upcast"], r


def test_refusals():
    from patchray.distributed.context import ParallelContext
    from patchray.distributed.parallel.shard import find_units, shard_model
    from patchray.distributed.sampling.dit_families import shard_blocks_for

    model, _ = build("wan")
    assert [p for p, _ in find_units(model, ["blocks.*"])] == ["blocks.0", "blocks.1"]  # the shallowest matches
    with pytest.raises(NotImplementedError, match="no block table for Linear"):
        shard_blocks_for(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="blocks"):
        shard_model(torch.nn.Linear(2, 2), ParallelContext.single(), None)
    with pytest.raises(NotImplementedError, match="matches"):
        shard_model(model, ParallelContext.single(), ["nope.*"])
    with pytest.raises(ValueError, match="prefetch"):
        shard_model(model, ParallelContext.single(), ["blocks.*"], prefetch=-1)


def test_blocks_offload_equals_the_unsharded_forward_on_cpu_ranks():
    # FSDP2 (torch 2.13) accepts CPUOffloadPolicy on a CPU device mesh under gloo: the offload path runs on CI's ranks
    for rank, res in enumerate(_results(2)):
        r = res["offload"]
        assert r["offload"] and r["policies"] == ["CPUOffloadPolicy", "offload_to_cpu=True"], (rank, r)
        assert r["parts_policy"] == "CPUOffloadPolicy" and r["shard_devices"] == ["cpu"], (rank, r)
        # fp32, gathered K/V: the same bound and reason as the on-device shards (module docstring)
        assert r["err"] <= TOL, (rank, r["err"])
        assert r["unit_bytes"] <= r["gathered"] <= r["unit_bytes"] * 1.25, (rank, r)  # every block gathered once
        assert r["parts_equal"], rank  # no sequence split: bit-identical to the stock forward
