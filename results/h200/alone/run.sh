#!/bin/bash
# PatchRay measure helper: CPU validation of turn-taking + GPU alone-compute, one batch (results -> $OUT/measure.tgz)
cd "$(dirname "$0")"; H=$PWD; R=/tmp/res; mkdir -p $R/gpu $R/cpu
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
(nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -i "model name"; python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())") > $R/machine.txt 2>&1
AC="python3 -m patchray.distributed.bench.alone_check"
cpu() { PYTHONPATH=/tmp/site:$H/$1 timeout 480 python3 pin.py $2 $AC ${@:3}; }
( cpu new 0-3 --ranks 2 4 --height 256 --width 256 --rounds 3 --out $R/cpu/alone-check-kl-256.json > $R/cpu/ac256.log 2>&1 ) &
( cpu new 4-7 --ranks 2 4 --height 512 --width 512 --rounds 1 --out $R/cpu/alone-check-kl-512.json > $R/cpu/ac512.log 2>&1 ) &
( cpu old 8-11 --ranks 2 4 --height 512 --width 512 --rounds 1 --out $R/cpu/alone-check-kl-512-before.json > $R/cpu/ac512-before.log 2>&1 ) &
B="python3 pin.py 12-15 python3 -m patchray bench --launcher spawn --device cuda --backend gloo --dtype bf16 --timing alone --warmup 1 --iters 2 --no-chart"
(
export PYTHONPATH=/tmp/site:$H/new
for N in 1 2 4; do
  U=""; [ $N = 1 ] && U="--case unsharded"
  timeout 150 $B --ranks $N --family kl --height 2048 --width 2048 $U --case row --out $R/gpu/kl-2048x2048-${N}r.json
  timeout 200 $B --ranks $N --family wan --height 720 --width 1280 --frames 81 $U --case row --out $R/gpu/wan-720x1280x81-${N}r.json
done
) > $R/gpu/gpu.log 2>&1 &
wait
tar czf $OUT/measure.tgz -C $R .
tail -5 $R/cpu/*.log $R/gpu/gpu.log
