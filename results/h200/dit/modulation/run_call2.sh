#!/bin/bash
# Device call 2 (repo root, one H200, ~450 s; carry .whl): the log-sum-exp merge compiled three ways
# (merge_bench.py), then FLUX.1 12B at 1024x1024 with the merge compiled static-first and the modulation shared:
# overlapped and ring attention, compiled blocks, N = 1, 2, 4, each rank profiled.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/m2; mkdir -p $R/prof
pack() { tar czf "$OUT/call2.tgz.tmp" -C $R . && mv "$OUT/call2.tgz.tmp" "$OUT/call2.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s merge_bench
timeout 90 python3 results/h200/dit/modulation/merge_bench.py $R/merge_bench.json > $R/merge_bench.log 2>&1; cat $R/merge_bench.log | tail -4; pack
s flux
L=$(( 575 - (SECONDS - T0) ))
timeout $L python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 \
  --mode overlapped --mode ring --compile default --compile-attention compiled --warmup 3 --iters 2 \
  --alone-clock prefilled --deadline-s $((L - 120)) --timeout-s $((L - 5)) \
  --profile-dir $R/prof --out $R/dit_flux_merge_static.json > $R/flux.log 2>&1; pack
grep "dit_bench .*s\]" $R/flux.log | cut -c1-260
s done
