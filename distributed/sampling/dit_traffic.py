"""The modelled traffic of one sequence-parallel DiT step, from shapes (for the benchmark and the README; no model).

Bytes per step equal what comm's accounting counts (``log_comm``) for the same call: the CI tests check the equality
on the tiny diffusers models, with the text replicated and with the text sharded (the default for joint-attention
families: a rank's K/V share is then its image band plus its slice of the text).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

from ..parallel.exchange import EXACT, CompressedExchange, PeerExchange
from ..parallel.sequence import AttentionCost, SeqMode, TokenShards, attention_cost, choose_mode
from .comm_manager import packed_bytes

__all__ = ["DiTShape", "FULL_SIZE_SHAPES", "step_cost", "token_shards", "token_share", "modulation_features"]


class DiTShape(NamedTuple):
    """What the traffic of a sequence-parallel DiT step depends on.

    Args:
        attention_layers: self/joint attention calls per forward (double + single stream blocks).
        heads, head_dim: of those attentions.
        frames, rows, cols: the token grid after patchify.
        text: text tokens in the joint sequences (0 when text enters by cross-attention only); sharded over the
            ranks by default (``shard_text``), replicated otherwise.
        out_features: features per token at the output projection (gathered once per forward).
        modulation: output features of each adaLN modulation layer the ranks compute in shares
            (``parallel.seq_modulation``; one all-gather per forward of every rank's ``ceil(features / N)`` of each);
            ``()``: none (Wan and LTX-Video modulate with tables added to one shared projection).
    """

    attention_layers: int
    heads: int
    head_dim: int
    frames: int
    rows: int
    cols: int
    text: int
    out_features: int
    modulation: Tuple[int, ...] = ()


def modulation_features(double: int, single: int, dim: int) -> Tuple[int, ...]:
    """The modulation layers of FLUX.1-style blocks (HunyuanVideo too): two ``6 dim`` per double-stream block (image
    and text), one ``3 dim`` per single-stream block; Qwen-Image's blocks are double-stream only."""
    return (6 * dim,) * (2 * double) + (3 * dim,) * single


#: the full-size architectures of the README's figures (the configs of the public checkpoints)
FULL_SIZE_SHAPES: Dict[str, DiTShape] = {
    # FLUX.1 dev/schnell: 19 double + 38 single blocks, 24 heads x 128; 1024x1024 -> latent 128x128 -> 64x64 tokens
    # (2x2 patches); 512 T5 tokens; proj_out 64 features per token
    "flux1_1024": DiTShape(57, 24, 128, 1, 64, 64, 512, 64, modulation_features(19, 38, 3072)),
    # Wan 2.1 14B: 40 blocks, 40 heads x 128; 480x832x81 -> latent 21x60x104 -> 21x30x52 tokens (1x2x2 patches);
    # text by cross-attention; proj_out 1*2*2*16 = 64 features
    "wan21_14b_480x832x81": DiTShape(40, 40, 128, 21, 30, 52, 0, 64),
    # Qwen-Image: 60 blocks, 24 heads x 128; 1328x1328 -> latent 166x166 -> 83x83 tokens; ~256 text tokens;
    # proj_out 2*2*16 = 64 features
    "qwen_image_1328": DiTShape(60, 24, 128, 1, 83, 83, 256, 64, modulation_features(60, 0, 3072)),
}


def token_shards(shape: DiTShape, world_size: int, shard_text: bool = True) -> TokenShards:
    """The shard table of ``shape`` over ``world_size`` ranks (equal bands; the text sliced when ``shard_text``)."""
    return TokenShards.split(shape.frames, shape.rows, shape.cols, world_size, text=shape.text if shard_text else 0)


def token_share(shape: DiTShape, world_size: int, shard_text: bool = True) -> float:
    """The busiest rank's share of a call's tokens (the per-token work it does): its image band plus its text slice
    (``shard_text``) or plus the whole replicated text, over all tokens. FLUX.1 at 1024x1024 (4,096 image + 512 text
    tokens) on 2 ranks: 2,304 / 4,608 = 0.5 sharded, 2,560 / 4,608 replicated (an ideal speed-up of 2x vs 1.8x)."""
    shards = token_shards(shape, world_size, shard_text)
    mine = [n + (0 if shard_text else shape.text) for n in shards.seq_counts]
    return max(mine) / (shards.total + shape.text)


def step_cost(shape: DiTShape, world_size: int, mode: str = "auto", *, itemsize: int = 2, batch: int = 1,
              link: Optional[str] = None, kv: PeerExchange = EXACT, shard_text: bool = True) -> Dict[str, Any]:
    """Modelled traffic of one model evaluation (one step of one CFG branch) for one rank (the largest band).

    Args:
        shape: :class:`DiTShape` (see :data:`FULL_SIZE_SHAPES`).
        world_size: ranks of the sequence group.
        mode: ``gathered``, ``ulysses`` or ``auto`` (resolved by :func:`~..parallel.sequence.choose_mode` on
            ``link``).
        itemsize: bytes per element of the activations (2: bf16/fp16).
        kv: the K/V strategy; a :class:`~..parallel.exchange.CompressedExchange` counts its packed residuals
            (displaced and stale strategies move the exact bytes, asynchronously or on synchronous steps only).
        batch: latents per call (CFG batched in one call: 2).
        shard_text: the joint sequences' text tokens are sharded with the image tokens (the default of
            ``parallelize_dit`` and the ComfyUI bridge); False: replicated on every rank.

    Returns:
        ``{"mode", "wire_bytes", "messages", "counted"}``: bytes the rank sends per step, collective calls, and
        the bytes comm's accounting would count per operation (``bench/linkmodel.wire_bytes`` turns those into
        ``wire_bytes`` again). Add :func:`~.split.split_cost` for CFG-/batch-parallel exchanges.
    """
    shards = token_shards(shape, world_size, shard_text)
    if world_size == 1:
        return {"mode": "none", "wire_bytes": 0, "messages": 0, "counted": {}}
    counts = shards.seq_counts  # each rank's K/V share: its image band (and its text slice when sharded)
    replicated = 0 if shard_text else shape.text
    resolved = SeqMode(mode)
    if resolved is SeqMode.AUTO:
        resolved = choose_mode(counts, shape.heads, shape.head_dim, itemsize, batch=batch, replicated=replicated,
                               kv=kv, link=link)
    one: AttentionCost = attention_cost(resolved, counts, shape.heads, shape.head_dim, itemsize, batch=batch,
                                        replicated=replicated)
    if isinstance(kv, CompressedExchange) and resolved in (SeqMode.GATHERED, SeqMode.OVERLAPPED, SeqMode.RING):
        # each rank sends its packed residual codes of K and V (padded to the largest share) to N-1 peers
        piece = packed_bytes(2 * max(counts) * batch * shape.heads * shape.head_dim, kv.bits)
        one = AttentionCost(piece * (world_size - 1), 1, {"all_gather": piece * (world_size + 1)})
    counted = {op: shape.attention_layers * b for op, b in one.counted.items()}
    out_piece = batch * max(shards.counts) * shape.out_features * itemsize  # image tokens only: the text is dropped
    counted["all_gather"] = counted.get("all_gather", 0) + out_piece * (world_size + 1)
    wire = shape.attention_layers * one.wire_bytes + out_piece * (world_size - 1)
    messages = shape.attention_layers * one.messages + 1
    if shape.modulation:  # the modulation layers' shares: one all-gather of every layer's ceil(features / N)
        mod_piece = batch * sum(-(-f // world_size) for f in shape.modulation) * itemsize
        counted["all_gather"] += mod_piece * (world_size + 1)
        wire += mod_piece * (world_size - 1)
        messages += 1
    return {"mode": resolved.value, "wire_bytes": wire, "messages": messages, "counted": counted}

