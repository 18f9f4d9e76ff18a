#!/bin/bash
# Device call 2 (repo root, one H200, ~550 s; call 1 ran the first version, its merge unfused and its gather staged by hand): the overlapped mode's attention parts on CUDA (lse_check.py), then
# FLUX.1 12B at 1024x1024, N = 1, 2, 4, gathered and overlapped, eager and with compiled blocks, each rank profiled.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/o2; mkdir -p $R/prof_eager $R/prof_compiled
pack() { tar czf "$OUT/call2.tgz.tmp" -C $R . && mv "$OUT/call2.tgz.tmp" "$OUT/call2.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s lse_check
timeout 60 python3 results/h200/dit/overlap/lse_check.py $R/lse_check.json > $R/lse_check.log 2>&1; tail -30 $R/lse_check.log; pack
s flux_eager
timeout 255 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 \
  --mode gathered --mode overlapped --warmup 2 --iters 2 --alone-clock prefilled --deadline-s 225 --timeout-s 250 \
  --profile-dir $R/prof_eager --out $R/dit_flux_overlap_eager.json > $R/flux_eager.log 2>&1; pack
tail -7 $R/flux_eager.log | cut -c1-300
s flux_compiled
L=$(( 578 - (SECONDS - T0) )); [ $L -gt 300 ] && L=300
timeout $L python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 \
  --mode gathered --mode overlapped --compile default --compile-attention compiled --warmup 3 --iters 2 \
  --alone-clock prefilled --deadline-s $((L - 40)) --timeout-s $((L - 5)) \
  --profile-dir $R/prof_compiled --out $R/dit_flux_overlap_compiled.json > $R/flux_compiled.log 2>&1; pack
tail -7 $R/flux_compiled.log | cut -c1-300
s done
