#!/bin/bash
# Device call 3 (from the repo root): DiT Ulysses cases under the prefilled clock (FLUX.1 N=1,2,4; Qwen-Image N=1,2),
# diffusers' own per-block issue time on one GPU, and weight sharding with host offload (FLUX.1, Wan 2.1 at N=2).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/call3.tgz.tmp" -C $R . && mv "$OUT/call3.tgz.tmp" "$OUT/call3.tgz"; }
T0=$SECONDS
s() { echo "== $1 at $((SECONDS - T0)) s"; }
s flux_ulysses
timeout 130 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 1,2,4 --preset flux1_1024 --mode ulysses \
  --alone-clock prefilled --deadline-s 95 --timeout-s 125 --out $R/dit_flux_ulysses_prefilled.json > $R/flux_ulysses.log 2>&1; pack
tail -12 $R/flux_ulysses.log
s qwen_ulysses
timeout 120 python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 2 --ns 1,2 --preset qwen_image_1328 --mode ulysses \
  --alone-clock prefilled --deadline-s 90 --timeout-s 115 --out $R/dit_qwen_ulysses_prefilled.json > $R/qwen_ulysses.log 2>&1; pack
tail -8 $R/qwen_ulysses.log
s issue_time
timeout 90 python3 results/h200/dit/issue_time.py --preset flux1_1024 --preset qwen_image_1328 --out $R/issue_time.json > $R/issue_time.log 2>&1; pack
tail -4 $R/issue_time.log
s shard_offload_flux
SHARD_BENCH_PARTIAL=$R/pflux timeout 100 python3 -m patchray.distributed.bench.shard_memory --device cuda --models flux1_12b --ranks 2 --sharding blocks+offload --timeout 95 --out $R/shard_flux > $R/shard_flux.log 2>&1; pack
grep -v '^There are' $R/shard_flux.log | tail -4 | cut -c1-600
s shard_offload_wan
SHARD_BENCH_PARTIAL=$R/pwan timeout 110 python3 -m patchray.distributed.bench.shard_memory --device cuda --models wan21_14b --ranks 2 --sharding blocks+offload --timeout 105 --out $R/shard_wan > $R/shard_wan.log 2>&1; pack
grep -v '^There are' $R/shard_wan.log | tail -4 | cut -c1-600
s done
