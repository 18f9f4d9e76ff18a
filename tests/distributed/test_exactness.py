"""The runtime exactness check's library part: the comparison, the ranks' agreement, the bounds and the verdict cache.

The check itself (a split step against the whole step on ComfyUI's own DiT classes, a flipped text block refused) runs
in tests/comfyui/test_exactness_check.py (opt-in, a real ComfyUI).
"""

import json

import pytest
import torch

from patchray.distributed.sampling import exactness as ex
from patchray.distributed.spawn import run_ranks


def test_relative_error_is_the_l2_ratio_and_infinite_for_a_shape_or_nan_mismatch():
    ref = torch.tensor([3.0, 4.0])  # norm 5
    assert ex.relative_error(ref, torch.tensor([3.0, 4.5])) == pytest.approx(0.1)
    assert ex.relative_error(ref, ref.clone()) == 0.0
    assert ex.relative_error(ref, torch.zeros(3)) == float("inf")
    assert ex.relative_error(ref, torch.tensor([float("nan"), 4.0])) == float("inf")


def test_bounds_order_the_dtypes_by_their_rounding():
    # fp32's reorders sit near 1e-7 (measured on the table's models), a wrong layout above 1e-2: the bound between
    assert ex.bound_for(torch.float32) == 1e-4
    assert ex.bound_for(torch.float16) < ex.bound_for(torch.bfloat16) < 0.1
    assert ex.bound_for(torch.float8_e4m3fn) == ex.bound_for(torch.float32)  # fp8 weights compute in a cast dtype


def _agree(ctx):
    mine = [1e-7, 0.3, 2e-6][ctx.rank]
    return (ex.agreed_error(ctx, mine), ex.agreed_error(ctx, float("nan") if ctx.rank == 1 else 0.0),
            ex.agreed_flag(ctx, ctx.rank == 2), ex.agreed_flag(ctx, False))


def test_every_rank_gets_the_largest_error_so_every_rank_decides_alike():
    got = run_ranks(_agree, 3, timeout_s=120)
    assert [g[0] for g in got] == [0.3, 0.3, 0.3]
    assert all(g[1] == float("inf") for g in got)  # a rank whose result is not finite fails the check everywhere
    assert [g[2] for g in got] == [True, True, True]  # one rank's failure (fp32 compute) is every rank's
    assert [g[3] for g in got] == [False, False, False]


def test_verdicts_are_kept_per_key_and_every_key_part_invalidates(tmp_path):
    cache = ex.VerdictCache(tmp_path)
    key = ex.verdict_key("Flux", "0.3.64", "0.2.0", "sequence/auto")
    assert cache.get(key) is None
    cache.put(key, ex.Verdict(ok=True, error=2e-7, bound=1e-4, seconds=1.5, peak_bytes=10, when=1.0))
    assert ex.VerdictCache(tmp_path).get(key) == ex.Verdict(True, 2e-7, 1e-4, 1.5, 10, 1.0)  # read back from disk
    for changed in (("WanModel", "0.3.64", "0.2.0", "sequence/auto"), ("Flux", "0.4.7", "0.2.0", "sequence/auto"),
                    ("Flux", "0.3.64", "0.2.1", "sequence/auto"), ("Flux", "0.3.64", "0.2.0", "sequence/ulysses")):
        assert cache.get(ex.verdict_key(*changed)) is None, changed
    assert json.loads((tmp_path / "exactness.json").read_text())[key]["ok"] is True
    assert cache.clear() == 1 and cache.get(key) is None


def test_an_unreadable_cache_is_an_empty_one(tmp_path):
    (tmp_path / "exactness.json").write_text("{not json")
    cache = ex.VerdictCache(tmp_path)
    assert cache.get("x") is None
    cache.put("x", ex.Verdict(False, 0.4, 1e-4, 0.0))
    assert cache.get("x").ok is False


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path / "c"))
    assert ex.VerdictCache().path == tmp_path / "c" / "exactness.json"
    monkeypatch.delenv("PATCHRAY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert ex.cache_dir() == tmp_path / "x" / "patchray"


def test_the_command_lists_and_clears(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path))
    ex.VerdictCache().put(ex.verdict_key("Flux", "0.3.64", "0.2.0", "sequence/auto"), ex.Verdict(False, 0.4, 1e-4, 0.0))
    from patchray.distributed.cli import main

    assert main(["exactness"]) == 0
    assert "REFUSED  Flux sequence/auto" in capsys.readouterr().out
    assert main(["exactness", "--clear"]) == 0
    assert "forgot 1 verdict" in capsys.readouterr().out
    assert ex.VerdictCache().load() == {}
