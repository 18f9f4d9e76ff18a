"""The Distributed KSampler's ``sharding`` widget on the driver, without ComfyUI: its values (old workflows keep their
meaning), ``auto``'s escalation none -> blocks -> blocks+offload on a model of known bytes, and the host-memory refusal
of ``blocks+offload``, with every figure worked out by hand below."""

import pytest
import torch

from patchray.distributed.topology.shard_advice import GIB
from patchray.nodes.bridge import shard_models as bs


class WanModel(torch.nn.Module):
    """Named like ComfyUI's Wan class (the block table is keyed by class name): 2 blocks of Linear(5, 4) and an embedder
    Linear(3, 2) outside the blocks, fp32. Bytes: a block 4x5 + 4 = 24 floats = 96 B; the embedder 3x2 + 2 = 8 floats =
    32 B; the model 2 x 96 + 32 = 224 B."""

    def __init__(self):
        super().__init__()
        self.patch_embedding = torch.nn.Linear(3, 2)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(5, 4) for _ in range(2))


class Unknown(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


def test_widget_values_keep_their_meaning_and_the_default():
    from patchray.nodes import ksampler

    assert bs.SHARDING_NAMES == ["none", "blocks", "blocks+offload", "auto"]
    inputs = {i.id: i for i in ksampler.PatchRayKSampler.define_schema().inputs}
    assert list(inputs["sharding"].options) == bs.SHARDING_NAMES and inputs["sharding"].default == "none"
    assert all(name in inputs["sharding"].tooltip for name in bs.SHARDING_NAMES)
    # the values an old workflow saved resolve as before (blocks stays on the cards, none whole)
    dm = WanModel()
    assert bs.resolve_sharding("none", dm, 2, None)[0] == "none"
    assert bs.resolve_sharding("blocks", dm, 2, None)[0] == "blocks"
    assert bs.resolve_sharding("blocks+offload", dm, 2, None)[0] == "blocks+offload"
    with pytest.raises(NotImplementedError, match="sharding=blocks\\+offload has no block table for Unknown"):
        bs.resolve_sharding("blocks+offload", Unknown(), 2, None)
    with pytest.raises(ValueError, match="sharding must be one of"):
        bs.resolve_sharding("offload", dm, 2, None)


def test_block_bytes_count_fsdp2s_padded_shards():
    bb = bs.block_bytes(WanModel(), 3)
    # N = 3: ceil(4 / 3) = 2 rows per rank of each weight (2 x 5 floats) and bias (2 floats): 12 floats = 48 B per
    # block, 96 B for both
    assert bb == bs.BlockBytes(total=192, largest=96, weights=224, per_rank_padded=96)
    assert bs.block_bytes(WanModel(), 2).per_rank_padded == 96  # N = 2: 2 rows, no padding: half of 192 B
    assert bs.block_bytes(Unknown(), 2) is None


def test_auto_escalates_from_the_smallest_cards_free_memory():
    # W = 224 B, f = 192 / 224, largest block 96 B; a card of total <= 15 GiB: reserve R = 3 GiB
    dm, r = WanModel(), 3 * GIB
    assert bs.resolve_sharding("auto", dm, 2, r + 224, 8 * GIB)[0] == "none"  # W + R fits
    # blocks: 192 / 2 + 32 = 128 B + R
    assert bs.resolve_sharding("auto", dm, 2, r + 223, 8 * GIB)[0] == "blocks"
    assert bs.resolve_sharding("auto", dm, 2, r + 128, 8 * GIB)[0] == "blocks"
    # blocks+offload: 32 B outside the blocks + 2 x 96 B in flight = 224 B... more than blocks' 128 B on this toy; a
    # free figure below blocks' need escalates, and the reason says offload does not fit either
    resolved, why = bs.resolve_sharding("auto", dm, 2, r + 127, 8 * GIB)
    assert resolved == "blocks+offload" and "still does not fit: add ranks" in why
    assert "host -> device per model call" in why
    # CPU ranks: their "device" memory is the host's; auto stops at blocks and says it does not fit
    resolved, why = bs.resolve_sharding("auto", dm, 2, r + 127, 8 * GIB, host_ranks=True)
    assert resolved == "blocks" and "still does not fit: add ranks" in why
    assert bs.resolve_sharding("auto", dm, 1, 0.0, 8 * GIB)[0] == "none"  # one rank: nothing to shard over
    assert bs.resolve_sharding("auto", Unknown(), 2, 1.0, 8 * GIB)[0] == "none"  # no table: whole, with the reason


def test_host_memory_refusal_in_the_nodes_terms():
    dm = WanModel()
    # 2 ranks on one 24 GiB machine pin 2 x 96 B; headroom 4 GiB: fits with 4 GiB + 192 B available, not with 1 B less
    ok = bs.check_host_memory(dm, 2, [("pc", 4 * GIB + 192, 24 * GIB), ("pc", 4 * GIB + 192, 24 * GIB)])
    assert "pc: 2 rank(s) pin" in ok
    with pytest.raises(ValueError) as err:
        bs.check_host_memory(dm, 2, [("pc", 4 * GIB + 191, 24 * GIB), ("pc", 4 * GIB + 500, 24 * GIB)])
    msg = str(err.value)
    assert "PatchRay: sharding=blocks+offload" in msg and "Nothing was loaded" in msg
    assert "the 2 rank(s) on pc would pin" in msg and "sharding=blocks" in msg
    # ranks on two machines: each machine holds its own ranks' shards (96 B each)
    assert bs.check_host_memory(dm, 2, [("a", 4 * GIB + 96, 24 * GIB), ("b", 4 * GIB + 96, 24 * GIB)])
    with pytest.raises(ValueError, match="the 1 rank\\(s\\) on b would pin"):
        bs.check_host_memory(dm, 2, [("a", 4 * GIB + 96, 24 * GIB), ("b", 4 * GIB + 95, 24 * GIB)])


def test_offload_advice_states_the_copy_and_the_verdict():
    cost = bs.offload_advice(WanModel(), 2, "pcie4_x16_no_p2p")
    # f = 192/224 > 2/3: over PCIe without peer-to-peer an offloaded sharded step moves more than one card's copy
    assert cost.slower is True and "SLOWER" in cost.text and "host -> device per model call" in cost.text
    assert bs.offload_advice(WanModel(), 2, "nvlink").slower is False


def test_host_memory_counts_what_the_cached_model_holds_on_the_host():
    import socket

    import psutil

    from patchray.nodes.bridge.ksampler_rank import host_bytes, host_memory

    lin = torch.nn.Linear(1000, 1000)  # 1000 x 1000 + 1000 floats = 4,004,000 B
    lin.register_buffer("steps", torch.zeros(10, dtype=torch.int64))  # + 80 B
    assert host_bytes(lin) == 4_004_080
    with torch.device("meta"):
        meta = torch.nn.Linear(1000, 1000)
    assert host_bytes(meta) == 0 and host_bytes(object()) == 0  # nothing on the host; not a module
    from types import SimpleNamespace

    from patchray.nodes.bridge.ksampler_rank import device_memory

    free, total_dev, kind = device_memory(SimpleNamespace(device=torch.device("cpu")))
    assert kind == "cpu" and 0 < free <= total_dev  # CPU ranks: the host's memory, and the driver learns they are CPU
    machine, available, total = host_memory(None)
    assert machine == socket.gethostname() and total == psutil.virtual_memory().total and 0 < available <= total
