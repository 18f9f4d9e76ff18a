#!/bin/bash
# Device call (repo root, one H200, ~250 s; carry .whl): FLUX.1 at full width (one double- and two single-stream
# blocks), final-latent error of the compressed presets with the codec GPU ranks now run (fused Triton kernels),
# N = 2 and 4; the codecs this machine offers are printed first (every rank offers the same, so they agree on the
# first).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/triton_err; mkdir -p $R
python3 -c "import torch; from patchray.distributed.sampling.comm_manager import codec_kinds; print('codecs offered:', codec_kinds(torch.device('cuda')))" | tee $R/codecs.txt
for N in 2 4; do
  timeout 150 python3 -m patchray.distributed.bench.dit_error --family flux --size full --layers 1 --steps 20 --warmup 4 \
    --device cuda --dtype bfloat16 --preset full_sync --preset displaced --preset compressed --preset compressed_2bit \
    --ranks $N --out $R/flux-1024-n$N-error-triton.json > $R/n$N.log 2>&1; echo "n$N rc $?"
  tail -6 $R/n$N.log | cut -c1-300
done
mkdir -p "$OUT/triton" && cp -r $R/. "$OUT/triton/"
