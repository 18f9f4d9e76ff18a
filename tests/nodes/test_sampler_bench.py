"""PatchRay Sampler Benchmark without ComfyUI: its schema, its table, chart and report file. The node sampling a real
MODEL (ComfyUI's stock path against each mode on CPU ranks) runs in tests/comfyui/test_parallel_model_server.py."""

import json

from patchray.distributed.cluster import ClusterConfig
from patchray.nodes.bridge import sampler_bench as sb

ROWS = [
    sb.BenchRow("stock (this process)", 1, 2.0, 1.0, None, 0.0, None, "ComfyUI's own sampler, one device"),
    sb.BenchRow("sequence", 2, 1.25, 1.6, 41.3e6, 3.2e-7, 8),
    sb.BenchRow("batch", 2, None, None, None, None, None, "the batch (1) is smaller than the cluster's 2 ranks"),
]


def test_the_table_has_one_row_per_mode_with_the_figures_and_the_reasons():
    text = sb.table(ROWS, shared_device=True)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["mode", "ranks", "s/step"]
    seq = next(line for line in lines if line.startswith("sequence"))
    # 1.25 s/step, 2.0 / 1.25 = 1.60x, 41.3 MB per step, 3.2e-07 relative L2
    assert "1.250" in seq and "1.60x" in seq and "41.30" in seq and "3.2e-07" in seq
    refused = next(line for line in lines if line.startswith("batch"))
    assert "smaller than the cluster's 2 ranks" in refused and refused.split()[2] == "-"
    assert "not a multi-GPU speed-up" in lines[-1]
    assert "speed-up" not in sb.table(ROWS, shared_device=False)


def test_the_report_and_chart_are_written(tmp_path):
    path = sb.save(ROWS, str(tmp_path), {"steps": 4})
    data = json.loads(open(path).read())
    assert data["steps"] == 4 and [r["mode"] for r in data["rows"]] == ["stock (this process)", "sequence", "batch"]
    png = sb.write_chart(ROWS, str(tmp_path / "c.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_cpu_ranks_share_the_host():
    assert sb.shares_device(ClusterConfig(num_ranks=2, device="cpu"))


def test_the_node_takes_the_users_model_and_the_sampling_widgets():
    from patchray.nodes.bench import PatchRaySamplerBenchmark

    schema = PatchRaySamplerBenchmark.define_schema()
    assert [i.id for i in schema.inputs] == ["model", "positive", "negative", "latent_image", "cluster", "steps", "cfg",
                                            "sampler_name", "scheduler", "seed"]
    assert [o.io_type for o in schema.outputs] == ["STRING", "IMAGE", "STRING"]
