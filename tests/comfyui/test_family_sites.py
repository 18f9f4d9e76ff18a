"""Opt-in: every site of the family table resolves on ComfyUI's own classes (``family_sites.py``, one rank), and
every class of the table with a sequence layout or sharding blocks is among those checked.

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/its/python pytest tests/comfyui -k family_sites
"""

from patchray.nodes.bridge.families import FAMILIES

from .family_sites import CASES
from .rank_harness import comfyui_marks, run_rank_script

pytestmark = comfyui_marks()


def test_every_row_resolves_on_its_class(tmp_path):
    report = run_rank_script("family_sites.py", tmp_path, 1, sorted(CASES), timeout=600)
    seen, attends = set(), {}
    for name, rec in report["cases"].items():
        print(f"{name}: {rec['class']} ({rec.get('family')}): units {rec.get('units')}, hooks {rec.get('hook_handles')}, "
              f"missing {rec['missing']}")
        assert rec["missing"] == [], (name, rec)
        if rec["blocks"]:
            assert rec["units"] >= 2, (name, rec)  # every small model has two blocks or more
        if rec["sequence"]:
            assert rec["applied_and_removed"], (name, rec)
            attends.setdefault(rec["class"], set()).update(rec["attends_found"])
        seen.add(rec["class"])
    for row in FAMILIES:  # every attention class a row routes is in one of the variants built
        for cls in row.classes:
            if cls in attends:
                assert set(row.attends) <= attends[cls], (cls, sorted(set(row.attends) - attends[cls]))
    wanted = {c for row in FAMILIES if row.sequence or row.blocks for c in row.classes}
    assert wanted <= seen, sorted(wanted - seen)
