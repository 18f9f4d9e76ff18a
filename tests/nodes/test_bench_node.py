"""The Benchmark node on real CPU Ray ranks: report JSON in the output folder, chart IMAGE, summary text."""

import json

import pytest

from .test_nodes import cluster  # noqa: F401  (the module's cluster fixture)

pytestmark = pytest.mark.usefixtures("ray_session")


def test_benchmark_node_writes_report_chart_and_summary(cluster, tmp_path, monkeypatch):
    from patchray.nodes.bench import PatchRayBenchmark

    monkeypatch.setenv("PATCHRAY_OUTPUT_DIR", str(tmp_path))
    out = PatchRayBenchmark.execute(cluster=cluster, family="kl", shape="64x64", size="tiny", half="decoder", iters=1)
    report_json, chart, summary = out.args
    saved = list((tmp_path / "patchray").glob("bench_kl_64x64_tiny_2r_*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text()) == json.loads(report_json)
    assert saved[0].with_suffix(".png").exists()
    assert chart.ndim == 4 and chart.shape[-1] == 3 and chart.shape[1] > 100
    assert chart.shape[2] == 640  # drawn for a node (6.4 in at 100 dpi), not the report's page-wide figure
    assert "FAILED" not in summary and len(summary.splitlines()) >= 2
    records = out.ui["patchray_bench"][0]["records"]
    status = {r["name"]: r["status"] for r in records}
    assert status["unsharded"] == "ok" and status["row"] == "ok"  # 64x64 is too small to tile: that case is skipped
    assert "error" not in status.values()


def test_auto_shape_and_size_fit_the_device_and_shapes_read_width_first():
    from patchray.nodes.bridge.diagnostics import bench_request

    assert bench_request("kl", "auto", "auto", "cpu") == (192, 192, 1, "tiny")  # CPU ranks: a quick suite
    assert bench_request("kl", "auto", "auto", "cuda") == (1024, 1024, 1, "full")  # GPUs: the released model
    assert bench_request("wan", "auto", "auto", "cpu") == (192, 192, 5, "tiny")  # a video family: 4k + 1 frames
    assert bench_request("kl", "1920x1080", "full", "cpu") == (1080, 1920, 1, "full")  # WIDTHxHEIGHT, as ComfyUI's widgets
    assert bench_request("wan", "832x480x81", "auto", "cuda") == (480, 832, 81, "full")
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        bench_request("kl", "1024 by 1024", "full", "cpu")
