#!/bin/bash
# Device call 1 (repo root, one H200, ~450 s; carry .whl: diffusers 0.42.1 + importlib_metadata): FLUX.1 12B at
# 1024x1024, overlapped attention, compiled blocks, N = 1, 2, 4, with the blocks' modulation layers computed once
# across the ranks (shared, the default) and in full on every rank (whole), each rank profiled.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/m1; mkdir -p $R/prof_shared $R/prof_whole
pack() { tar czf "$OUT/call1.tgz.tmp" -C $R . && mv "$OUT/call1.tgz.tmp" "$OUT/call1.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
for M in shared whole; do
  s $M
  L=$(( 560 - (SECONDS - T0) )); [ $L -gt 275 ] && L=275
  timeout $L python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 \
    --mode overlapped --compile default --compile-attention compiled --warmup 3 --iters 2 --modulation $M \
    --alone-clock prefilled --deadline-s $((L - 60)) --timeout-s $((L - 5)) \
    --profile-dir $R/prof_$M --out $R/dit_flux_modulation_$M.json > $R/flux_$M.log 2>&1; pack
  grep "dit_bench .*s\]" $R/flux_$M.log | cut -c1-260
done
s done
