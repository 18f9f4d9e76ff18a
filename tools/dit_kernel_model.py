"""MODELLED DiT speed-ups from each rank's *kernel* time (profiled, the transport's staging copies excluded).

The DiT benchmark's ranks share one GPU and exchange through gloo, which stages every CUDA collective through pinned
host memory: a device-to-host copy, the host exchange, a host-to-device copy. Those copies land on the GPU's
timeline next to the rank's kernels, so the prefilled clock's per-stage GPU time of a sequence rank includes part
of them, while NCCL on real GPUs writes the peers' K/V straight into device memory. ``--profile-dir`` records one
extra call per rank (turn-taking: each rank alone on the GPU) with its kernels; this script takes, per rank, the
kernels' summed time without the clock's spin, without gloo's host copies (``Memcpy HtoD``/``DtoH``) and without
gloo's own ranges, i.e. the rank's compute kernels, and combines the slowest rank's with the communication the
benchmark modelled for the same case (per collective ``latency + wire_bytes / bandwidth`` on each link profile,
doubled through host memory without P2P: the record's modelled step minus its compute). The reference is the
N = 1 call's kernel time, measured the same way. Kernel sums leave out the GPU's gaps between kernels (at N = 1 the
prefilled clock reads 2-3% above the kernel sum), so the figures are upper bounds by about that much; and they
assume the CPU keeps ahead of the GPU (the GPU-bound case: see the issue-time columns of the benchmark).

Overlapped mode (``seq-overlapped``): the K/V gather of each attention runs while the rank attends to its own keys,
so per step it costs ``max(0, comm - local)``, where ``local`` is the part of the rank's fused-attention kernel time
spent on its own keys, taken as its share of the keys (1/N of the attention kernels' time; the parts differ by at
most one token). Ring mode (``seq-ring``): the K/V travel one peer per stage, serially on the link, while the rank
attends to the part that arrived last: with ``t_c`` one stage's transfer and ``t_p`` one part's attention (1/N of the
attention kernels), the last part ends ``(N-1) max(0, t_c - t_p)`` after the attention alone would, so the step costs
``max(0, comm - (N-1)/N attention)``. ``--ring-from-overlapped`` models ring rows from overlapped records at N >= 3:
the two modes run the same attention parts and the same merge, only the transport differs. The exchanges' own use
of the GPU's SMs (NCCL's kernels, a few percent of the attention's speed) is not modelled.

    python tools/dit_kernel_model.py REPORT.json PROFILE_DIR [--ring-from-overlapped] [--out table.json]
"""

import argparse
import glob
import json
import os

PROFILES = ("nvlink", "pcie4_x16_no_p2p")


#: the fused attention kernels (cuDNN, FlashAttention, memory-efficient), not the compiler's kernels around them
FUSED_ATTENTION = ("sdpa", "flash_fwd", "fmha", "efficient_attention", "flash_fprop")


def kernel_compute(summary: dict) -> dict:
    """``{compute_ms, transport_ms, attention_ms}`` of one profiled call (``kernel_profile`` summary with its top
    list)."""
    transport = sum(t["ms"] for t in summary["top"]
                    if t["name"].startswith("gloo:") or t["name"].startswith(("Memcpy HtoD", "Memcpy DtoH")))
    attention = sum(t["ms"] for t in summary["top"] if any(k in t["name"] for k in FUSED_ATTENTION))
    return {"compute_ms": summary["gpu_ms_without_spin"] - transport, "transport_ms": transport, "attention_ms": attention}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("profile_dir")
    ap.add_argument("--out")
    ap.add_argument("--ring-from-overlapped", action="store_true",
                    help="also model ring rows from overlapped records at N >= 3 (the same attention parts and merge)")
    args = ap.parse_args()
    doc = json.load(open(args.report))
    rows, ref = [], None
    for rec in doc["records"]:
        if rec.get("status") != "ok":
            continue
        label = rec["case"].replace(" ", "_")
        files = sorted(glob.glob(os.path.join(args.profile_dir, f"{rec['preset']}_{label}_r*.json")))
        if not files:
            continue
        per_rank = [kernel_compute(json.load(open(f))) for f in files]
        slowest = max(p["compute_ms"] for p in per_rank)
        calls = rec.get("calls_per_step", 1)
        comm = {p: rec["modelled_step_ms"][p] - rec["compute_ms_per_step_alone"] for p in PROFILES}
        row = {"preset": rec["preset"], "case": rec["case"], "compile": rec.get("compile"),
               "kernel_ms_per_call_by_rank": [round(p["compute_ms"], 1) for p in per_rank],
               "staging_ms_per_call": round(max(p["transport_ms"] for p in per_rank), 1),
               "clock_gpu_ms_per_call": rec.get("gpu_ms_per_call_alone"),
               "comm_ms_per_step_modelled": {p: round(v, 2) for p, v in comm.items()}}
        variants = [(row, rec["mode"])]
        if rec["mode"] == "overlapped" and rec["n"] >= 3 and args.ring_from_overlapped:
            variants.append((dict(row, case=rec["case"].replace("overlapped", "ring") + " (from overlapped's kernels)"), "ring"))
        for row, mode in variants:
            row = dict(row)
            c = dict(comm)
            if mode in ("overlapped", "ring"):
                attention = max(p["attention_ms"] for p in per_rank) * calls
                hidden = attention / rec["n"] if mode == "overlapped" else attention * (rec["n"] - 1) / rec["n"]
                row["attention_ms_per_step_hiding_the_exchange"] = round(hidden, 2)
                row["comm_ms_per_step_exposed"] = {p: round(max(0.0, v - hidden), 2) for p, v in c.items()}
                c = {p: max(0.0, v - hidden) for p, v in c.items()}
            step = {p: slowest * calls + c[p] for p in PROFILES}
            if rec["n"] == 1:
                ref = slowest * calls
            row["step_ms_modelled"] = {p: round(v, 1) for p, v in step.items()}
            if ref:
                row["speedup_modelled"] = {p: (round(ref / v, 2) if rec["n"] > 1 else 1.0) for p, v in step.items()}
            rows.append(row)
    for r in rows:
        print(f"{r['case']:22s} kernels/call {r['kernel_ms_per_call_by_rank']} staging {r['staging_ms_per_call']} ms, "
              f"clock GPU {r['clock_gpu_ms_per_call']} ms; MODELLED x {r.get('speedup_modelled')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"source": os.path.basename(args.report), "modelled": True, "method": __doc__.split("\n\n")[1],
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
