#!/bin/bash
# Device call (from the repo root): the DiT sequence ranks' CPU issue time after the diffusers attention route was
# rebuilt (the processor's dispatch_attention_fn rebound; no TorchFunctionMode over the attention modules).
#   1. FLUX.1-dev 1024x1024, gathered, N = 1 and 2, prefilled clock (issue ms/call per rank; before: 178.3 ms at N = 2)
#   2. diffusers' own forward, per-block issue time on one GPU (no PatchRay code in the path; before: 130-143 ms)
#   3. Qwen-Image 1328x1328, gathered, N = 1 and 2 (before: 290.0 ms at N = 2 against 148-176 ms), if time is left
# Expected wall: about 60 s + 40 s + 80 s (bounded by the timeouts: 100 + 60 + 75 = 235 s). Everything goes into
# $OUT/issue.tgz (repacked after each step); a short summary is printed.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r_issue; mkdir -p $R
pack() { tar czf "$OUT/issue.tgz.tmp" -C $R . && mv "$OUT/issue.tgz.tmp" "$OUT/issue.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s flux_gathered
timeout 100 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 2 --ns 1,2 --preset flux1_1024 \
  --mode gathered --alone-clock prefilled --deadline-s 75 --timeout-s 95 --out $R/dit_flux_issue.json > $R/flux.log 2>&1; pack
tail -6 $R/flux.log
s issue_time_flux
timeout 60 python3 results/h200/dit/issue_time.py --preset flux1_1024 --out $R/issue_time_flux.json > $R/issue_time.log 2>&1; pack
tail -2 $R/issue_time.log | cut -c1-400
s qwen_gathered
timeout 75 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 2 --ns 1,2 --preset qwen_image_1328 \
  --mode gathered --alone-clock prefilled --deadline-s 50 --timeout-s 70 --out $R/dit_qwen_issue.json > $R/qwen.log 2>&1; pack
tail -6 $R/qwen.log
s done
