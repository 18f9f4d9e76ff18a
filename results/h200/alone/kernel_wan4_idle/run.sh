#!/bin/bash
# Device call (repo root, one H200, <= 230 s; carry .whl): the Wan 2.1 VAE row decode at N = 4, 720x1280x17, with
# rank 1's kernels profiled under the idle-start turn-taking clock (the prefilled clock's profile ran past the call's
# limit twice: ../kernel_wan4/, ../kernel_wan4_17/); plain decode and both clocks' stage figures in the same run.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/w4i; mkdir -p $R/rowperf
timeout ${WAN_LIMIT:-220} python3 results/h200/alone/rowperf.py --out $R/rowperf --cases wan:720x1280x17 --ranks 1 4 \
  --alone-clock idle prefilled --profile wan:720x1280x17:4:new --warmup 1 --iters 1 --iters-plain 1 \
  > $R/rowperf.log 2>&1; echo "wan rc $?"
mkdir -p "$OUT/kernel_wan4_idle" && cp -r $R/. "$OUT/kernel_wan4_idle/"
grep -E "plain|ratio|profile |done" $R/rowperf.log | cut -c1-400 | tail -10
