#!/bin/bash
# Device call 8 (repo root): the compressed exchange's codec on the H200 (eager and torch.compile), then the flux2
# VAE 2048x2048 row decode's per-rank compute alone at N = 2 and 4 with rank 1's kernels profiled. Expected ~420 s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r8; mkdir -p $R/rowperf
pack() { tar czf "$OUT/call8.tgz.tmp" -C $R . && mv "$OUT/call8.tgz.tmp" "$OUT/call8.tgz"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/machine.txt 2>&1
timeout 150 python3 -m patchray.distributed.bench.codec_bench --device cuda --numel 1048576 16777216 67108864 134217728 \
  --iters 5 --compiled --out $R/codec.json > $R/codec.log 2>&1; echo codec rc $?; pack
timeout 380 python3 results/h200/alone/rowperf.py --out $R/rowperf --cases flux2:2048x2048 --ranks 1 2 4 \
  --profile flux2:2048x2048:2:new flux2:2048x2048:4:new --warmup 1 --iters 2 --iters-plain 2 > $R/rowperf.log 2>&1; echo rc $?; pack
grep -E "plain|ratio|profile |done" $R/rowperf.log | cut -c1-300 | tail -12
python3 -c "
import json; d=json.load(open('$R/codec.json'))
for r in d['rows']: print({k: r.get(k) for k in ('numel','bits','compiled','encode_ms_per_gb','apply_ms_per_gb','receiver_equals_sender','error')})"
