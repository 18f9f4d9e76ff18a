#!/bin/bash
# Device call (repo root, one H200; carry .whl): SDXL 1024x1024 in row bands (split off), each rank's compute per
# step measured alone by turn-taking (prefilled clock), full_sync / displaced / compressed; N from $1 (2 or 4),
# steps from $2 (the first 4 are the presets' exact warm-up steps), limit from $3, presets from $PRESETS.
set -u
N=${1:-2}; STEPS=${2:-8}; LIMIT=${3:-280}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
R=/tmp/sdxl_alone; mkdir -p $R
timeout $LIMIT python3 -m patchray sample-bench --launcher spawn --ranks $N --device cuda --height 1024 --width 1024 \
  --steps $STEPS --split off ${PRESETS:---preset full_sync --preset displaced --preset compressed} --timing alone \
  --out $R/sdxl-1024-n$N-alone-${STEPS}steps.json > $R/sdxl_n$N.log 2>&1; echo "sdxl n$N rc $?"
mkdir -p "$OUT/sdxl-alone" && cp -r $R/. "$OUT/sdxl-alone/"
tail -5 $R/sdxl_n$N.log | cut -c1-400
