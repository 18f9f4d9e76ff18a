"""The DiT table's Qwen-Image, HunyuanVideo and LTX-Video rows without ComfyUI: lookup, token grids, refusals, and
the rank-side hooks those families need (LTX-Video's RoPE block argument, per-token timestep and attention scopes by
path; HunyuanVideo's first-frame modulation boundary), each checked against the full-sequence tensor indexed by the
shard table's positions. Their use inside ComfyUI's sampler, against the stock KSampler on 2, 3 and 4 gloo ranks, is
tested in tests/comfyui/test_dit_ranks_qwen_hunyuan_ltxv.py (opt-in).
"""

import operator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from patchray.distributed.parallel.sequence import TokenShards
from patchray.nodes.bridge import dit_models
from patchray.nodes.bridge.dit_hooks import hunyuan_hooks as _hunyuan_hooks, ltxv_hooks as _ltxv_hooks


@pytest.mark.parametrize("cls, family, text", [("QwenImageTransformer2DModel", "Qwen-Image", "prefix"),
                                               ("HunyuanVideo", "HunyuanVideo", "suffix"), ("LTXVModel", "LTX-Video", "none")])
def test_rows_of_the_three_families(cls, family, text):
    row = dit_models.find_row(cls)
    assert row is not None and row.family.startswith(family) and row.text == text
    assert sum(cls in r.classes for r in dit_models.ROWS) == 1
    assert cls not in dit_models.KNOWN_UNCOVERED
    assert set(row.attends.values()) <= {"self", "joint", "cross"}


def test_joint_attention_rows_shard_their_text_unless_a_call_keeps_it_whole():
    ctx = torch.zeros(1, 7, 8)
    for cls in ("Flux", "Chroma", "QwenImageTransformer2DModel", "HunyuanVideo"):
        row = dit_models.find_row(cls)
        assert row.text_tokens is not None, cls
        assert dit_models.text_tokens(row, {"context": ctx}, 2) == 7, cls
        assert dit_models.text_tokens(row, {"context": ctx}, 1) == 0, cls  # one rank: nothing to split
        # fewer text tokens than ranks: an empty slice would break the blocks' reshapes, so the text stays whole
        assert dit_models.text_tokens(row, {"context": torch.zeros(1, 2, 8)}, 3) == 0, cls
    hy = dit_models.find_row("HunyuanVideo")
    # HunyuanVideo lays a text mask over the whole text; HunyuanImage's ByT5 tokens join after the refiner
    assert dit_models.text_tokens(hy, {"context": ctx, "attention_mask": torch.ones(1, 7)}, 2) == 0
    assert dit_models.text_tokens(hy, {"context": ctx, "kwargs": {"txt_byt5": torch.zeros(1, 3, 8)}}, 2) == 0
    # ComfyUI's Qwen-Image blocks do not apply the text mask: its text is split with or without one
    qwen = dit_models.find_row("QwenImageTransformer2DModel")
    assert dit_models.text_tokens(qwen, {"context": ctx, "attention_mask": torch.ones(1, 7)}, 2) == 7
    for cls in ("WanModel", "LTXVModel"):  # text by cross-attention only: nothing to split
        assert dit_models.text_tokens(dit_models.find_row(cls), {"context": ctx}, 2) == 0


def test_token_grids_pad_to_the_patch_like_the_models():
    qwen = dit_models.find_row("QwenImageTransformer2DModel")
    hy = dit_models.find_row("HunyuanVideo")
    ltx = dit_models.find_row("LTXVModel")
    # Qwen-Image latents are [B, 16, 1, H, W], patch 2 (padded)
    assert dit_models.token_grid(qwen, SimpleNamespace(patch_size=2), (1, 16, 1, 13, 10)) == (1, 7, 5)
    # HunyuanVideo [1, 2, 2]; HunyuanImage 2.1 a 2-D [1, 1] patch on image latents
    assert dit_models.token_grid(hy, SimpleNamespace(patch_size=[1, 2, 2]), (1, 16, 5, 10, 6)) == (5, 5, 3)
    assert dit_models.token_grid(hy, SimpleNamespace(patch_size=[1, 1]), (1, 64, 7, 5)) == (1, 7, 5)
    # LTX-Video: the patchifier's (1, 1, 1)
    ltx_dm = SimpleNamespace(patchifier=SimpleNamespace(patch_size=(1, 1, 1)))
    assert dit_models.token_grid(ltx, ltx_dm, (1, 128, 3, 7, 5)) == (3, 7, 5)


def test_heads_are_read_by_dotted_path():
    qwen = dit_models.find_row("QwenImageTransformer2DModel")
    ltx = dit_models.find_row("LTXVModel")
    dm = nn.Module()
    dm.transformer_blocks = nn.ModuleList([nn.Module()])
    dm.transformer_blocks[0].num_attention_heads = 24
    dm.transformer_blocks[0].attn1 = nn.Module()
    dm.transformer_blocks[0].attn1.heads = 32
    assert operator.attrgetter(qwen.heads)(dm) == 24
    assert operator.attrgetter(ltx.heads)(dm) == 32


def test_refusals_name_the_input():
    qwen = dit_models.find_row("QwenImageTransformer2DModel")
    hy = dit_models.find_row("HunyuanVideo")
    assert "Qwen-Image Edit" in dit_models.call_refusal(qwen, {"x": 1, "ref_latents": [torch.zeros(1)]})
    assert dit_models.call_refusal(qwen, {"x": 1, "ref_latents": None, "kwargs": {}}) is None
    assert "ControlNet" in dit_models.call_refusal(hy, {"x": 1, "control": {"input": []}})
    cond = [[torch.zeros(1, 4, 8), {"ref_latent": torch.zeros(1)}]]
    assert "in negative" in dit_models.cond_refusal(hy, "negative", cond)
    # image-to-video "v2" (guiding_frame_index) is served by the row's hooks, not refused
    assert dit_models.cond_refusal(hy, "positive", [[torch.zeros(1, 4, 8), {"guiding_frame_index": 0}]]) is None


# ------------------------------------------------------------------------------------------- hooks


def _seq(dm, shards, rank):
    """What the hooks read of the rank's DitSequence: context, shard table, model, attention-scope stack."""
    return SimpleNamespace(dm=dm, ctx=SimpleNamespace(rank=rank, world_size=len(shards.counts)),
                           state=SimpleNamespace(require_shards=lambda: shards), scopes=SimpleNamespace(stack=[]))


class _Recorder(nn.Module):
    def __init__(self, log, stack=None):
        super().__init__()
        self.log, self.stack = log, stack

    def forward(self, *args, **kwargs):
        self.log.append((args, kwargs, list(self.stack) if self.stack is not None else None))
        return args[0] if args else None


class BasicTransformerBlock(nn.Module):  # the class name LTX-Video's hooks look for
    def __init__(self, log, stack):
        super().__init__()
        self.log = log
        self.attn1 = _Recorder(log, stack)
        self.attn2 = _Recorder(log, stack)

    def forward(self, x, context=None, attention_mask=None, timestep=None, pe=None, transformer_options={}):
        self.log.append(("block", pe))
        self.attn1(x)
        self.attn2(x)
        return x


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_ltxv_hooks_cut_rope_and_per_token_timestep_and_scope_attentions(rank):
    shards = TokenShards.split(3, 7, 5, 3)  # 3 frames of 7 x 5 tokens over 3 ranks: uneven bands (3, 2, 2 rows)
    log = []
    dm = nn.Module()
    dm.adaln_single = _Recorder(log)
    seq = _seq(dm, shards, rank)
    dm.transformer_blocks = nn.ModuleList([BasicTransformerBlock(log, seq.scopes.stack) for _ in range(2)])
    handles = _ltxv_hooks(seq)
    mine = shards.index(rank)
    b, total = 2, shards.total
    cos, sin = torch.randn(b, total, 16), torch.randn(b, total, 16)
    pe = (cos, sin)  # LTX passes the same tuple to every block
    for block in dm.transformer_blocks:
        block(torch.zeros(b, len(mine), 16), pe=pe)
    blocks = [e for e in log if e[0] == "block"]
    assert len(blocks) == 2
    for _, pe in blocks:
        assert torch.equal(pe[0], cos[:, mine]) and torch.equal(pe[1], sin[:, mine])
    assert blocks[0][1] is blocks[1][1]  # cut once per call, reused by every block
    scopes = [e[2] for e in log if e[0] != "block"]
    assert scopes == [[("self", "transformer_blocks.0.attn1")], [("cross", "transformer_blocks.0.attn2")],
                      [("self", "transformer_blocks.1.attn1")], [("cross", "transformer_blocks.1.attn2")]]
    assert seq.scopes.stack == []
    # a timestep per token ([B * L] into adaln_single) is cut to this rank's tokens; one per sample is left alone
    log.clear()
    t = torch.randn(b, total)
    dm.adaln_single(t.flatten(), {}, batch_size=b, hidden_dtype=torch.float32)
    dm.adaln_single(t[:, 0], {}, batch_size=b, hidden_dtype=torch.float32)
    assert torch.equal(log[0][0][0], t[:, mine].reshape(-1))
    assert torch.equal(log[1][0][0], t[:, 0])
    for h in handles:
        h.remove()
    log.clear()
    dm.transformer_blocks[0](torch.zeros(b, total, 16), pe=(cos, sin))
    assert log[0][1][0] is cos  # removed: the model is as before


def test_ltxv_hooks_cut_the_newer_rope_tuple_and_keep_its_split_mode():
    """Newer ComfyUI passes LTX-Video's pe as ((cos, sin), split_mode): the tables are cut to this rank's tokens, the
    mode travels unchanged (0.3.64's (cos, sin) is the test above)."""
    shards = TokenShards.split(2, 6, 4, 2)
    log = []
    dm = nn.Module()
    dm.adaln_single = _Recorder(log)
    seq = _seq(dm, shards, 1)
    dm.transformer_blocks = nn.ModuleList([BasicTransformerBlock(log, seq.scopes.stack)])
    handles = _ltxv_hooks(seq)
    mine = shards.index(1)
    cos, sin = torch.randn(1, shards.total, 8), torch.randn(1, shards.total, 8)
    dm.transformer_blocks[0](torch.zeros(1, len(mine), 8), pe=((cos, sin), "interleaved"))
    (_, pe), = [e for e in log if e[0] == "block"]
    assert pe[1] == "interleaved"
    assert torch.equal(pe[0][0], cos[:, mine]) and torch.equal(pe[0][1], sin[:, mine])
    for h in handles:
        h.remove()


def test_ltxv_hooks_refuse_a_rope_of_another_length():
    shards = TokenShards.split(1, 4, 4, 2)
    dm = nn.Module()
    dm.adaln_single = _Recorder([])
    seq = _seq(dm, shards, 0)
    dm.transformer_blocks = nn.ModuleList([BasicTransformerBlock([], seq.scopes.stack)])
    _ltxv_hooks(seq)
    with pytest.raises(ValueError, match="LTX-Video: a positional embedding of 5 tokens for 16"):
        dm.transformer_blocks[0](torch.zeros(1, 8, 4), pe=(torch.zeros(1, 5, 4), torch.zeros(1, 5, 4)))


class DoubleStreamBlock(_Recorder):  # the class names HunyuanVideo's hooks look for
    pass


class LastLayer(_Recorder):
    pass


@pytest.mark.parametrize("rank, first", [(0, 9), (1, 6)])
def test_hunyuan_first_frame_modulation_moves_to_this_ranks_rows(rank, first):
    shards = TokenShards.split(5, 5, 3, 2)  # 5 frames of 5 x 3 tokens: rank 0 holds 3 rows, rank 1 two
    log = []
    dm = nn.Module()
    dm.block = DoubleStreamBlock(log)
    dm.final = LastLayer(log)
    handles = _hunyuan_hooks(_seq(dm, shards, rank))
    full = 5 * 3
    dm.block(torch.zeros(1), modulation_dims_img=[(0, full, 0), (full, None, 1)], modulation_dims_txt=[(0, None, 1)])
    dm.final(torch.zeros(1), modulation_dims=[(0, full, 0), (full, None, 1)])
    dm.final(torch.zeros(1), modulation_dims=None)
    assert log[0][1]["modulation_dims_img"] == [(0, first, 0), (first, None, 1)]
    assert log[0][1]["modulation_dims_txt"] == [(0, None, 1)]
    assert log[1][1]["modulation_dims"] == [(0, first, 0), (first, None, 1)]
    assert log[2][1]["modulation_dims"] is None
    # rank's first-frame tokens are exactly the global first frame's tokens it holds
    assert (shards.index(rank)[:first] < full).all() and (shards.index(rank)[first:] >= full).all()
    for h in handles:
        h.remove()


def test_a_local_text_mask_made_under_inference_mode_is_checked_not_cached():
    """HunyuanVideo builds its text mask from the local length inside ComfyUI's inference_mode (no version counter):
    it is re-expressed over every rank's keys, and a mask changed in place to differ between image keys is refused."""
    from patchray.distributed.parallel.sequence import _key_mask

    order = torch.tensor([0, 1, 4, 5, 2, 3])  # 6 image tokens, rank-major
    with torch.inference_mode():
        mask = torch.zeros(1, 1, 2 + 3)  # 2 local image keys + 3 text keys (text after)
        mask[..., 4] = -1e9
        checked = {}
        for _ in range(2):
            out = _key_mask(mask, 5, 9, 0, 3, 6, order, "single_blocks.0", checked)
            assert torch.equal(out, torch.cat([torch.zeros(1, 1, 6), mask[..., 2:]], dim=-1))
        mask[..., 1] = -1e9  # the same tensor changed in place: checked again, refused
        with pytest.raises(NotImplementedError, match="differs between image keys"):
            _key_mask(mask, 5, 9, 0, 3, 6, order, "single_blocks.0", checked)


# ------------------------------------------------------------------- hooks on weight-sharded blocks (FSDP2)


class _ShardedLtxBlock(BasicTransformerBlock):
    """LTX-Video's block with a weight, so weight sharding makes it an FSDP2 unit."""

    def __init__(self, log, stack):
        super().__init__(log, stack)
        self.ff = nn.Linear(4, 4)

    def forward(self, x, **kwargs):
        return super().forward(self.ff(x), **kwargs)


_ShardedLtxBlock.__name__ = _ShardedLtxBlock.__qualname__ = "BasicTransformerBlock"


class _ShardedDoubleStreamBlock(DoubleStreamBlock):
    def __init__(self, log):
        super().__init__(log)
        self.lin = nn.Linear(4, 4)


_ShardedDoubleStreamBlock.__name__ = _ShardedDoubleStreamBlock.__qualname__ = "DoubleStreamBlock"


def _sharded_hooks_rank(ctx):
    """On each of 2 gloo ranks: blocks sharded by ``shard_model`` (``sharding=blocks``: FSDP2 replaces each block's
    class by its subclass ``FSDP<name>``), then the rank-side hooks, as ``DitSequence`` registers them at sampling."""
    from patchray.distributed.parallel.shard import shard_model

    torch.manual_seed(0)
    shards = TokenShards.split(1, 5, 3, ctx.world_size)  # 15 tokens: rank 0 holds 3 rows (9), rank 1 two (6)
    mine = shards.index(ctx.rank)
    log = []
    dm = nn.Module()
    dm.adaln_single = _Recorder(log)
    seq = _seq(dm, shards, ctx.rank)
    seq.ctx = SimpleNamespace(rank=ctx.rank, world_size=ctx.world_size)
    dm.transformer_blocks = nn.ModuleList([_ShardedLtxBlock(log, seq.scopes.stack) for _ in range(2)])
    handle = shard_model(dm, ctx, ["transformer_blocks.*"])
    classes = sorted({type(b).__name__ for b in dm.transformer_blocks})
    handles = _ltxv_hooks(seq)
    cos, sin = torch.randn(1, shards.total, 4), torch.randn(1, shards.total, 4)
    with torch.no_grad():
        for block in dm.transformer_blocks:
            block(torch.zeros(1, len(mine), 4), pe=(cos, sin))
    pes = [e[1] for e in log if e[0] == "block"]
    scopes = [e[2] for e in log if e[0] != "block"]
    for h in handles:
        h.remove()
    # HunyuanVideo's first-frame modulation boundary on a sharded double-stream block
    hlog = []
    hy = nn.Module()
    hy.block = _ShardedDoubleStreamBlock(hlog)
    shard_model(hy, ctx, ["block"])
    _hunyuan_hooks(_seq(hy, TokenShards.split(5, 5, 3, ctx.world_size), ctx.rank))
    full = 15
    with torch.no_grad():
        hy.block(torch.zeros(1), modulation_dims_img=[(0, full, 0), (full, None, 1)])
    return {
        "classes": classes,
        "units": len(handle.units),
        "pe_cut": len(pes) == 2 and all(torch.equal(p[0], cos[:, mine]) and torch.equal(p[1], sin[:, mine]) for p in pes),
        "scopes": scopes,
        "hunyuan_dims": hlog[0][1]["modulation_dims_img"],
        "hunyuan_class": type(hy.block).__name__,
    }


def test_hooks_find_blocks_that_weight_sharding_wrapped():
    """sharding=blocks wraps every block in FSDP2's subclass (``FSDPBasicTransformerBlock``); the LTX-Video hooks looked
    blocks up by ``type(module).__name__`` and missed them: the RoPE reached the blocks uncut and the rank failed in
    ``apply_rotary_emb`` ("The size of tensor a (60) must match the size of tensor b (105)"). On 2 real gloo ranks."""
    from patchray.distributed.spawn import run_ranks

    for rank, r in enumerate(run_ranks(_sharded_hooks_rank, 2, backend="gloo", device="cpu", timeout_s=120)):
        assert r["classes"] == ["FSDPBasicTransformerBlock"] and r["units"] == 2, (rank, r)
        assert r["pe_cut"], rank
        assert r["scopes"] == [[("self", "transformer_blocks.0.attn1")], [("cross", "transformer_blocks.0.attn2")],
                               [("self", "transformer_blocks.1.attn1")], [("cross", "transformer_blocks.1.attn2")]], (rank, r)
        first = (9, 6)[rank]  # this rank's rows of frame 0 (3 or 2 rows of 3 tokens)
        assert r["hunyuan_class"] == "FSDPDoubleStreamBlock", (rank, r)
        assert [tuple(d) for d in r["hunyuan_dims"]] == [(0, first, 0), (first, None, 1)], (rank, r)


class VaceWanAttentionBlock(nn.Module):  # the class name Wan VACE's hook looks for
    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, c, x, **kwargs):
        self.log.append((c, x))
        return c, c


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_wan_vace_hooks_band_the_hint_stream_and_the_video_input_with_the_tokens(rank):
    from patchray.nodes.bridge.dit_hooks import wan_vace_hooks

    shards = TokenShards.split(5, 7, 3, 3)  # 5 frames of 7 x 3 tokens over 3 ranks: uneven bands (3, 2, 2 rows)
    log = []
    dm = nn.Module()
    dm.vace_blocks = nn.ModuleList([VaceWanAttentionBlock(log) for _ in range(2)])
    handles = wan_vace_hooks(_seq(dm, shards, rank))
    mine = shards.index(rank)
    c, x_orig = torch.randn(2, shards.total, 8), torch.randn(2, shards.total, 8)
    _, c_local = dm.vace_blocks[0](c, x=x_orig)  # the first VACE block: the hint stream and x_orig whole
    dm.vace_blocks[1](c_local, x=x_orig)  # a later block: its stream already this rank's, x_orig whole again
    assert torch.equal(log[0][0], c[:, mine]) and torch.equal(log[0][1], x_orig[:, mine])
    assert log[1][0] is c_local and torch.equal(log[1][1], x_orig[:, mine])
    assert log[0][1] is log[1][1]  # x_orig cut once per call
    with pytest.raises(ValueError, match="VACE hint stream of 4 tokens"):
        dm.vace_blocks[1](torch.randn(2, 4, 8), x=x_orig)
    for h in handles:
        h.remove()
    log.clear()
    dm.vace_blocks[0](c, x=x_orig)
    assert log[0][0] is c and log[0][1] is x_orig  # removed: the model is as before


class JointTransformerBlock(nn.Module):  # the class name Lumina 2's hooks look for
    def __init__(self, log, stack):
        super().__init__()
        self.log, self.stack = log, stack

    def forward(self, x, x_mask, freqs_cis, adaln_input=None, transformer_options={}):
        self.log.append((freqs_cis, list(self.stack)))
        return x


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_lumina_hooks_scope_refiners_locally_and_cut_the_joint_rope_behind_the_whole_text(rank):
    from patchray.nodes.bridge.dit_hooks import lumina_hooks

    shards = TokenShards.split(1, 7, 5, 3)  # 7 x 5 tokens over 3 ranks: uneven bands (3, 2, 2 rows)
    log = []
    dm = nn.Module()
    seq = _seq(dm, shards, rank)
    for name in ("context_refiner", "noise_refiner", "layers"):
        setattr(dm, name, nn.ModuleList([JointTransformerBlock(log, seq.scopes.stack) for _ in range(2)]))
    handles = lumina_hooks(seq)
    text, mine = 4, shards.index(rank)
    freqs = torch.randn(2, text + shards.total, 3, 8)  # [B, text + image, ...]: the joint sequence's RoPE, text first
    dm.context_refiner[0](torch.zeros(2, text, 8), None, freqs[:, :text])
    dm.noise_refiner[0](torch.zeros(2, shards.total, 8), None, freqs[:, text:])
    for layer in dm.layers:
        layer(torch.zeros(2, text + len(mine), 8), None, freqs)
    assert [e[1] for e in log] == [[("cross", "context_refiner.0")], [("cross", "noise_refiner.0")],
                                  [("joint", "layers.0")], [("joint", "layers.1")]]
    want = torch.cat([freqs[:, :text], freqs[:, text:][:, mine]], dim=1)
    assert torch.equal(log[2][0], want) and log[2][0] is log[3][0]  # cut once per call, the text whole
    assert log[1][0].shape[1] == shards.total  # the refiners' inputs are left whole
    with pytest.raises(NotImplementedError, match="padding mask"):
        dm.layers[0](torch.zeros(2, 1, 8), torch.zeros(2, 1), freqs)
    seq.scopes.stack.clear()  # the refused call left its scope (a failed run's DitSequence is discarded)
    for h in handles:
        h.remove()
    log.clear()
    dm.layers[0](torch.zeros(2, 1, 8), None, freqs)
    assert log[0][0] is freqs and log[0][1] == []  # removed: the model is as before
