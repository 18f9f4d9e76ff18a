#!/bin/bash
# Device call (from the repo root; expected wall time ~130 s, bounded by the timeouts below at 170 s): FLUX.1 at its
# full width (3072 wide, 24 heads, 4096 image + 512 text tokens, one double- and two single-stream blocks), bf16,
# ranks sharing the H200 under gloo, a 28-step rectified-flow Euler loop with FLUX's shifted sigmas: the final-latent
# relative L2 against full_sync of the same N for compressed (4-bit) with 1, 2 and 4 exact warm-up steps, text whole
# and sharded, and displaced at 4 warm-up steps with the text whole (the presets' defaults) and at 1 with it sharded.
# N = 2 and N = 4 run side by side. Writes ONE tar.gz under $OUT (warmup.tgz: two JSONs and the logs).
# CPU rehearsal: SIZE=tiny DEVICE=cpu DTYPE=float32 STEPS=6 bash results/h200/warmup/run_warmup.sh
set -u
SIZE=${SIZE:-full}; DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}; STEPS=${STEPS:-28}; LIMIT=${LIMIT:-170}
if [ "$DEVICE" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
  export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo
fi
PY=${PY:-python3}
FINAL_OUT=${OUT:-/tmp/warmup-out}; R=$(mktemp -d); mkdir -p "$FINAL_OUT"
T0=$SECONDS
CASES=""
for w in 1 2 4; do for t in whole sharded; do CASES="$CASES --case compressed/w$w/$t"; done; done
CASES="$CASES --case displaced/w4/whole --case displaced/w1/sharded"
for n in 2 4; do
  timeout $LIMIT $PY -m patchray.distributed.bench.dit_error --family flux --size $SIZE --layers 1 --steps $STEPS \
    --device $DEVICE --dtype $DTYPE --attention auto --link pcie4_x16_no_p2p $CASES --ranks $n \
    --out "$R/flux-1024-n$n-warmup.json" > "$R/n$n.log" 2>&1 &
done
wait
echo "wall $((SECONDS - T0)) s" >> "$R/n2.log"
tar czf "$FINAL_OUT/warmup.tgz" -C "$R" .
for n in 2 4; do echo "== N=$n"; grep -E "rel L2|Error|error" "$R/n$n.log" | grep -v float32 | head -12; done
echo "wall $((SECONDS - T0)) s"
