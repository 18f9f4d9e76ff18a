#!/bin/bash
# Device call 4 (repo root): after the attention route rebuild, FLUX.1 issue time + kernels (N = 1, 2), diffusers'
# own issue time, the stale presets' full-width error vs warm-up count, Qwen-Image issue time, host RAM at 4 GPU ranks.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r4; mkdir -p $R/prof
pack() { tar czf "$OUT/call4.tgz.tmp" -C $R . && mv "$OUT/call4.tgz.tmp" "$OUT/call4.tgz"; }
T0=$SECONDS; BUDGET=535
s() { echo "== $1 at $((SECONDS - T0)) s"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
s flux_gathered
timeout 150 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 --mode gathered \
  --warmup 2 --iters 2 --alone-clock prefilled --deadline-s 115 --timeout-s 145 --profile-dir $R/prof --out $R/dit_flux_issue.json > $R/flux.log 2>&1; pack
tail -5 $R/flux.log
s issue_time_flux
timeout 60 python3 results/h200/dit/issue_time.py --preset flux1_1024 --out $R/issue_time_flux.json > $R/issue_time.log 2>&1; pack
tail -2 $R/issue_time.log | cut -c1-400
s warmup
L=$(( $(left) - 150 )); [ $L -gt 150 ] && L=150
if [ $L -gt 60 ]; then OUT=$R/warmup LIMIT=$L bash results/h200/warmup/run_warmup.sh 2>&1 | tail -30; pack; fi
s qwen_gathered
L=$(( $(left) - 10 )); [ $L -gt 75 ] && L=75
if [ $L -gt 50 ]; then timeout $L python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 2 --ns 1,2 --preset qwen_image_1328 \
  --mode gathered --alone-clock prefilled --deadline-s $((L - 25)) --timeout-s $((L - 5)) --out $R/dit_qwen_issue.json > $R/qwen.log 2>&1; pack; tail -4 $R/qwen.log; fi
s hostram_n4
L=$(( $(left) - 5 ))
if [ $L -gt 90 ]; then OUT=$R/hostram HOSTRAM_BUDGET_S=$L HOSTRAM_RANKS=4 HOSTRAM_EXTRA=0 bash results/h200/hostram/run.sh 2>&1 | tail -8; pack; fi
s done
