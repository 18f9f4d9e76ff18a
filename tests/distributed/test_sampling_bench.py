"""sample-bench end to end on 2 CPU ranks (spawn launcher): report fields, agreement, chart, table."""

from __future__ import annotations

import json
import os

from patchray.distributed.bench.sample_bench import format_table, run_sample_bench, sample_bench_main, write_chart


def test_sample_bench_report_and_chart(tmp_path):
    report = run_sample_bench(ranks=2, presets=["otil"], steps=5, tiny=True, height=64, width=64, split="off", launcher="spawn")
    [otil] = report["cases"]
    assert otil["case"] == "otil" and len(otil["per_step_ms"]) == 5 and len(report["reference"]["per_step_ms"]) == 5
    # 4 synchronous warm-up steps agree with the reference to rounding; the one OTIL step leaves a visible difference
    assert 1e-6 < otil["rel_l2"] < 0.5 and otil["psnr_db"] > 20
    # step 4 (after the warm-up) sends latent blocks, no K/V and no halos; warm-up steps send K/V and halos
    by_kind = otil["bytes_per_step"]
    assert by_kind["latent_blocks"][4] > 0 and by_kind["kv"][4] == 0 and by_kind["halo"][4] == 0
    assert by_kind["kv"][0] > 0 and by_kind["halo"][0] > 0
    assert otil["bytes_per_step_total"][4] < otil["bytes_per_step_total"][0] / 10
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
    with pytest.raises(TypeError, match="no field"):
        sample_bench_main(["--set", "k_raito=0.5", "--tiny", "--launcher", "spawn", "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="k_ratio must be in"):
        sample_bench_main(["--set", "k_ratio=2", "--preset", "otil", "--launcher", "spawn", "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="--ranks must be >= 2"):
        sample_bench_main(["--ranks", "1", "--tiny", "--launcher", "spawn", "--out", str(tmp_path / "x.json")])
