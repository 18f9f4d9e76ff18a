"""The driver's side of the runtime exactness check: keys, the refusal a failed verdict gives, what the node shows."""

import pytest

from patchray.distributed.sampling.exactness import Verdict, VerdictCache
from patchray.nodes.bridge import runtime_check as rc


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path))


def test_a_mismatch_reported_by_the_ranks_is_kept_and_refuses_the_mode_by_name():
    key, verdict = rc.cached_verdict("HunyuanVideo", "sequence/auto")
    assert verdict is None and key.startswith("HunyuanVideo|")
    message = ("rank 0 raised ExactnessMismatch: PatchRay's exactness check: sequence parallelism on HunyuanVideo "
               "computes a different step than the whole model (relative error 3.40e-01 > bound 1e-04 for float32)")
    failed = rc.record_mismatch(key, message)
    assert (failed.ok, failed.error, failed.bound) == (False, 0.34, 1e-4)
    _, again = rc.cached_verdict("HunyuanVideo", "sequence/auto")
    assert again == failed  # the next run is refused before any rank starts
    err = rc.refusal("HunyuanVideo", "sequence/auto", again)
    text = str(err)
    assert isinstance(err, NotImplementedError)
    for part in ("sequence parallelism is refused for HunyuanVideo", f"ComfyUI {rc.comfy_version()}",
                 "parallelism cfg or batch", "exactness --clear", "3.40e-01"):
        assert part in text, part


def test_a_passed_check_is_kept_and_worded_for_the_panel():
    key, _ = rc.cached_verdict("Flux", "sequence/ring")
    kept = rc.record(key, {"error": 2.3e-7, "bound": 1e-4, "seconds": 0.8, "peak_bytes": 3 * 2**30})
    assert VerdictCache().get(key) == kept and kept.ok
    assert "checked now in 0.80 s, peak 3.00 GiB on a rank" in rc.line("Flux", "sequence/ring", kept, True)
    assert "verified earlier (cached)" in rc.line("Flux", "sequence/ring", kept, False)
    assert "relative error 2.3e-07 <= 1e-04" in rc.line("Flux", "sequence/ring", kept, False)


def test_keys_name_the_running_versions():
    from patchray import __version__

    key = rc.key_for("WanModel", "sequence/auto")
    assert key == f"WanModel|{rc.comfy_version()}|{__version__}|sequence/auto"


def test_a_newer_comfyui_is_said_once(monkeypatch):
    monkeypatch.setattr(rc, "_said_newer", [])
    monkeypatch.setattr(rc, "comfy_version", lambda: "0.3.64")
    assert rc.newer_comfyui_note() is None
    monkeypatch.setattr(rc, "comfy_version", lambda: "0.4.7")
    note = rc.newer_comfyui_note()
    assert "ComfyUI 0.4.7 is newer than the newest version" in note and "(0.3.64)" in note
    assert rc.newer_comfyui_note() is None  # once per process
    monkeypatch.setattr(rc, "_said_newer", [])
    monkeypatch.setattr(rc, "comfy_version", lambda: "0.3.10")  # numerically older, though longer as text
    assert rc.newer_comfyui_note() is None
