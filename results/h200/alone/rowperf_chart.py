"""Chart of rowperf-run1/rowperf.json: per-rank compute measured alone / the plain decode, before and after."""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "rowperf-run1", "rowperf.json")
extra = {  # measured in the same run, printed to log.txt, not written to the JSON before the run's time limit
    ("wan:720x1280x81x1", 4, "old"): 0.7474,
}
d = json.load(open(src))
fig, ax = plt.subplots(figsize=(7.5, 3.8))
labels, old, new = [], [], []
for case in d["cases"]:
    for n in (2, 4):
        vals = {r["tree"]: r.get("ratio") for r in case["row"] if r["ranks"] == n}
        key = case["case"] if case["case"].count("x") > 1 else case["case"] + "x1"
        vals.setdefault("old", extra.get((key + "x1" if key.count("x") == 2 else key, n, "old")))
        labels.append(f"{case['family']} {case['shape'][0]}x{case['shape'][1]}" + (f"x{case['shape'][2]}" if case["shape"][2] > 1 else "") + f"\nN={n}")
        old.append(vals.get("old"))
        new.append(vals.get("new"))
x = range(len(labels))
ax.bar([i - 0.2 for i in x], [v or 0 for v in old], 0.4, label="before (main)", color="#bbbbbb")
ax.bar([i + 0.2 for i in x], [v or 0 for v in new], 0.4, label="after (code as run, 72afc81)", color="#3a7bd5")
for i, v in enumerate(new):
    if v is None:
        ax.text(i + 0.2, 0.02, "not run\n(time limit)", ha="center", fontsize=7, rotation=90)
for i, lab in enumerate(labels):
    goal = 0.55 if "N=2" in lab else 0.30
    ax.plot([i - 0.45, i + 0.45], [goal, goal], color="#d9534f", lw=1.5, label="goal" if i == 0 else None)
ax.set_xticks(list(x))
ax.set_xticklabels(labels, fontsize=8)
ax.set_ylabel("per-rank compute / plain decode")
ax.set_title("Row decode on one H200, bf16: each rank's compute measured alone (turn-taking)\n"
             "lower is better; 1/N is ideal. N-GPU latencies are modelled from these, not measured", fontsize=9)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(here, "rowperf-compute-alone.png"), dpi=110)
print("wrote rowperf-compute-alone.png")
