#!/bin/bash
# Device call 3 (repo root, one H200, ~330 s): FLUX.1 12B at 1024x1024, N = 1 and 4 overlapped (call 2 ran out of its
# deadline before these), eager and with compiled blocks, each rank profiled.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/o3; mkdir -p $R/prof_eager $R/prof_compiled
pack() { tar czf "$OUT/call3.tgz.tmp" -C $R . && mv "$OUT/call3.tgz.tmp" "$OUT/call3.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s flux_eager
timeout 165 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,4 --preset flux1_1024 \
  --mode overlapped --warmup 2 --iters 2 --alone-clock prefilled --deadline-s 150 --timeout-s 160 \
  --profile-dir $R/prof_eager --out $R/dit_flux_overlap4_eager.json > $R/flux_eager.log 2>&1; pack
tail -5 $R/flux_eager.log | cut -c1-300
s flux_compiled
L=$(( 400 - (SECONDS - T0) )); [ $L -gt 230 ] && L=230
timeout $L python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,4 --preset flux1_1024 \
  --mode overlapped --compile default --compile-attention compiled --warmup 3 --iters 2 \
  --alone-clock prefilled --deadline-s $((L - 20)) --timeout-s $((L - 5)) \
  --profile-dir $R/prof_compiled --out $R/dit_flux_overlap4_compiled.json > $R/flux_compiled.log 2>&1; pack
tail -5 $R/flux_compiled.log | cut -c1-300
s done
