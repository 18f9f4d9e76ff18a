"""sample-bench end to end on 2 CPU ranks (spawn launcher): report fields, agreement, chart, table."""

from __future__ import annotations

import json
import os

from patchray.distributed.bench.sample_bench import format_table, run_sample_bench, sample_bench_main, write_chart


def test_sample_bench_report_and_chart(tmp_path):
    report = run_sample_bench(ranks=2, presets=["full_sync", "otil"], steps=5, tiny=True, height=64, width=64,
                              split="off", launcher="spawn")
    assert [c["case"] for c in report["cases"]] == ["full_sync", "otil"]
    full, otil = report["cases"]
    assert len(full["per_step_ms"]) == 5 and len(report["reference"]["per_step_ms"]) == 5
    # full_sync reproduces the single-rank run up to fp32 reordering; otil's remote regions are approximate
    assert full["rel_l2"] < 2e-5 < otil["rel_l2"]
    # otil step 4 (after 4 warm-up steps) sends latent blocks, no K/V, no halos
    assert otil["bytes_per_step"]["latent_blocks"][4] > 0 and otil["bytes_per_step"]["kv"][4] == 0
    assert otil["bytes_per_step"]["halo"][4] == 0 and otil["bytes_per_step_total"][4] < full["bytes_per_step_total"][4]
    assert otil["host_syncs_per_step"][4] == report["reference"]["host_syncs_per_step"][4]
    assert otil["modelled"] and all(v["speedup"] > 0 for v in otil["modelled"].values())
    png = write_chart(report, str(tmp_path / "s.png"))
    assert os.path.getsize(png) > 10_000
    assert "otil" in format_table(report)
    json.dumps(report, default=float)


def test_sample_bench_cli_refuses_bad_arguments(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="unknown preset"):
        sample_bench_main(["--preset", "fastest", "--tiny", "--launcher", "spawn", "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="--ranks must be >= 2"):
        sample_bench_main(["--ranks", "1", "--tiny", "--launcher", "spawn", "--out", str(tmp_path / "x.json")])
