"""PatchConfig validation, presets, the logical-step schedule, band tables and OTIL helpers (no ranks needed)."""

from __future__ import annotations

import math

import pytest
import torch

from patchray.distributed.bands import band_heights as split_rows
from patchray.distributed.sampling.config import (
    DEPRECATED_PRESETS,
    PRESETS,
    GroupNormMode,
    LayerMode,
    OutputMode,
    PatchConfig,
    preset,
)
from patchray.distributed.sampling.otil import choose_k


@pytest.mark.parametrize(
    "kwargs, field, fix",
    [
        ({"layer_mode": "async"}, "layer_mode", "'displaced'"),
        ({"groupnorm": "exact"}, "groupnorm", "'corrected_async'"),
        ({"output": "topk"}, "output", "'otil'"),
        ({"layer_mode": "displaced", "warmup_steps": 0}, "warmup_steps", "warmup_steps=1"),
        ({"layer_mode": "full_sync", "groupnorm": "stale", "warmup_steps": 0}, "groupnorm", "groupnorm='sync'"),
        ({"layer_mode": "full_sync", "groupnorm": "sync", "output": "otil", "warmup_steps": 0}, "output", "output='gather'"),
        ({"refresh_every": -1}, "refresh_every", "0 disables"),
        ({"block_size": 0}, "block_size", "uses 8"),
        ({"k_ratio": 0.0}, "k_ratio", "uses 0.25"),
        ({"k_ratio": 1.5}, "k_ratio", "uses 0.25"),
        ({"k_blocks": 0}, "k_blocks", "None uses k_ratio"),
        ({"cfg_repair": False, "cfg_repair_half": True}, "cfg_repair_half", "cfg_repair=True"),
        ({"compress_bits": 3}, "compress_bits", "8, 4 or 2"),
        ({"compress_bits": 4, "output": "gather"}, "compress_bits", "output='otil'"),
        ({"adaptive_k": True}, "adaptive_k", "output='otil'"),
        ({"output": "otil", "adaptive_k": True, "k_blocks": 3}, "k_blocks", "k_blocks=None"),
        ({"link_bandwidth_gbps": 0.0}, "link_bandwidth_gbps", "or None"),
        ({"comm_checkpoint": 0}, "comm_checkpoint", "uses 60"),
    ],
)
def test_validation_names_field_and_fix(kwargs, field, fix):
    with pytest.raises(ValueError) as err:
        PatchConfig(**kwargs)
    assert field in str(err.value) and fix in str(err.value), str(err.value)


def test_type_errors_and_unknown_overrides():
    with pytest.raises(TypeError, match="warmup_steps must be an int"):
        PatchConfig(warmup_steps=2.0)
    with pytest.raises(TypeError, match="no field"):
        preset("otil", k_raito=0.5)
    with pytest.raises(ValueError, match="unknown preset 'fast'"):
        preset("fast")


def test_presets_hold_the_settings_docs_sampling_describes():
    unsynced, otil, balanced = PRESETS["otil_unsynced"], PRESETS["otil"], PRESETS["balanced"]
    assert unsynced.layer_mode is LayerMode.NO_SYNC and unsynced.output is OutputMode.OTIL
    assert unsynced.groupnorm is GroupNormMode.SEPARATE and unsynced.refresh_every == 0
    assert (unsynced.block_size, unsynced.k_ratio, unsynced.warmup_steps) == (8, 0.25, 4)
    # otil = otil_unsynced + the two fixes for what stays stale (GroupNorm sync, periodic refresh), nothing else
    diff = {k for k, v in otil.to_dict().items() if unsynced.to_dict()[k] != v}
    assert diff == {"groupnorm", "refresh_every"} and otil.groupnorm is GroupNormMode.SYNC and otil.refresh_every > 0
    assert balanced.output is OutputMode.GATHER and balanced.groupnorm is GroupNormMode.SYNC
    assert PRESETS["displaced"].layer_mode is LayerMode.DISPLACED and PRESETS["full_sync"].layer_mode is LayerMode.FULL_SYNC
    assert all(p.cfg_repair for p in PRESETS.values())
    # every field is overridable and re-validated
    assert preset("otil", k_ratio=0.5, split_batch=False).k_ratio == 0.5
    with pytest.raises(ValueError):
        preset("displaced", warmup_steps=0)


def test_deprecated_preset_name_still_works_and_warns(caplog):
    # saved workflows may name the preset by its old name
    assert DEPRECATED_PRESETS == {"guide": "otil_unsynced"}
    assert "guide" not in PRESETS  # listed once, under the name that says what it does
    with caplog.at_level("WARNING", logger="patchray.distributed.sampling.config"):
        cfg = preset("guide", k_ratio=0.5)
    assert cfg == PRESETS["otil_unsynced"].replace(k_ratio=0.5)
    assert any("'guide' is deprecated" in r.getMessage() and "'otil_unsynced'" in r.getMessage() for r in caplog.records)
    with caplog.at_level("WARNING", logger="patchray.distributed.sampling.config"):
        caplog.clear()
        preset("otil")
    assert not caplog.records  # current names do not warn


def test_sync_schedule_is_by_logical_step():
    cfg = preset("otil", warmup_steps=2, refresh_every=5)
    assert [cfg.is_sync_step(i) for i in range(12)] == [True, True, False, False, False, True] + [False] * 4 + [True, False]
    assert all(PRESETS["full_sync"].is_sync_step(i) for i in range(10))
    assert not any(PRESETS["otil_unsynced"].is_sync_step(i) for i in range(4, 60))


def test_split_rows_uneven_and_refusals():
    assert split_rows(32, 3, 4) == (12, 12, 8)
    assert split_rows(128, 6, 4) == (24, 24, 20, 20, 20, 20)
    assert sum(split_rows(36, 4, 4)) == 36
    with pytest.raises(ValueError, match="multiple of 4"):
        split_rows(30, 2, 4)
    with pytest.raises(ValueError, match="fewer ranks"):
        split_rows(8, 3, 4)


def test_choose_k_follows_bandwidth():
    # 1024^2 SDXL band on 2 ranks: 128 blocks of 8x8, 1 x 4 channels fp16 + index
    block_bytes = 4 * 64 * 2 + 4
    slow = choose_k(128, block_bytes, 1, bandwidth_gbps=0.05, budget_ms=0.5)
    fast = choose_k(128, block_bytes, 1, bandwidth_gbps=25.0, budget_ms=0.5)
    assert 1 <= slow < fast == 128


# --------------------------------------------------------------------------------------------------
# preset=auto: the link and the rank count, through the modelled step (topology/preset_cost.py)
#
# Hand arithmetic, in units of one rank's whole step: compute share 1/N; a rank sends (N-1)/N x E of exchange (E the
# exchange rate, GB/s per second of one-rank compute: UNet 13.3, DiT 16.7) over the link's effective bandwidth b
# (PCIe 4.0 x16 = round(31.5 x 55.3 / 63, 1) = 27.6 GB/s, halved without P2P: 13.8; NVLink 360; 10 GbE 1.18);
# packing 1 / 0.2578 (4-bit) / 0.1328 (2-bit); codec 5 x (N-1)/N x E / 2000 added to compute of the compressed ones.
# full_sync = 1/N + t; stale = c + max(0, t - c); full_sync wins within 10% of the fastest.


def test_auto_preset_depends_on_the_rank_count_where_the_arithmetic_says_so():
    from patchray.distributed.sampling.config import auto_preset

    # PCIe 4.0 without P2P, UNet. N = 2: t = 0.5 x 13.3 / 13.8 = 0.482 < c = 0.5, displaced's stream hides: 0.500;
    # compressed 0.5 + 5 x 6.65 / 2000 = 0.517; full_sync 0.982 -> displaced
    assert auto_preset("pcie4_x16_no_p2p", 2) == "displaced"
    # N = 4: displaced t = 0.75 x 13.3 / 13.8 = 0.723 (stream uncovered); compressed c = 0.25 + 0.025 = 0.275 >
    # t = 0.186: 0.275 (2-bit ties at 0.275; the less lossy wins) -> compressed
    assert auto_preset("pcie4_x16_no_p2p", 4) == "compressed"
    # NVLink, UNet. N = 2: full_sync 0.5 + 6.65 / 360 = 0.518, 3.7% over displaced's 0.5 -> full_sync (exact)
    assert auto_preset("nvlink", 2) == "full_sync"
    assert auto_preset("nvlink", 3) == "full_sync"  # 2 x 13.3 / 360 = 7.4% over 1/3
    # N = 4: full_sync 0.25 + 9.975 / 360 = 0.2777, 11.1% over displaced's 0.25 -> displaced
    assert auto_preset("nvlink", 4) == "displaced"
    # PCIe 4.0 with P2P (27.6 GB/s, one copy): the stream hides while (N - 1) x 13.3 <= 27.6, i.e. up to N = 3
    assert auto_preset("pcie4_x16_p2p", 3) == "displaced"  # t = 2/3 x 13.3 / 27.6 = 0.321 < 0.333
    assert auto_preset("pcie4_x16_p2p", 4) == "compressed"  # displaced 0.361; compressed 0.275 (t = 0.093)
    # a DiT's higher rate (16.7) at N = 2 without P2P: t = 0.5 x 16.7 / 13.8 = 0.605 > 0.5; compressed 0.5 + 0.021
    assert auto_preset("pcie4_x16_no_p2p", 2, kind="dit") == "compressed"
    # a measured rate overrides the kind's: Wan 2.1 14B's 8.3 GB/s hides at N = 2 (t = 0.301)
    assert auto_preset("pcie4_x16_no_p2p", 2, kind="dit", exchange_gbps=8.3) == "displaced"
    # 10 GbE, N = 2: displaced 6.65 / 1.18 = 5.64; compressed 6.65 x 0.2578 / 1.18 = 1.45; 2-bit 0.75 -> 2-bit
    assert auto_preset("10gbe", 2) == "compressed_2bit"
    # one rank: nothing travels, every preset costs one step -> the exact one
    assert auto_preset("pcie4_x16_no_p2p", 1) == "full_sync"
    assert auto_preset(None, 4) == "full_sync"  # no GPU link known (CPU ranks)
    with pytest.raises(ValueError, match="kind must be one of"):
        auto_preset("nvlink", 2, kind="vae")


def test_modelled_preset_steps_match_the_hand_arithmetic():
    from patchray.distributed.topology.preset_cost import PresetTraffic, choose_preset, packing, preset_step

    assert packing(4) == pytest.approx(132 / 512) and packing(2) == pytest.approx(68 / 512) and packing(0) == 1.0
    full, disp, c4 = PresetTraffic("full_sync", True), PresetTraffic("displaced", False), PresetTraffic("compressed", False, 4)
    assert preset_step(full, 2, "pcie4_x16_no_p2p", 13.3) == pytest.approx(0.5 + 6.65 / 13.8)
    assert preset_step(disp, 2, "pcie4_x16_no_p2p", 13.3) == pytest.approx(0.5)
    assert preset_step(disp, 4, "pcie4_x16_no_p2p", 13.3) == pytest.approx(9.975 / 13.8)
    # compressed: the codec measured on an H200 (Triton kernels: 1.28 ms per GB encoded, 0.70 per GB applied;
    # op by op 27.48 / 9.56): the rank encodes its own 13.3 / 4 GB per step-second and applies 3 peers' as much;
    # the packed stream (9.975 GB x 132/512 through 13.8 GB/s) hides behind that compute
    assert preset_step(c4, 4, "pcie4_x16_no_p2p", 13.3) == pytest.approx(0.25 + 3.325 * (1.28 + 3 * 0.70) / 1e3)
    assert preset_step(c4, 4, "pcie4_x16_no_p2p", 13.3, codec="eager") == pytest.approx(0.25 + 3.325 * (27.48 + 3 * 9.56) / 1e3)
    with pytest.raises(ValueError, match="codec must be one of"):
        preset_step(c4, 4, "pcie4_x16_no_p2p", 13.3, codec="fast")
    choice = choose_preset([full, disp, c4], 4, "nvlink", 13.3)
    assert choice.preset == "displaced" and choice.steps["full_sync"] == pytest.approx(0.25 + 9.975 / 360)
    # the margin is the rule: with 12% instead of 10%, NVLink at N = 4 keeps the exact preset
    assert choose_preset([full, disp, c4], 4, "nvlink", 13.3, exact_margin=0.12).preset == "full_sync"
