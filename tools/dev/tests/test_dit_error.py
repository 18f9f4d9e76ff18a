"""``tools/dev/dit_error.py`` on CPU ranks: the preset sampling run's per-step times, errors and bytes."""

from __future__ import annotations

import json

import pytest

from tools.dev import dit_error


def test_the_preset_sampling_run_times_every_step_and_says_where_that_is_a_multi_gpu_figure(tmp_path):
    """``dit_error`` (final-latent error and bytes of the sampling presets) also times each step with the ranks at
    once, for a one-GPU-per-rank run to read step times and speed-ups from; on CPU ranks it says the figure is not a
    multi-GPU one. full_sync is the reference (error 0); displaced mode's stale K/V change the result measurably and
    move part of its bytes asynchronously."""
    out = tmp_path / "err.json"
    doc = dit_error.run_dit_error("flux", 2, size="tiny", steps=3, warmup=1, presets=("full_sync", "displaced"),
                                  out=str(out))
    assert doc["placement"] == "CPU ranks" and doc["backend"] == "gloo"
    assert "NOT a multi-GPU figure" in doc["step_ms_note"]
    res = doc["results"]
    for name in ("full_sync", "displaced"):
        steps = res[name]["step_ms"]
        assert len(steps) == 3 and all(v > 0 for v in steps)
        assert res[name]["mean_step_ms"] == pytest.approx(sum(steps[1:]) / 2, rel=1e-3)
    assert res["full_sync"]["rel_l2_vs_full_sync"] == 0.0
    assert res["displaced"]["rel_l2_vs_full_sync"] > 1e-4
    assert res["displaced"]["mean_async_bytes_per_step"] > 0 == res["full_sync"]["mean_async_bytes_per_step"]
    assert json.loads(out.read_text())["results"]["displaced"]["step_ms"] == steps
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        dit_error.run_dit_error("flux", 2, size="tiny", device="cuda", backend="nccl")
