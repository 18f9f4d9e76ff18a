#!/bin/bash
# Device call 4 (repo root, one H200, <= 200 s): the Wan 2.1 VAE row decode at N = 4 with rank 1's kernels profiled,
# at 720x1280x17 (5 latent frames) where the 81-frame profile does not fit one call; plain decode and N = 4 stage clock
# in the same run.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/w4; mkdir -p $R/rowperf
pack() { tar czf "$OUT/call4.tgz.tmp" -C $R . && mv "$OUT/call4.tgz.tmp" "$OUT/call4.tgz"; }
timeout 185 python3 results/h200/alone/rowperf.py --out $R/rowperf --cases wan:720x1280x17 --ranks 1 4 \
  --profile wan:720x1280x17:4:new --warmup 1 --iters 1 --iters-plain 1 > $R/rowperf.log 2>&1; echo rc $?; pack
grep -E "plain|ratio|profile |done" $R/rowperf.log | cut -c1-400 | tail -10
