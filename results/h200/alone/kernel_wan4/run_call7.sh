#!/bin/bash
# Device call 7 (repo root): the Wan 2.1 VAE 720x1280x81 row decode's kernel time at N = 4 (rank 1's turn profiled)
# against one profiled plain decode. Expected wall time ~450 s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/r7; mkdir -p $R/rowperf
pack() { tar czf "$OUT/call7.tgz.tmp" -C $R . && mv "$OUT/call7.tgz.tmp" "$OUT/call7.tgz"; }
timeout 520 python3 results/h200/alone/rowperf.py --out $R/rowperf --cases wan:720x1280x81 --ranks 1 4 \
  --profile wan:720x1280x81:4:new --warmup 1 --iters 1 --iters-plain 1 > $R/rowperf.log 2>&1; echo rc $?; pack
grep -E "plain|ratio|profile |done" $R/rowperf.log | cut -c1-400 | tail -10
