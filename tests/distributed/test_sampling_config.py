"""PatchConfig validation, presets, the logical-step schedule, band tables and OTIL helpers (no ranks needed)."""

from __future__ import annotations

import math

import pytest
import torch

from patchray.distributed.parallel.bands import band_heights as split_rows
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
