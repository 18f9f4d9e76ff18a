#!/bin/bash
# Device call 9 (repo root): the compressed exchange's codec eager and compiled (compiled=True: torch.compile's fused
# kernels) on the H200; then FLUX.1 1024x1024 sequence ranks with the text whole on every rank (the stale presets'
# default layout), compiled blocks and attention, N = 2 and 4, each rank's compute alone, kernels profiled.
# Expected ~480 s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r9; mkdir -p $R/prof
pack() { tar czf "$OUT/call9.tgz.tmp" -C $R . && mv "$OUT/call9.tgz.tmp" "$OUT/call9.tgz"; }
T0=$SECONDS
timeout 170 python3 -m patchray.distributed.bench.codec_bench --device cuda --numel 16777216 134217728 \
  --iters 5 --compiled --out $R/codec.json > $R/codec.log 2>&1; echo codec rc $? at $((SECONDS - T0)) s; pack
python3 -c "
import json; d=json.load(open('$R/codec.json'))
for r in d['rows']: print({k: r.get(k) for k in ('numel','bits','compiled','encode_ms_per_gb','apply_ms_per_gb','receiver_equals_sender','error')})"
L=$(( 560 - (SECONDS - T0) ))
timeout $L python3 -m patchray.distributed.bench.dit_bench --device cuda --ranks 4 --ns 2,4 --preset flux1_1024 --mode gathered \
  --text-tokens replicated --compile default --compile-attention compiled --warmup 3 --iters 2 --alone-clock prefilled \
  --deadline-s $((L - 60)) --timeout-s $((L - 5)) --profile-dir $R/prof --out $R/dit_flux_textwhole.json > $R/flux.log 2>&1
echo flux rc $? at $((SECONDS - T0)) s; pack
grep -E "compute/call|^flux1|Error|error" $R/flux.log | cut -c1-300 | tail -10
