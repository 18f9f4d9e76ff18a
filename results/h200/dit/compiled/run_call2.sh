#!/bin/bash
# Device call 2 (repo root): FLUX.1 after the gather without copies (eager, profiled) and with compiled blocks.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r; mkdir -p $R/prof $R/profc
pack() { tar czf "$OUT/call2.tgz.tmp" -C $R . && mv "$OUT/call2.tgz.tmp" "$OUT/call2.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s eager_profile
timeout 110 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 2 --ns 1,2 --preset flux1_1024 --mode gathered \
  --warmup 1 --iters 2 --alone-clock prefilled --timeout-s 105 --profile-dir $R/prof --out $R/dit_flux_eager2.json > $R/eager.log 2>&1; pack
tail -5 $R/eager.log
for f in $R/prof/*seq*r0.txt; do echo "## $f"; head -14 $f; done
s compiled
timeout 330 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 --mode gathered --mode ulysses \
  --compile default --warmup 2 --iters 2 --alone-clock prefilled --deadline-s 280 --timeout-s 320 --profile-dir $R/profc --out $R/dit_flux_compiled.json > $R/compiled.log 2>&1; pack
tail -9 $R/compiled.log
for f in $R/profc/*N=1_r0.txt $R/profc/*gathered_N=2_r0.txt; do echo "## $f"; head -13 $f; done
s done
