#!/bin/bash
# Device call 5 (repo root): FLUX.1 with the attention modules compiled (N = 1, 2, 4 gathered, profiled), then the row
# decode's kernel time (Wan 720x1280x81, flux2 and kl 2048x2048 at N = 2 and 4, each rank-1 turn profiled).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r5; mkdir -p $R/prof $R/rowperf
pack() { tar czf "$OUT/call5.tgz.tmp" -C $R . && mv "$OUT/call5.tgz.tmp" "$OUT/call5.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s flux_compiled_attention
timeout 290 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 --mode gathered \
  --compile default --compile-attention compiled --warmup 3 --iters 2 --alone-clock prefilled --deadline-s 230 --timeout-s 285 \
  --profile-dir $R/prof --out $R/dit_flux_cattn.json > $R/flux.log 2>&1; pack
grep -E "compute/call|^flux1|Error|error" $R/flux.log | cut -c1-400 | tail -12
s rowperf
L=$(( 545 - (SECONDS - T0) )); [ $L -gt 240 ] && L=240
timeout $L python3 results/h200/alone/rowperf.py --out $R/rowperf --cases wan:720x1280x81 flux2:2048x2048 --ranks 1 2 4 \
  --profile flux2:2048x2048:2:new flux2:2048x2048:4:new wan:720x1280x81:2:new wan:720x1280x81:4:new \
  --iters 1 --iters-plain 2 > $R/rowperf.log 2>&1; pack
grep -E "plain|ratio|profile " $R/rowperf.log | cut -c1-300 | tail -30
s done
