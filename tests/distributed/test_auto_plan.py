"""The measured plan behind parallelism=auto: the layout choice from given measured figures, the cache and its key.

Every expected figure below is worked out by hand from the formula in distributed/bench/auto_plan.py's docstring, on
the link profiles of distributed/topology/links.py: 10gbe 1.18 GB/s and 50 us a message, one copy; nvlink 360 GB/s and
5 us; pcie4_x16_no_p2p 27.6 GB/s and 20 us, two copies.
"""

import json

import pytest

from patchray.distributed.bench import auto_plan as ap

# one conditioning's call of a FLUX.1-sized DiT at 1024x1024: 4,096 tokens, 24 heads x 128, 57 self-attentions; the
# output 4,096 x 64 features in bf16 = 524,288 bytes
FLUX_LIKE = ap.Measured(100.0, (ap.AttentionSite(4096, 24, 128, 1, 57),), 524_288, 2, 1)


def _by_mode(found):
    return {c.mode: c for c in found}


def test_cfg_beats_sequence_on_a_slow_link_with_guidance():
    found = _by_mode(ap.candidates(FLUX_LIKE, "10gbe", 2, cfg_on=True))
    assert set(found) == {"cfg", "sequence"}  # batch needs a row per rank; cfg+sequence four ranks
    # cfg: one whole call per rank (100 ms) + one output exchange: 524,288 B / 1.18 GB/s = 0.4443 ms + 0.05 ms
    assert found["cfg"].s_per_step == pytest.approx(0.10049, abs=1e-5)
    # sequence over 2: per call 50 ms + 57 K/V gathers of 2 x 2,048 x 24 x 128 x 2 B = 25,165,824 B (21.377 ms each,
    # gathered: ulysses moves the same bytes in two messages) + the output's half (262,144 B: 0.2722 ms); two calls
    assert found["sequence"].attention == "gathered"
    assert found["sequence"].s_per_step == pytest.approx(2 * (50 + 57 * 21.3770 + 0.2722) / 1e3, rel=1e-4)
    plan = ap.choose(list(found.values()), link="10gbe")
    assert plan.chosen.mode == "cfg"


def test_the_fastest_layout_that_does_not_fit_gives_way_to_the_next():
    plan = ap.choose(ap.candidates(FLUX_LIKE, "10gbe", 2, cfg_on=True), fits={"cfg": False}, link="10gbe")
    assert plan.chosen.mode == "sequence"
    assert ap.choose(ap.candidates(FLUX_LIKE, "10gbe", 2, cfg_on=True), {"cfg": False, "sequence": False}).chosen is None


def test_a_stale_preset_makes_the_plan_sequence_even_where_cfg_is_faster():
    found = ap.candidates(FLUX_LIKE, "10gbe", 2, cfg_on=True, stale_preset=True)
    assert [c.mode for c in found] == ["sequence"]
    assert ap.choose(found).chosen.mode == "sequence"
    assert ap.candidates(FLUX_LIKE, "10gbe", 2, cfg_on=True, stale_preset=True, sequence_ok=False) == []


def test_a_faster_link_flips_the_sequence_attention_from_ulysses_to_gathered():
    # 4 ranks, 4,096 tokens of 4 heads x 64 (512 B a token, bf16), one attention, no output: per rank 1,024 tokens.
    # gathered: 2 x 1,024 x 512 x 3 peers = 3,145,728 B in 1 message; ulysses: 4 x 1,024 x 512 x 3/4 = 1,572,864 B in 2
    m = ap.Measured(100.0, (ap.AttentionSite(4096, 4, 64, 1, 1),), 0, 2, 1)
    slow = ap.candidates(m, "10gbe", 4, cfg_on=False)[0]
    # 10gbe: gathered 2.6659 + 0.05 ms, ulysses 1.3329 + 0.10 ms (+ 0.05 ms for the empty output gather)
    assert (slow.attention, slow.comm_ms) == ("ulysses", pytest.approx(1.3329 + 0.10 + 0.05, abs=1e-3))
    fast = ap.candidates(m, "nvlink", 4, cfg_on=False)[0]
    # nvlink: gathered 0.008738 + 0.005 ms, ulysses 0.004369 + 0.010 ms
    assert (fast.attention, fast.comm_ms) == ("gathered", pytest.approx(0.008738 + 0.005 + 0.005, abs=1e-5))
    # a head count the ranks do not divide leaves ulysses out
    odd = ap.Measured(100.0, (ap.AttentionSite(4096, 6, 64, 1, 1),), 0, 2, 1)
    assert ap.candidates(odd, "10gbe", 4, cfg_on=False)[0].attention == "gathered"


def test_four_ranks_with_guidance_pick_cfg_plus_sequence_over_sequence():
    found = _by_mode(ap.candidates(FLUX_LIKE, "pcie4_x16_no_p2p", 4, cfg_on=True))
    assert set(found) == {"cfg+sequence", "sequence"}  # cfg alone runs on exactly two ranks
    # cfg+sequence: 2 groups of 2 sequence ranks; per step one call of 50 ms + 57 gathers of 25,165,824 B
    # (2 x 0.9119 ms + 0.02 ms) + the output's half (2 x 0.009498 + 0.02 ms) + the peer's band (the same)
    per_gather = 2 * 25_165_824 / 27.6e9 * 1e3 + 0.02
    half_out = 2 * 262_144 / 27.6e9 * 1e3 + 0.02
    assert found["cfg+sequence"].comm_ms == pytest.approx(57 * per_gather + 2 * half_out, rel=1e-6)
    assert ap.choose(list(found.values())).chosen.mode == "cfg+sequence"


def test_a_batch_with_a_row_per_rank_is_split_and_ties_go_to_the_rules_order():
    m = FLUX_LIKE._replace(batch=2, out_bytes=2 * 524_288)
    found = _by_mode(ap.candidates(m, "nvlink", 2, cfg_on=False))
    # batch: each rank one row (50 ms) and one gather of its row's output (524,288 B / 360 GB/s + 5 us)
    assert found["batch"].comm_ms == pytest.approx(524_288 / 360e9 * 1e3 + 0.005, rel=1e-6)
    assert ap.choose(list(found.values())).chosen.mode == "batch"
    tie = [ap.Candidate("sequence", 1, 2, "gathered", 50.0, 1.0, 0.0), ap.Candidate("batch", 1, 1, "-", 50.0, 1.0, 0.0)]
    assert ap.choose(tie).chosen.mode == "batch"


def test_the_plan_line_names_the_mode_the_expected_step_and_what_it_is_from():
    plan = ap.choose(ap.candidates(FLUX_LIKE, "10gbe", 2, cfg_on=True), link="10gbe")
    line = ap.plan_line(plan, FLUX_LIKE, "the topology probe's link (10gbe)", cached=False)
    assert line.startswith("plan: cfg, expected 0.1 s/step (MODELLED from a measured call of 100 ms and the topology "
                           "probe's link (10gbe))")
    assert "others MODELLED: sequence 2.54 s/step" in line
    again = ap.plan_line(plan, FLUX_LIKE, "x", cached=True)
    assert "100 ms (measured earlier) and x" in again


def test_the_measurement_is_kept_per_key_and_every_key_part_invalidates(tmp_path):
    cache = ap.ProbeCache(tmp_path)
    parts = ("Flux", 11_900_000_000, "torch.bfloat16", (1, 16, 128, 128), 2, "cuda@embedded/any", "none", "0.3.64", "0.2.0")
    key = ap.probe_key(*parts)
    assert cache.get(key) is None
    cache.put(key, FLUX_LIKE)
    assert ap.ProbeCache(tmp_path).get(key) == FLUX_LIKE  # read back from disk
    changed = [("WanModel",), (1_300_000_000,), ("torch.float8_e4m3fn",), ((1, 16, 64, 64),), (4,),
               ("cuda@embedded/0,1",), ("blocks",), ("0.3.65",), ("0.2.1",)]
    for i, value in enumerate(changed):
        other = parts[:i] + value + parts[i + 1:]
        assert cache.get(ap.probe_key(*other)) is None, other
    assert json.loads((tmp_path / "auto_plan.json").read_text())[key]["call_ms"] == 100.0
    assert cache.clear() == 1 and cache.get(key) is None


def test_an_unreadable_measurement_cache_is_an_empty_one(tmp_path):
    (tmp_path / "auto_plan.json").write_text("{not json")
    assert ap.ProbeCache(tmp_path).get("k") is None
    (tmp_path / "auto_plan.json").write_text(json.dumps({"k": {"call_ms": 1.0}}))  # a record missing its fields
    assert ap.ProbeCache(tmp_path).get("k") is None


def test_the_cache_sits_next_to_the_exactness_verdicts(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path))
    assert ap.ProbeCache().path == tmp_path / "auto_plan.json"


def test_the_command_lists_and_clears_the_measurements(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path))
    key = ap.probe_key("Flux", 1, "torch.bfloat16", (1, 16, 8, 8), 2, "cpu@embedded/any", "none", "0.3.64", "0.2.0")
    ap.ProbeCache().put(key, FLUX_LIKE)
    assert ap.main([]) == 0
    out = capsys.readouterr().out
    assert "1 measurement(s)" in out and "100.0 ms" in out and "Flux" in out
    assert ap.main(["--clear"]) == 0
    assert "forgot 1 measurement(s)" in capsys.readouterr().out
    assert ap.ProbeCache().get(key) is None
