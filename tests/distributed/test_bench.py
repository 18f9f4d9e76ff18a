"""The VAE benchmark: schema-8 records for every case kind, the counting rules of docs/benchmark.md on a known
exchange, the out-of-memory path, the link throttle, option conflicts and exit statuses.

All rank work happens in ONE spawn of two real gloo ranks (``_rank_checks``) on tiny reduced-width VAEs; the
end-to-end test runs the real command once through the spawn launcher. No timing is asserted, except that a
throttled exchange takes at least as long as the sleep the throttle added (a lower bound ``time.sleep`` guarantees).
"""

import dataclasses
import json
import os
import time

import pytest
import torch

from patchray.distributed.bench import vae_bench as vb
from patchray.distributed.bench.catalog import CANONICAL_SHAPES, parse_shape
from patchray.distributed.bench.linkmodel import LINK_PROFILES, throttle_link, time_comm
from patchray.distributed.bench.measure import measure, unique_path
from patchray.distributed.bench.records import agreement, json_safe
from patchray.distributed.comm import all_gather_object, all_reduce, exchange_halo, log_comm
from patchray.distributed.spawn import run_ranks
from patchray.distributed.vae.families import FAMILIES, build_vae, latent_shape

NoneType = type(None)
NUM = (int, float)


def _opts(*argv):
    """Options exactly as the command line resolves them (CPU profile), as the dict the ranks receive."""
    args = vb.build_parser().parse_args(["--size", "tiny", "--warmup", "0", "--iters", "1", "--ranks", "2", *argv])
    return dataclasses.asdict(vb.resolve_options(args, cuda_available=False))


def _oom_cap_mb(height, width):
    """A cap between the unsharded decode's and one row band's estimate (weights + a layer's input and output).

    Tiny kl decodes at full resolution with 8 channels: a full-resolution GroupNorm or convolution holds
    2 x 8*H*W fp32 (in + out), one row band of two holds about half of that (plus a few halo rows). 1.5 x one
    activation lies strictly between.
    """
    weights = sum(p.numel() * p.element_size() for p in build_vae("kl", "tiny").parameters())
    act = 8 * height * width * 4
    return (weights + 1.5 * act) / 2**20


# --------------------------------------------------------------------------------------------------
# rank side (module level: spawn pickles it by name)


def _known_comm(ctx):
    """One all_reduce of 1000 fp32 and one halo exchange with a known table, measured like a case."""
    opts = vb.Options(**_opts("--height", "128", "--width", "128"))
    x = torch.arange(4 * 8 * 8, dtype=torch.float32).reshape(1, 4, 8, 8)
    halos = [(0, 3), (2, 0)]  # rank 0 needs 3 rows from rank 1; rank 1 needs 2 rows from rank 0

    def fn():
        all_reduce(torch.ones(1000), ctx)
        return exchange_halo(x, ctx, 2, halos)

    m, out = measure(ctx, opts, fn, "known")
    return {"block": vb.comm_block(all_gather_object(m["comm"], ctx)), "error": m["error"],
            "received": [t.shape[2] if t is not None else 0 for t in out]}


def _throttled(ctx):
    t = torch.ones(1 << 20)  # 4 MiB: ring all-reduce puts 4 MiB * 2 (n-1)/n = 4 MiB on the wire at n = 2
    # the three hooks on comm's one interception layer, installed in the benchmark's order
    with throttle_link("10gbe", ctx.world_size) as stats, time_comm() as timed, log_comm() as log:
        start = time.perf_counter()
        all_reduce(t, ctx)
        elapsed_ms = (time.perf_counter() - start) * 1e3
    return {"stats": dict(stats), "elapsed_ms": elapsed_ms, "timed": dict(timed), "log": log.to_dict()}


def _rank_checks(ctx, payloads):
    out = {name: vb.bench_rank(ctx, payload) for name, payload in payloads.items()}
    out["known"] = _known_comm(ctx)
    out["throttle"] = _throttled(ctx)
    return out


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def ranks(monkeypatch_module, profile_dir):
    monkeypatch_module.delenv("HW_FAMILY", raising=False)
    payloads = {
        # default suite + diagnostics: unsharded, row, tile-runs x3, local x3, row-tiled
        "suite": _opts("--height", "256", "--width", "192", "--diagnostics"),
        "encoder": _opts("--half", "encoder", "--height", "128", "--width", "128"),
        # 128x128 is 16x16 latent: no tile plan at two ranks, so the tiled case is recorded as skipped
        "small": _opts("--height", "128", "--width", "128"),
        "oom": _opts("--height", "256", "--width", "192", "--case", "unsharded", "--case", "row",
                     "--max-memory-mb", f"{_oom_cap_mb(256, 192):.4f}"),
        "costs": _opts("--height", "256", "--width", "192", "--tile-shape-costs", "--tile-shape-windows", "16x16,24x16",
                       "--tile-shape-batch", "2"),
        "link": _opts("--height", "128", "--width", "128", "--case", "row", "--link", "10gbe",
                      "--profile", "--profile-trace", "--profile-memory", "--profile-dir", str(profile_dir)),
    }
    results = run_ranks(_rank_checks, 2, payloads, timeout_s=400)
    return results


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# --------------------------------------------------------------------------------------------------
# schema

COMMON = {
    "schema": int, "benchmark": str, "family": str, "half": str, "size": str, "architecture_digest": str,
    "catalog_version": int, "shape": dict, "latent_shape": list, "batch": int, "world_size": int, "dtype": str,
    "device": str, "mode": str, "case": str, "name": str, "status": str, "warmup": int, "iters": int,
    "agreement_enforced": bool, "hw_family": NoneType, "provenance": dict,
}
MEASURED = {
    "latency_ms": float, "latency_ms_iterations": list, "latency_ms_by_rank": list, "peak_memory": dict, "comm": dict,
    "link_model": dict, "compute_ms_by_rank": list, "wire_bytes_by_rank": list, "cpu_s_by_rank": list, "error": NoneType,
}


def _check_types(rec, fields):
    for key, kind in fields.items():
        assert key in rec, f"{rec.get('name')}: missing {key}"
        assert isinstance(rec[key], kind), f"{rec.get('name')}: {key} is {type(rec[key]).__name__}, want {kind}"


def _check_measured(rec):
    _check_types(rec, COMMON)
    _check_types(rec, MEASURED)
    assert rec["schema"] == 8 and rec["status"] == "ok" and rec["world_size"] == 2
    assert rec["shape"]["label"] == f"{rec['shape']['height']}x{rec['shape']['width']}x{rec['shape']['frames']}"
    # the unsharded reference runs on rank 0 alone (the other rank waits): its per-rank figures are rank 0's
    measured = 1 if rec["mode"] == "unsharded" else 2
    assert rec["reference_ranks"] == ([0] if rec["mode"] == "unsharded" else None)
    assert rec["latency_ms"] > 0 and len(rec["latency_ms_by_rank"]) == measured and len(rec["cpu_s_by_rank"]) == measured
    peak = rec["peak_memory"]
    assert peak["metric"] == "process_rss_peak" and isinstance(peak["max_bytes"], int) and len(peak["by_rank_bytes"]) == measured
    assert "host RAM" in peak["note"]  # CPU ranks: labelled as process RSS, not accelerator memory
    comm = rec["comm"]
    for key in ("total_calls", "total_calls_max"):
        assert isinstance(comm[key], int)
    assert comm["total_calls"] == comm["total_calls_by_rank"][0] and comm["total_calls_max"] == max(comm["total_calls_by_rank"])
    assert isinstance(comm["bytes"]["by_op"], dict) and isinstance(comm["bytes"]["total"], int)
    assert set(rec["link_model"]) == set(LINK_PROFILES)
    assert all(isinstance(v, float) and v >= 0 for v in rec["link_model"].values())
    prov = rec["provenance"]
    for key in ("versions", "revision", "source_digest", "bench_digest", "device"):
        assert key in prov
    assert prov["versions"]["torch"] == torch.__version__ and prov["device"]["type"] == "cpu"
    assert len(prov["device"]["names_by_rank"]) == 2
    json.dumps(json_safe(rec), allow_nan=False)


def _check_agreement(rec):
    agr = rec["agreement"]
    assert isinstance(agr, dict), rec["agreement_note"]
    assert isinstance(agr["max_abs"], float) and isinstance(agr["mean_abs"], float)
    assert agr["psnr_db"] is None or isinstance(agr["psnr_db"], float)


def test_decoder_suite_records(ranks):
    recs = ranks[0]["suite"]
    assert ranks[1]["suite"] == recs  # every rank returns the same finished records
    names = [r["name"] for r in recs]
    assert names[:2] == ["unsharded", "row"]
    modes = [r["mode"] for r in recs]
    plans = sum(m == "tile-runs" for m in modes)
    assert plans in (2, 3) and len(recs) == 2 + plans + plans + 1  # + local per plan + row-tiled in the finest
    assert modes.count("local") == plans and modes[-1] == "row-tiled"
    for rec in recs:
        _check_measured(rec)
    unsharded, row = recs[0], recs[1]
    assert unsharded["agreement"] is None and unsharded["window"] is None and unsharded["tile"] is None
    assert unsharded["comm"]["total_calls_max"] == 0 and unsharded["comm"]["bytes"]["total"] == 0
    _check_agreement(row)
    assert row["agreement_enforced"] and row["agreement_ok"] is True
    assert row["comm"]["total_calls_max"] > 0
    # fp32 row decode equals the unsharded decode up to reduction order: 1e-4, ten times inside the enforced 1e-3
    assert row["agreement"]["max_abs"] <= 1e-4
    for rec in recs[2:]:
        _check_agreement(rec)
        assert not rec["agreement_enforced"] and rec["agreement_ok"] is None  # tiling differences: reported only
        assert isinstance(rec["window"], list) and len(rec["window"]) == 2 and all(isinstance(v, int) for v in rec["window"])
        assert isinstance(rec["overlap"], list) and len(rec["overlap"]) == 2
        assert isinstance(rec["beats_row_sharding"], bool) and rec["plan"] in ("coarse", "balanced", "fine")
        assert isinstance(rec["planner"]["candidate_limit"], int) and isinstance(rec["planner"]["frontier_size"], int)
        assert rec["case"].startswith(rec["mode"] + ":") and "seam_error" in rec
    for rec in recs:
        if rec["mode"] == "local":
            assert rec["comm"]["total_calls_max"] == 0  # local tiling has no collectives
    windows = [r["tile"]["latent_window"] for r in recs if r["mode"] == "tile-runs"]
    areas = [a * b for a, b in windows]
    assert areas[0] == max(areas) and areas[-1] == min(areas)  # coarse first, fine last


def test_encoder_and_skipped_records(ranks):
    enc = ranks[0]["encoder"]
    assert [r["mode"] for r in enc] == ["unsharded", "row"]  # tiling is decode-only
    for rec in enc:
        _check_measured(rec)
        assert rec["half"] == "encoder"
    _check_agreement(enc[1])
    assert enc[1]["agreement_ok"] is True
    small = ranks[0]["small"]
    assert [r["mode"] for r in small] == ["unsharded", "row", "tile-runs"]
    skipped = small[2]
    _check_types(skipped, COMMON)
    assert skipped["status"] == "skipped" and skipped["error"]["kind"] == "plan"
    assert "nearest valid request" in skipped["error"]["message"] and skipped["latency_ms"] is None
    assert vb.exit_status(small) == 0


def test_tile_shape_costs(ranks):
    recs = ranks[0]["costs"]
    assert [r["tile"]["latent_window"] for r in recs] == [[16, 16], [24, 16]]
    for rec in recs:
        _check_measured(rec)
        assert rec["mode"] == "tile-shape-cost" and rec["tile"]["batch"] == 2
        assert rec["window"] == [128, 128] or rec["window"] == [192, 128]
        assert rec["comm"]["total_calls_max"] == 0


def test_out_of_memory_case_is_recorded_and_the_rest_continue(ranks):
    unsharded, row = ranks[0]["oom"]
    assert unsharded["status"] == "error" and unsharded["error"]["kind"] == "oom"
    assert "--max-memory-mb" in unsharded["error"]["message"]
    # only rank 0 ran the reference (and ran out of memory); rank 1 waited
    assert unsharded["errors_by_rank"] == ["oom", None] and unsharded["latency_ms"] is None
    assert row["status"] == "ok" and row["latency_ms"] > 0
    # no reference: agreement is null with the reason, and the enforced check is not judged
    assert row["agreement"] is None and "unsharded reference failed (oom)" in row["agreement_note"]
    assert row["agreement_ok"] is None
    assert vb.exit_status([unsharded, row]) == 0  # a resource limit is a result, not a failure


def test_known_exchange_counts(ranks):
    # docs/benchmark.md: batch_isend_irecv is one call; its sends/receives are "batched": bytes, no calls
    row_bytes = 4 * 8 * 4  # one row of a [1, 4, 8, 8] fp32 tensor along dim 2
    for rank in (0, 1):
        known = ranks[rank]["known"]
        assert known["error"] is None
        block = known["block"]
        assert block["total_calls"] == 2 and block["total_calls_max"] == 2 and block["total_calls_by_rank"] == [2, 2]
        assert block["calls_by_op"] == {"all_reduce": 1, "batch_isend_irecv": 1}
        assert block["batched_calls_by_op"] == {"irecv": 1, "isend": 1}
        assert block["bytes"]["by_op"]["all_reduce"] == 4000
        assert block["bytes"]["by_op"]["isend"] == 2 * row_bytes  # rank 0 sends 2 rows, rank 1 receives them
        assert block["bytes"]["by_op"]["irecv"] == 3 * row_bytes
        assert block["bytes"]["total"] == 4000 + 5 * row_bytes
    assert ranks[0]["known"]["received"] == [0, 3] and ranks[1]["known"]["received"] == [2, 0]


def test_link_throttle_really_slows_the_exchange(ranks):
    # 10gbe: 1.25 GB/s x 1448/1538 = 1.18 GB/s and 50 us per message. Ring all-reduce of 4 MiB at n = 2 puts
    # 4,194,304 B x 2 (2-1)/2 = 4,194,304 B on the wire: 4,194,304 / 1.18e9 s = 3.5545 ms, + 0.05 ms = 3.6045 ms
    modelled = 3.604
    for rank in (0, 1):
        th = ranks[rank]["throttle"]
        assert th["stats"]["calls"] == 1 and th["stats"]["profile"] == "10gbe"
        assert th["elapsed_ms"] >= modelled  # the throttle sleeps until the call took the modelled time
        # the timer, installed after the throttle, runs outside it: it bills the sleep to communication
        assert th["timed"]["calls"] == 1 and th["timed"]["ms"] >= modelled
        # counting sees the one call and its 4 MiB buffer, throttled or not
        assert th["log"]["calls"] == {"all_reduce": 1} and th["log"]["bytes"] == {"all_reduce": 4 * (1 << 20)}
    rec = ranks[0]["link"][0]
    assert rec["link"]["profile"] == "10gbe" and rec["link"]["throttled"]
    # the throttle sits under the accounting: the same row decode counts the same calls and bytes throttled or not
    plain = ranks[0]["small"][1]
    assert plain["mode"] == "row" and plain["shape"] == rec["shape"]
    assert rec["comm"]["total_calls_by_rank"] == plain["comm"]["total_calls_by_rank"]
    assert rec["comm"]["bytes"] == plain["comm"]["bytes"] and rec["comm"]["calls_by_op"] == plain["comm"]["calls_by_op"]
    # tiny messages may already take longer than the model on loopback gloo, so the sleep itself is not predictable
    assert len(rec["link"]["slept_ms_by_rank"]) == 2 and all(isinstance(s, float) for s in rec["link"]["slept_ms_by_rank"])


def test_profiler_artifacts(ranks, profile_dir):
    files = ranks[0]["link"][0]["profile"]["files"]
    names = sorted(os.path.basename(f) for f in files)
    stem = "kl-decoder-128x128x1-row-rank"
    assert names == sorted(f"{stem}{r}{ext}" for r in (0, 1) for ext in (".txt", ".trace.json", ".memory.txt"))
    assert all(os.path.getsize(f) > 0 for f in files)
    # a repeated name gets a numeric suffix before its extension
    again = unique_path(str(profile_dir / f"{stem}0.trace.json"))
    assert os.path.basename(again) == f"{stem}0-1.trace.json"


# --------------------------------------------------------------------------------------------------
# options, exit statuses, output form (driver side: no ranks)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--case", "row", "--shape", "256x256"], "cannot be combined"),
        (["--case", "row", "--matrix"], "cannot be combined"),
        (["--family", "nope"], "unknown family"),
        (["--half", "encoder", "--case", "local:128x128@32x32", "--height", "256", "--width", "256"], "decode-only"),
        (["--half", "encoder", "--diagnostics"], "decode-only"),
        (["--case", "tiles:1x1@0x0"], "unknown tiled mode"),
        (["--link", "carrier-pigeon"], "unknown link profile"),
        (["--height", "100", "--width", "256"], "divisible"),
        (["--case", "tile-runs:64x64@16x16", "--height", "256", "--width", "256"], "case"),
        (["--shape", "256"], "HEIGHTxWIDTH"),
    ],
)
def test_setup_errors_exit_2(argv, message, capsys):
    assert vb.bench_main(["--size", "tiny", "--launcher", "spawn", *argv]) == 2
    assert message in capsys.readouterr().err


def test_help_and_usage_errors():
    assert vb.bench_main(["--help"]) == 0
    assert vb.bench_main(["--half", "sideways"]) == 2


def test_agreement_against_hand_computed_figures():
    out = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ref = torch.tensor([1.0, 2.0, 3.0, 6.0])
    agr = agreement(out, ref)
    # differences 0, 0, 0, 2: max 2, mean 2/4 = 0.5, MSE 4/4 = 1; data range 6 - 1 = 5: PSNR 10 log10(25) = 13.9794 dB
    assert agr["max_abs"] == 2.0 and agr["mean_abs"] == 0.5 and agr["data_range"] == 5.0
    assert abs(agr["psnr_db"] - 13.9794) < 1e-4 and agr["identical"] is False
    same = agreement(ref, ref)  # identical: no error, PSNR undefined (null), not infinite
    assert same["max_abs"] == 0.0 and same["mean_abs"] == 0.0 and same["psnr_db"] is None and same["identical"]


def test_exit_status_rules():
    ok = {"status": "ok", "error": None, "agreement_enforced": True, "agreement_ok": True}
    assert vb.exit_status([ok]) == 0
    assert vb.exit_status([ok, dict(ok, agreement_ok=False)]) == 1  # row agreement is enforced
    tiled_off = {"status": "ok", "error": None, "agreement_enforced": False, "agreement_ok": None}
    assert vb.exit_status([ok, tiled_off]) == 0  # tiling differences are reported only
    for kind, code in (("oom", 0), ("index_limit", 0), ("execution", 1), ("structural", 1)):
        assert vb.exit_status([ok, dict(tiled_off, status="error", error={"kind": kind})]) == code


def test_defaults_options_and_catalog(monkeypatch):
    monkeypatch.setenv("HW_FAMILY", "h200-pod")
    args = vb.build_parser().parse_args([])
    opts = vb.resolve_options(args, cuda_available=False)
    # the no-argument CPU default: kl, full architecture, 192x192 on two ranks, fp32, 1 warm-up + 2 iterations
    assert (opts.family, opts.size, opts.shapes, opts.ranks, opts.dtype, opts.warmup, opts.iters) == (
        "kl", "full", [(192, 192, 1)], 2, "fp32", 1, 2)
    assert opts.out.endswith(os.path.join("patchray-report", "kl-decoder-192x192x1-2r-fp32.json"))
    assert opts.defaults_used == "cpu" and opts.hw_family == "h200-pod"
    matrix = vb.resolve_options(vb.build_parser().parse_args(["--family", "wan", "--matrix"]), cuda_available=False)
    assert matrix.shapes == [(480, 832, 81), (720, 1280, 81)]  # height x width x frames everywhere
    assert not matrix.single_object
    one = vb.resolve_options(vb.build_parser().parse_args(["--case", "row", "--height", "256", "--width", "256"]), cuda_available=False)
    assert one.single_object  # one exact case: written as an object
    assert parse_shape("720x1280x81") == (720, 1280, 81) and parse_shape("64x32") == (64, 32, 1)
    assert set(CANONICAL_SHAPES) == set(FAMILIES)
    for family, shapes in CANONICAL_SHAPES.items():
        for h, w, f in shapes:
            assert len(latent_shape(family, h, w, f)) == (5 if FAMILIES[family].is_video else 4)


def test_end_to_end_command_enforces_row_agreement(tmp_path):
    """The real command through the spawn launcher: JSON array + PNG, and exit 1 when row agreement fails.

    ``--row-tolerance -1`` cannot be met by any decode, so the enforced check must fail the run.
    """
    out = tmp_path / "run.json"
    code = vb.bench_main(["--size", "tiny", "--launcher", "spawn", "--ranks", "2", "--height", "128", "--width", "128",
                          "--case", "unsharded", "--case", "row", "--warmup", "0", "--iters", "1",
                          "--row-tolerance", "-1", "--out", str(out)])
    assert code == 1
    data = json.loads(out.read_text())
    assert isinstance(data, list) and [r["mode"] for r in data] == ["unsharded", "row"]
    assert data[1]["agreement_ok"] is False and data[1]["agreement_tolerance"]["max_abs"] == -1
    assert (tmp_path / "run.png").stat().st_size > 10_000
