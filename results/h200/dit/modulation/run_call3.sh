#!/bin/bash
# Device call 3 (repo root, one H200, ~480 s; carry .whl): the same machine, FLUX.1 12B at 1024x1024, overlapped
# attention, compiled blocks, N = 1, 2, 4, each rank profiled: "before" (the modulation layers whole on every rank,
# the log-sum-exp merge compiled with every dimension symbolic, as this code ran until now) and "after" (modulation
# shared, merge compiled static-first: the defaults).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/m3; mkdir -p $R/prof_before $R/prof_after
pack() { tar czf "$OUT/call3.tgz.tmp" -C $R . && mv "$OUT/call3.tgz.tmp" "$OUT/call3.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
for V in before after; do
  s $V
  if [ $V = before ]; then M=whole; export PATCHRAY_MERGE_DYNAMIC=1; else M=shared; unset PATCHRAY_MERGE_DYNAMIC; fi
  L=$(( 575 - (SECONDS - T0) )); [ $L -gt 285 ] && L=285
  timeout $L python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 \
    --mode overlapped --compile default --compile-attention compiled --warmup 3 --iters 2 --modulation $M \
    --alone-clock prefilled --deadline-s $((L - 70)) --timeout-s $((L - 5)) \
    --profile-dir $R/prof_$V --out $R/dit_flux_$V.json > $R/flux_$V.log 2>&1; pack
  grep "dit_bench .*s\]" $R/flux_$V.log | cut -c1-200
done
s done
