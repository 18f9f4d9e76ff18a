"""The tile planner: geometry properties on randomized shapes, known layouts worked by hand, exact plans, case
strings, the plan CLI.

The objectives a plan reports (decoded area, coverage, imbalance, rank areas, beats_row_sharding) are checked
against layouts worked out by hand below, never against the planner's own formulas; the randomized tests check
properties that hold for every plan (coverage, a partition into cores, optimal runs against a brute-force
reference, the search's constraints). Pure geometry (no model, no ranks): these run in well under a second each.
"""

import json
import random
import re
from collections import namedtuple

import pytest
import torch

from patchray.distributed.bench.catalog import CANONICAL_SHAPES
from patchray.distributed.vae.families import FAMILIES
from patchray.distributed.vae.planner import (
    MIN_TILE_LATENT,
    TILES_PER_RANK,
    CaseSpec,
    TilePlan,
    exact_plan,
    parse_case,
    plan_main,
    plan_tiles,
)

Fam = namedtuple("Fam", "name spatial_ratio")

#: the benchmark's canonical shapes (height, width, frames) per family, and each turned by 90 degrees (portrait
#: video, landscape LTX-2): a planner must not depend on which axis is the long one
CANONICAL = {
    family: sorted({(h, w, f) for s in shapes for (h, w, f) in (tuple(s), (s[1], s[0], s[2]))})
    for family, shapes in CANONICAL_SHAPES.items()
}


def _min_max_contiguous(weights, ranks):
    """Brute-force reference: the smallest possible largest run over contiguous non-empty splits (DP)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(ranks + 1)]
    best[0][0] = 0
    for k in range(1, ranks + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):
                best[k][i] = min(best[k][i], max(best[k - 1][j], prefix[i] - prefix[j]))
    return best[ranks][n]


def _check_plan(plan: TilePlan, quarter_blend: bool = True):
    lat_h, lat_w = plan.latent_size
    ranks = plan.world_size
    # windows and tiles inside the image
    assert 0 < plan.latent_window[0] <= lat_h and 0 < plan.latent_window[1] <= lat_w
    for y0, y1, x0, x1 in plan.tiles_latent:
        assert 0 <= y0 < y1 <= lat_h and 0 <= x0 < x1 <= lat_w
        assert y1 - y0 <= plan.latent_window[0] and x1 - x0 <= plan.latent_window[1]
    # full coverage by the tiles, and the cores partition the image (every cell owned once)
    covered = torch.zeros(lat_h, lat_w, dtype=torch.int32)
    owned = torch.zeros(lat_h, lat_w, dtype=torch.int32)
    for (y0, y1, x0, x1), (cy0, cy1, cx0, cx1) in zip(plan.tiles_latent, plan.cores_latent):
        assert y0 <= cy0 < cy1 <= y1 and x0 <= cx0 < cx1 <= x1, "a core must lie inside its tile"
        covered[y0:y1, x0:x1] += 1
        owned[cy0:cy1, cx0:cx1] += 1
    assert bool((covered >= 1).all())
    assert bool((owned == 1).all())
    # constraints (the search's rules, docs/vae.md)
    assert min(plan.latent_window) >= MIN_TILE_LATENT
    assert max(2, ranks) <= plan.tile_count <= TILES_PER_RANK * ranks
    for axis in (0, 1):
        if plan.grid[axis] == 1:
            assert plan.latent_overlap[axis] == 0 and plan.latent_window[axis] == plan.latent_size[axis]
        else:
            assert 0 < plan.latent_overlap[axis] < plan.latent_window[axis] < plan.latent_size[axis]
            if quarter_blend:
                assert plan.latent_overlap[axis] * 4 >= plan.latent_window[axis]
    # runs: contiguous, non-empty, in order, balanced optimally by area
    assert len(plan.runs) == ranks
    assert plan.runs[0][0] == 0 and plan.runs[-1][1] == plan.tile_count
    for (a, b), (c, _) in zip(plan.runs, plan.runs[1:]):
        assert a < b == c
    areas = [(t[1] - t[0]) * (t[3] - t[2]) * plan.ratio**2 for t in plan.tiles_latent]
    assert max(plan.rank_areas) == _min_max_contiguous(areas, ranks)
    # the tiles cover the image, so overlap can only add decoded area; the busiest rank is at least the mean
    assert plan.coverage >= 1.0
    assert plan.imbalance >= 0.0
    assert plan.grid[0] * plan.grid[1] == plan.tile_count
    # plans are data
    assert TilePlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def _keys(plan):
    return (plan.window_area, plan.decoded_area, plan.imbalance, plan.tile_columns)


def _check_report(report):
    frontier = report.frontier
    assert report.frontier_size == len(frontier) >= 2
    assert report.candidates_considered >= len(frontier)
    for plan in frontier + report.plans:
        _check_plan(plan)
    # non-dominated: no frontier plan is at least as good everywhere and better somewhere than another
    for a in frontier:
        for b in frontier:
            ka, kb = _keys(a), _keys(b)
            assert not (all(x <= y for x, y in zip(ka, kb)) and ka != kb), f"{a.window} dominates {b.window}"
    areas = [p.window_area for p in frontier]
    assert report.coarse.window_area == max(areas) and report.fine.window_area == min(areas)
    assert report.coarse.window_area > report.fine.window_area
    assert report.coarse.name == "coarse" and report.fine.name == "fine"
    if report.balanced is not None:
        assert report.balanced.name == "balanced"
        assert report.balanced.latent_window not in (report.coarse.latent_window, report.fine.latent_window)
    for selected in report.plans:
        assert any(selected.latent_window == p.latent_window and selected.latent_overlap == p.latent_overlap for p in frontier)


def _suggestions(message):
    """The requests a refusal names as nearest valid."""
    out = []
    tail = message.split("nearest valid request:", 1)[1]
    m = re.search(r"--ranks (\d+)(?! at)", tail.split(" or ")[0])
    if m and "--height" not in tail.split(" or ")[0]:
        out.append(("ranks", int(m.group(1))))
    m = re.search(r"--height (\d+) --width (\d+) at --ranks (\d+)", tail)
    if m:
        out.append(("size", (int(m.group(1)), int(m.group(2)), int(m.group(3)))))
    return out


def test_randomized_plans_hold_every_property():
    rng = random.Random(20261129)
    planned = refused = 0
    for _ in range(40):
        ratio = rng.choice((8, 16, 32))
        lat_h, lat_w = rng.randint(8, 120), rng.randint(8, 120)
        ranks = rng.choice((1, 2, 3, 4, 5, 8))
        fam = Fam("synthetic", ratio)
        args = (fam, lat_h * ratio, lat_w * ratio, 1, ranks)
        try:
            report = plan_tiles(*args)
        except ValueError as exc:
            refused += 1
            message = str(exc)
            assert "nearest valid request:" in message
            # the suggested requests really plan
            for kind, value in _suggestions(message):
                if kind == "ranks":
                    plan_tiles(fam, lat_h * ratio, lat_w * ratio, 1, value)
                else:
                    plan_tiles(fam, value[0], value[1], 1, value[2])
            continue
        planned += 1
        _check_report(report)
        # deterministic: the same request gives the same plans
        again = plan_tiles(*args)
        assert again.to_dict() == report.to_dict()
    assert planned >= 20 and refused >= 3, (planned, refused)  # the sample exercised both paths


@pytest.mark.parametrize("family", sorted(CANONICAL))
def test_canonical_shapes_plan_at_every_world_size(family):
    for height, width, frames in CANONICAL[family]:
        for ranks in (1, 2, 4, 8):
            report = plan_tiles(family, height, width, frames, ranks)
            _check_report(report)
            assert all(p.family == family and p.ratio == FAMILIES[family].spatial_ratio for p in report.plans)
            assert all(p.frames == frames for p in report.plans)


def test_frames_do_not_change_the_plan():
    # video: spatial tiles carry every frame, so the geometry does not depend on the frame count
    a = plan_tiles("wan", 832, 480, 1, 4)
    b = plan_tiles("wan", 832, 480, 81, 4)
    strip = lambda r: [{k: v for k, v in p.to_dict().items() if k != "frames"} for p in r.plans]  # noqa: E731
    assert strip(a) == strip(b)


def test_fine_plan_beats_row_sharding_at_1024_on_4_ranks():
    # pinning the overlap at a VAE's native value made every plan of 1024x1024 at 4 ranks hold as much as a
    # row-sharded rank; with the overlap searched, the finest window must be smaller than one rank's rows
    report = plan_tiles("kl", 1024, 1024, 1, 4)
    assert report.fine.beats_row_sharding
    assert report.fine.window_area < 262_144  # (1024 / 4) * 1024 px: one row-sharded rank's share


def test_image_too_small_is_refused_with_a_valid_suggestion():
    with pytest.raises(ValueError, match="needs at least 16") as info:
        plan_tiles("kl", 64, 64, 1, 1)
    ((kind, (h, w, n)),) = [s for s in _suggestions(str(info.value)) if s[0] == "size"]
    plan_tiles("kl", h, w, 1, n)


def test_more_ranks_than_useful_tiles_is_refused():
    with pytest.raises(ValueError, match="nearest valid request") as info:
        plan_tiles("kl", 256, 256, 1, 8)
    suggestions = dict(_suggestions(str(info.value)))
    assert suggestions["ranks"] < 8
    plan_tiles("kl", 256, 256, 1, suggestions["ranks"])
    with pytest.raises(ValueError):
        plan_tiles("kl", 256, 256, 1, suggestions["ranks"] + 1)  # the suggestion is the nearest, not just any


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="multiple of the family's spatial ratio 8; nearest valid: 96 or 104"):
        plan_tiles("kl", 100, 128, 1, 1)
    with pytest.raises(ValueError, match="unknown family"):
        plan_tiles("sdxl-ish", 1024, 1024, 1, 1)
    with pytest.raises(ValueError, match="world_size"):
        plan_tiles("kl", 1024, 1024, 1, 0)
    with pytest.raises(ValueError, match="frames"):
        plan_tiles("kl", 1024, 1024, 0, 1)


def test_exact_plan_builds_the_requested_window():
    plan = exact_plan("kl", 1024, 1536, 1, 4, (480, 736), (64, 32))
    assert plan.window == (480, 736) and plan.overlap == (64, 32) and plan.grid == (3, 3)
    _check_plan(plan, quarter_blend=False)  # exact cases may blend thinner than a quarter (64 px of 480 here)
    assert plan.case("local") == "local:480x736@64x32"


def test_known_grid_layout_worked_by_hand():
    # kl (ratio 8), 1024x1536 px = 128x192 latent, window 480x736 px = 60x92 latent, overlap 64x32 px = 8x4 latent
    plan = exact_plan("kl", 1024, 1536, 1, 4, (480, 736), (64, 32))
    assert (plan.latent_window, plan.latent_overlap) == ((60, 92), (8, 4))
    # rows step by 60 - 8 = 52: [0,60) [52,112) [104,164 -> clipped 128); 1 + ceil((128 - 60) / 52) = 3 rows
    # cols step by 92 - 4 = 88: [0,92) [88,180) [176,268 -> clipped 192); 1 + ceil((192 - 92) / 88) = 3 cols
    rows, cols = [(0, 60), (52, 112), (104, 128)], [(0, 92), (88, 180), (176, 192)]
    assert plan.tiles_latent == tuple((y0, y1, x0, x1) for y0, y1 in rows for x0, x1 in cols)
    assert plan.tiles_pixels[4] == (416, 896, 704, 1440)  # the middle tile, latent x 8
    # cores cut each seam mid-overlap: rows at (52+60)//2 = 56 and (104+112)//2 = 108, cols at 90 and 178
    ycuts, xcuts = [(0, 56), (56, 108), (108, 128)], [(0, 90), (90, 178), (178, 192)]
    assert plan.cores_latent == tuple((y0, y1, x0, x1) for y0, y1 in ycuts for x0, x1 in xcuts)
    # tile areas (latent units): rows 1-2: 60*92 = 5520, 5520, 60*16 = 960; row 3: 24*92 = 2208, 2208, 24*16 = 384
    # total 2 * 12000 + 4800 = 28800 latent = 1,843,200 px; the image is 128 * 192 = 24576 latent = 1,572,864 px
    assert plan.decoded_area == 1_843_200
    assert plan.coverage == pytest.approx(28800 / 24576)  # 1.171875
    # best contiguous split of 5520 5520 960 | 5520 5520 960 | 2208 2208 384 over 4 ranks: four 5520s in four runs
    # forces the last run to hold 5520 + 960 + 2208 + 2208 + 384 = 11280, so two 5520s share a run: max 11040
    assert plan.runs == ((0, 2), (2, 4), (4, 8), (8, 9))
    assert plan.rank_areas == (11040 * 64, 6480 * 64, 10896 * 64, 384 * 64)
    assert plan.imbalance == pytest.approx(11040 * 4 / 28800 - 1)  # 8/15: the busiest rank over the mean
    assert plan.tile_columns == 3 and plan.window_area == 353_280  # 480 * 736
    # one row-sharded rank holds 1024 / 4 * 1536 = 393,216 px > 353,280
    assert plan.beats_row_sharding
    objectives = plan.objectives()
    assert objectives["max_rank_area"] == 706_560 and objectives["row_shard_area"] == 393_216.0


def test_known_strip_layout_worked_by_hand():
    # kl, 1024x1024 px = 128x128 latent; window 224 px = 28 latent rows (wider than the image: full-width strips),
    # overlap 56 px = 7 rows, so rows step by 21: 1 + ceil((128 - 28) / 21) = 6 strips, the last clipped to 23 rows
    plan = exact_plan("kl", 1024, 1024, 1, 4, (224, 1408), (56, 0))
    assert plan.grid == (6, 1) and plan.window == (224, 1024) and plan.overlap == (56, 0)
    assert [t[:2] for t in plan.tiles_latent] == [(0, 28), (21, 49), (42, 70), (63, 91), (84, 112), (105, 128)]
    # cores: cuts at (21+28)//2 = 24, (42+49)//2 = 45, 66, 87, 108
    assert [c[:2] for c in plan.cores_latent] == [(0, 24), (24, 45), (45, 66), (66, 87), (87, 108), (108, 128)]
    # strips of 28, 28, 28, 28, 28, 23 rows: 163 rows of 128 latent = 20864 latent = 1,335,296 px; coverage 163/128
    assert plan.decoded_area == 1_335_296 and plan.coverage == pytest.approx(163 / 128)
    # six strips on four ranks: two runs hold two strips, at best 28+28 = 56 and 28+23 = 51 rows -> max 56 rows
    assert max(plan.rank_areas) == 56 * 1024 * 8  # 56 latent rows x 1024 px wide x 8 px per row
    assert plan.imbalance == pytest.approx(56 * 4 / 163 - 1)
    # 224 * 1024 = 229,376 px against one row-sharded rank's 256 * 1024 = 262,144 px
    assert plan.beats_row_sharding and plan.tile_columns == 1


def test_exact_plan_untiled_axis_and_refusals():
    strips = exact_plan("kl", 1024, 1024, 1, 4, (224, 1408), (56, 0))  # wider than the image: full-width strips
    assert strips.grid[1] == 1 and strips.window == (224, 1024) and strips.overlap == (56, 0)
    with pytest.raises(ValueError, match="untiled and its overlap must be 0"):
        exact_plan("kl", 1024, 1024, 1, 4, (224, 1408), (56, 8))
    with pytest.raises(ValueError, match="not a whole number of latent units.*nearest valid: 480"):
        exact_plan("kl", 1024, 1536, 1, 4, (479, 736), (64, 32))
    with pytest.raises(ValueError, match="must be smaller than its window"):
        exact_plan("kl", 1024, 1536, 1, 4, (480, 736), (480, 32))
    with pytest.raises(ValueError, match="more ranks than useful tiles.*--ranks 2"):
        exact_plan("kl", 1024, 1024, 1, 4, (640, 1024), (256, 0))
    with pytest.raises(ValueError, match="tile needs at least 16"):
        exact_plan("kl", 1024, 1024, 1, 4, (96, 1024), (32, 0))
    assert exact_plan("kl", 1024, 1024, 1, 4, (96, 1024), (32, 0), min_tile_latent=8).tile_count == 16


def test_from_dict_refuses_inconsistent_plans():
    data = exact_plan("kl", 1024, 1536, 1, 4, (480, 736), (64, 32)).to_dict()
    data["runs"][0] = [0, 3]
    with pytest.raises(ValueError, match="runs"):
        TilePlan.from_dict(data)
    del data["ratio"]
    with pytest.raises(ValueError, match="ratio"):
        TilePlan.from_dict(data)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("unsharded", CaseSpec("unsharded", None, None)),
        ("row", CaseSpec("row", None, None)),
        ("local:480x736@64x32", CaseSpec("local", (480, 736), (64, 32))),
        ("tile-runs:480x736@64x32", CaseSpec("tile-runs", (480, 736), (64, 32))),
        ("row-tiled:224X1408@56x0", CaseSpec("row-tiled", (224, 1408), (56, 0))),
    ],
)
def test_parse_case_accepts_every_documented_form(text, expected):
    spec = parse_case(text)
    assert spec == expected
    assert spec.tiled == (expected.window is not None)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("tiles", "unknown case"),
        ("local", "needs a window and an overlap"),
        ("stripes:480x736@64x32", "unknown tiled mode"),
        ("local:480x736", "one '@'"),
        ("local:480x736@64x32@8x8", "one '@'"),
        ("local:480@64x32", "window '480' must be HEIGHTxWIDTH"),
        ("local:480x736@64", "overlap '64' must be HEIGHTxWIDTH"),
        ("local:480x-736@64x32", "must be HEIGHTxWIDTH"),
        ("local:0x736@0x32", "window axes must be positive"),
        ("local:480x736@480x32", "smaller than the window"),
    ],
)
def test_parse_case_refuses_malformed_strings_with_an_example(text, reason):
    with pytest.raises(ValueError, match=re.escape(reason)) as info:
        parse_case(text)
    assert "tile-runs:480x736@64x32" in str(info.value) or "480x736@64x32" in str(info.value)


def test_plan_cli_json_and_text(capsys):
    assert plan_main(["--family", "kl", "--height", "1024", "--width", "1024", "--ranks", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in data["plans"]] == ["coarse", "balanced", "fine"]
    assert data["frontier_size"] == len(data["frontier"]) and data["candidate_limit"] == 16
    for entry in data["plans"]:
        assert {"window_area", "decoded_area", "coverage", "imbalance", "tile_columns", "beats_row_sharding"} <= set(
            entry["objectives"]
        )
    assert plan_main(["--family", "wan", "--height", "832", "--width", "480", "--frames", "81", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "coarse" in out and "frontier:" in out and "case tile-runs:" in out
    assert plan_main(["--family", "kl", "--height", "64", "--width", "64", "--ranks", "2"]) == 2
    assert "nearest valid request" in capsys.readouterr().err
