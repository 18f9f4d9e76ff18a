#!/bin/bash
# The second H200 call for the video-VAE figures (run from the staged tree on the device, $OUT = the results folder).
# Cases in order of importance, each under its own time limit (a case cut short keeps the JSON written so far):
#   lane A (one after the other, they need most of the GPU): HunyuanVideo row mode at 544x960x129, N = 2 then N = 4;
#     then ComfyUI's own decode of the same VAE at the same size.
#   lane B (beside lane A: a few GiB per rank, little compute): LTX-Video 0.9.0 at 512x768x121 (its own size),
#     the HunyuanImage-2.1 refiner VAE at 2048x2048, both N = 2 and 4.
# timeout(1) signals its whole process group, so a case's rank processes end with it.
set -u
END=$((SECONDS + ${BUDGET_S:-100}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && echo "$1" || echo "$((l > 1 ? l : 1))"; }
RM="python3 -m patchray.distributed.vae.row_memory"
(
  timeout "$(left 45)" $RM --memory-fraction 0.07 --ranks 2 4 --families ltx_video_090 --shape 512x768x121 --out "$OUT/row_memory_ltx090.json"
  timeout "$(left 45)" $RM --memory-fraction 0.07 --ranks 2 4 --families hunyuan_image_refiner --shape 2048x2048x1 --out "$OUT/row_memory_refiner.json"
) > "$OUT/lane_b.log" 2>&1 &
LANE_B=$!
timeout "$(left 50)" $RM --memory-fraction 0.40 --ranks 2 --families hunyuan_video_full_attention --shape 544x960x129 --out "$OUT/row_memory_hv540.json"
timeout "$(left 45)" $RM --memory-fraction 0.235 --ranks 4 --families hunyuan_video_full_attention --shape 544x960x129 --out "$OUT/row_memory_hv540.json"
wait $LANE_B
timeout "$(left 60)" python3 tests/comfyui/stock_vae_memory.py ../../.third_party/comfyui --only hunyuan_video_540p --out "$OUT/stock_vae_memory_hv540.json"
cat "$OUT/lane_b.log"
nvidia-smi --query-gpu=name,memory.total --format=csv
echo "elapsed ${SECONDS}s"
