#!/bin/bash
# Multi-GPU measurements (one rank per GPU, NCCL), prepared for a machine with 2 or 4 GPUs; NOT RUN YET (no
# multi-GPU machine has been lent). From the repository root, one part per device call (each fits 10 minutes):
#
#   bash results/multi-gpu/run.sh PART [p2p|nop2p]
#
# PART: flux | wan (the DiT rank side, every exact mode, compute alone + ranks at once, MODELLED beside MEASURED),
#       errors-flux | errors-wan (the sampling presets at full size: step time with the ranks at once, final-latent
#       error vs full_sync, bytes per step; N = 1 full_sync first, the speed-ups' reference),
#       sharding (weight sharding none / blocks: per-rank peak memory, host RAM, step time).
# nop2p sets NCCL_P2P_DISABLE=1 (NCCL stages through host memory: the stand-in for consumer boards without P2P).
# Results go to $OUT/<part>-<p2p|nop2p>/ (JSON + PNG + log).
set -u
PART=${1:?flux, wan, errors-flux, errors-wan or sharding}
LINK=${2:-p2p}
[ "$LINK" = nop2p ] && export NCCL_P2P_DISABLE=1
if ls .whl/*.whl > /dev/null 2>&1; then  # diffusers and its pure-Python dependencies, carried to a machine without network
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/patchray
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1
G=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$G" -ge 2 ] || { echo "needs 2 or more GPUs; this machine shows $G"; exit 2; }
NS=1,2; [ "$G" -ge 4 ] && NS=1,2,4
R=${OUT:-/tmp/out}/$PART-$LINK; mkdir -p "$R"
nvidia-smi topo -m > "$R/topology.txt" 2>&1
case "$PART" in
  flux|wan)
    P=flux1_1024; [ "$PART" = wan ] && P=wan21_14b_480x832x81
    timeout 560 python3 -m patchray.distributed.bench.dit_bench --device cuda --gpu-per-rank --concurrent \
      --ranks "$G" --ns "$NS" --preset $P --mode gathered,ulysses,cfg,overlapped,ring --compile default \
      --warmup 2 --iters 3 --deadline-s 480 --timeout-s 550 --out "$R/dit_$PART.json" > "$R/dit_$PART.log" 2>&1
    tail -30 "$R/dit_$PART.log" ;;
  errors-flux|errors-wan)
    F=flux; L=19; S=28; [ "$PART" = errors-wan ] && { F=wan; L=40; S=20; }
    timeout 120 python3 -m patchray.distributed.bench.dit_error --family $F --layers $L --steps $S --ranks 1 \
      --device cuda --dtype bfloat16 --preset full_sync --out "$R/err_${F}_n1.json" > "$R/err_${F}_n1.log" 2>&1
    for N in 2 4; do
      [ "$N" -le "$G" ] || continue
      timeout 200 python3 -m patchray.distributed.bench.dit_error --family $F --layers $L --steps $S --ranks $N \
        --gpu-per-rank --device cuda --dtype bfloat16 --warmup 1 --preset full_sync --preset displaced \
        --preset otil --preset compressed --out "$R/err_${F}_n$N.json" > "$R/err_${F}_n$N.log" 2>&1
    done
    tail -n 6 "$R"/err_*.log ;;
  sharding)
    timeout 560 python3 -m patchray.distributed.bench.shard_memory --models wan21_14b,flux1_12b --ranks "${NS#1,}" \
      --device cuda --gpu-per-rank \
      --sharding none,blocks --out "$R" > "$R/shard.log" 2>&1
    tail -20 "$R/shard.log" ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
