"""Opt-in: the Distributed KSampler with sharding=blocks and blocks+offload equals sharding=none and ComfyUI's stock sampling.

Runs ``shard_ranks.py`` with ComfyUI's Python on 2 gloo CPU ranks: ComfyUI's own Flux (sequence), Wan 2.1 (sequence),
an SD-style UNet (cfg), Flux with fp8_e4m3fn block weights (ComfyUI's per-layer cast), a Wan 2.1 in ComfyUI's
scaled-fp8 checkpoint layout loaded by its own detection (sequence, cfg, and sequence with a LoRA) and LTX-Video
(sequence: its RoPE is cut per rank by a hook on each block, which FSDP2 wraps), Wan VACE, SD3 and Lumina 2
(sequence), each built by the node's rank code from the node's payload with each sharding (blocks+offload: FSDP2's
CPUOffloadPolicy; on CPU ranks the copy to the device is a no-op, the offload path itself runs).

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -k shard_ranks
"""

from .rank_harness import comfyui_marks, run_rank_script

pytestmark = comfyui_marks()

CASES = ["flux-seq", "wan21-seq", "unet-cfg", "flux-seq-fp8", "wan21-seq-scaled", "wan21-cfg-scaled", "wan21-seq-scaled-lora",
         "ltxv-seq", "hunyuani2v-seq", "vace-seq", "sd3-seq", "lumina2-seq"]
#: 0-d parameters in the blocks of the scaled-fp8 Wan: scale_weight and scale_input of 10 Linears in each of 2 blocks
SCALED_BLOCK_SCALARS = 40


def test_sharded_blocks_equal_whole_weights(tmp_path):
    report = run_rank_script("shard_ranks.py", tmp_path, 2, CASES, timeout=900)
    for rank, cases in enumerate(report["per_rank"]):
        for name in CASES:
            rec = cases[name]
            print(f"rank {rank} {name}: blocks vs none {rec['blocks_vs_none']:.2e}, gathered {rec['gathered_bytes']} B")
            # a gathered weight is the original tensor byte for byte: the same ops on the same values (measured 0.0);
            # 1e-5 (fp32) is the sequence-parallel bound, a wrong shard or a missed gather gives > 1e-2
            assert rec["blocks_vs_none"] <= 1e-5, (name, rec)
            assert rec["calls_none"] == rec["calls_blocks"] == 3, (name, rec)
            assert rec["units"] >= 2 and rec["dim0_ok"], (name, rec)
            # each rank holds half of the blocks' bytes (FSDP2 pads dim 0 to even: a little more at most)
            assert 0.4 * rec["block_bytes"] <= rec["local_block_bytes"] <= 0.55 * rec["block_bytes"], rec
            # three model calls gathered every block each time (cfg: cond and uncond on different ranks, one call each)
            assert rec["gathered_bytes"] >= 3 * rec["block_bytes"], (name, rec)
            # blocks+offload: FSDP2's CPU offload on every block, the shards on the host, each block gathered per call;
            # the same bytes as blocks, so the same latent (measured 0.0; 1e-5 as above)
            print(f"rank {rank} {name}: blocks+offload vs none {rec['offload_vs_none']:.2e}")
            assert rec["offload_vs_none"] <= 1e-5, (name, rec)
            assert rec["calls_blocks+offload"] == 3, (name, rec)
            assert rec["offload_policy"] == "CPUOffloadPolicy" and rec["offload_shard_devices"] == ["cpu"], rec
            assert rec["offload_units"] == rec["units"] and rec["offload_gathered_bytes"] == rec["gathered_bytes"], rec
            # ComfyUI's loader counts what the card holds: the parameters outside the blocks and two blocks in flight
            # (the running one and the prefetched next), not the shards (in host memory)
            assert rec["offload_mp_size"] == rec["offload_rest_bytes"] + 2 * rec["offload_largest_block"], rec
            if name.endswith("fp8") or "scaled" in name:
                assert rec["fp8_local"] == ["torch.float8_e4m3fn"], rec
                # gathered as bytes: far below the fp32 size of the same weights
                assert rec["gathered_bytes"] < 3 * rec["block_bytes"] * 1.2, rec
            if "scaled" in name:
                # every layer's scales stay whole on every rank (not sharded, not gathered), equal to the loaded ones
                print(f"rank {rank} {name}: {rec['block_scalars']} scales kept whole in the blocks")
                assert rec["block_scalars"] == SCALED_BLOCK_SCALARS and rec["block_scalars_whole"], rec
            else:
                assert rec["block_scalars"] == 0, rec
            if name.endswith("lora"):
                # the LoRA's weights ship as ComfyUI's own patching writes them (the layer's convert_weight and
                # set_weight: scale, LoRA, unscale, stochastic rounding to fp8 with the key's seed), byte for byte
                assert rec["lora_equal_comfy"] and rec["lora_dtypes"] == ["torch.float8_e4m3fn"], rec
                assert rec["lora_weights"] == rec["lora_changed"] == 20, rec  # every patched weight changed by it
        if rank == 0:
            for name in CASES:
                rec = cases[name]
                print(f"{name}: none vs stock {rec['none_vs_stock']:.2e}, blocks vs stock {rec['blocks_vs_stock']:.2e}")
                # fp32 compute (the scaled-fp8 weights are cast to fp32 per layer, as the stock KSampler casts them):
                # the ranks compute the same ops on the same weight bytes and scales; sequence parallelism only
                # reorders sums (attention over keys gathered in rank order, GEMMs over fewer rows), ~1e-6 in fp32.
                # A lost scale, a LoRA applied twice or rounded with another seed, or a RoPE left uncut gives > 1e-2.
                assert rec["blocks_vs_stock"] <= 1e-5 and rec["none_vs_stock"] <= 1e-5, (name, rec)
