#!/bin/bash
# Device call 1 (from the repo root): video-VAE row memory (N = 4 cases, HunyuanVideo 544x960x65) beside ComfyUI's
# stock decode; weight-sharding FLUX.1 N = 2 measured cleanly; FLUX.1 final-latent error of the DiT presets.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pp && ln -sfn $PWD /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1
FINAL_OUT=$OUT; OUT=/tmp/r; mkdir -p $OUT
pack() { tar czf "$FINAL_OUT/call.tgz.tmp" -C /tmp/r . && mv "$FINAL_OUT/call.tgz.tmp" "$FINAL_OUT/call.tgz"; }
RM="python3 -m patchray.distributed.vae.row_memory"
T0=$SECONDS
(
  timeout 90 $RM --memory-fraction 0.07 --ranks 4 --families ltx_video_090 --shape 512x768x121 --out "$OUT/row_memory_ltx090_n4.json"
  timeout 90 $RM --memory-fraction 0.07 --ranks 4 --families hunyuan_image_refiner --shape 2048x2048x1 --out "$OUT/row_memory_refiner_n4.json"
  for n in 2 4; do
    timeout 110 python3 -m patchray.distributed.bench.dit_error --family flux --size full --layers 1 --steps 20 --warmup 4 \
      --device cuda --dtype bfloat16 --preset full_sync --preset displaced --preset compressed --preset compressed_2bit \
      --ranks $n --out "$OUT/flux-1024-n$n-error.json"
  done
) > "$OUT/lane_b.log" 2>&1 &
LANE_B=$!
(
  timeout 120 $RM --memory-fraction 0.45 --ranks 2 --families hunyuan_video_full_attention --shape 544x960x65 --out "$OUT/row_memory_hv540x65_n2.json"
  timeout 110 $RM --memory-fraction 0.235 --ranks 4 --families hunyuan_video_full_attention --shape 544x960x65 --out "$OUT/row_memory_hv540x65_n4.json"
  pack; echo "lane A row done at $((SECONDS - T0)) s"
) > "$OUT/lane_a.log" 2>&1
wait $LANE_B
echo "lane B done at $((SECONDS - T0)) s" >> "$OUT/lane_b.log"
pack
timeout 130 python3 tests/comfyui/stock_vae_memory.py .third_party/comfyui --only hunyuan_video_540p_65 --out "$OUT/stock_vae_memory_hv540x65.json" > "$OUT/stock.log" 2>&1
echo "stock done at $((SECONDS - T0)) s" >> "$OUT/stock.log"
pack
SHARD_BENCH_PARTIAL=$OUT/partial timeout 110 python3 -m patchray.distributed.bench.shard_memory --device cuda --models flux1_12b --ranks 2 --sharding blocks,none --timeout 100 --out "$OUT/shard" > "$OUT/shard.log" 2>&1
echo "shard done at $((SECONDS - T0)) s" >> "$OUT/shard.log"
pack
tail -3 "$OUT"/*.log
nvidia-smi --query-gpu=name,memory.total --format=csv
