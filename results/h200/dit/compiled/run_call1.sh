#!/bin/bash
# Device call 1 (repo root): FLUX.1 kernels per class at N = 1 and a sequence rank at N = 2 (profiled after the timed
# calls), and eager vs compiled vs CUDA-graph FLUX.1 calls on one GPU.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r; mkdir -p $R/prof
pack() { tar czf "$OUT/call1.tgz.tmp" -C $R . && mv "$OUT/call1.tgz.tmp" "$OUT/call1.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s flux_profile
timeout 170 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 2 --ns 1,2 --preset flux1_1024 --mode gathered \
  --warmup 1 --iters 2 --alone-clock prefilled --timeout-s 165 --profile-dir $R/prof --out $R/dit_flux_profile.json > $R/flux_profile.log 2>&1; pack
tail -6 $R/flux_profile.log
for f in $R/prof/*.txt; do echo "## $f"; head -14 $f; done
s compile_probe
timeout 300 python3 results/h200/dit/compile_probe.py --out $R/compile_probe.json > $R/compile_probe.log 2>&1; pack
tail -12 $R/compile_probe.log | cut -c1-400
s done
