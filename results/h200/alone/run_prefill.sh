#!/bin/bash
# Turn-taking with the prefilled GPU clock on one GPU: FLUX.1 (a), kl row decode (d), Qwen-Image (b), SDXL sampling (c),
# then FLUX.1 under the earlier idle-start clock if time is left (e), in that order of importance, within one budget
# (BUDGET seconds, default 520: every command's timeout is the smaller of its own cap and what is left, and a
# command with under 30 s left is skipped).
#
# Run from the repository root on the GPU machine with the package importable as `patchray` (and diffusers):
#     OUT=/some/dir bash results/h200/alone/run_prefill.sh
# Writes $OUT/prefill.tgz (every JSON, PNG and log; re-packed after each command, so a run cut short keeps what
# finished) and $OUT/summary.txt (each command, its exit status and seconds).
# SMOKE=1: the same commands on CPU with tiny models, at most 2 ranks (a check of this script, no figures).
set -u
OUT=${OUT:-/tmp/prefill_out}
BUDGET=${BUDGET:-520}
R=/tmp/prefill_res
rm -rf "$R"; mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 PATCHRAY_SPAWN_BACKEND=gloo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
HERE=$(cd "$(dirname "$0")" && pwd)
DEV=cuda; SIZE=full; KL=kl:2048x2048; W=4; NS=1,2,4; ROWN="1 2 4"; SB="--height 1024 --width 1024"; S2=12; S4=8
if [ "${SMOKE:-0}" = 1 ]; then
    DEV=cpu; SIZE=tiny; KL=kl:64x64; W=2; NS=1,2; ROWN="1 2"; SB="--tiny --height 256 --width 256"; S2=6; S4=0
fi
T0=$(date +%s)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
(nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
 python3 -c "import torch, diffusers; print(torch.__version__, diffusers.__version__, torch.cuda.device_count())") > "$R/machine.txt" 2>&1

pack() { tar czf "$OUT/prefill.tgz" -C "$R" . 2>/dev/null; }

step() {  # step NAME CAP COMMAND...: run COMMAND with timeout min(CAP, budget left), log to $R/NAME.log
    local name=$1 cap=$2
    shift 2
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    local t=$(( left < cap ? left : cap ))
    if [ "$t" -lt 30 ]; then
        echo "$name: skipped (budget: ${left} s left)" | tee -a "$SUMMARY"
        return
    fi
    local s=$(date +%s)
    echo "$name: start, timeout ${t} s" | tee -a "$SUMMARY"
    timeout -k 10 "$t" $PIN "$@" > "$R/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc after $(( $(date +%s) - s )) s" | tee -a "$SUMMARY"
    tail -n 15 "$R/$name.log" >> "$SUMMARY"
    pack
}

# optional (ALONE_CHECK=1 on a host of 16+ cores): the CPU validation of turn-taking (modelled within 15% of measured,
# CPU ranks, one pinned core each) on cores 12-15 in the background, the GPU commands on cores 0-11
PIN=""
if [ "${ALONE_CHECK:-0}" = 1 ] && [ "$(nproc)" -ge 16 ]; then
    PIN="taskset -c 0-11"
    (OMP_NUM_THREADS=1 timeout 400 taskset -c 12-15 python3 -m patchray.distributed.bench.alone_check --ranks 2 4 \
        --height 256 --width 256 --rounds 3 --out "$R/alone_check_kl256.json" > "$R/alone_check.log" 2>&1) &
fi

# the prefilled clock's own checks on the device (spin calibration; a 400-kernel stage timed without launch gaps)
step t_clock_tests 40 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_prefill.py

# (a) FLUX.1-dev 1024x1024, N = 1, 2, 4, every exact mode (cfg, gathered, ulysses, cfg x seq2), prefilled clock (~100 s)
step a_flux 150 python3 -m patchray.distributed.bench.dit_bench --device $DEV --size $SIZE --ranks $W --ns $NS --preset flux1_1024 \
    --alone-clock prefilled --deadline-s 110 --watchdog-s 90 --timeout-s 140 --out "$R/dit_flux_prefilled.json"

# (d) kl decoder 2048x2048, row decode N = 1, 2, 4, compute alone under both clocks (~60 s)
step d_kl_row 100 env OMP_NUM_THREADS=1 python3 "$HERE/rowperf.py" --out "$R/rowperf_kl" --cases $KL --device $DEV \
    --size $SIZE --ranks $ROWN --alone-clock prefilled idle --warmup 1 --iters 2 --iters-plain 3

# (b) Qwen-Image 1328x1328, N = 1, 2 (two full copies of 38 GiB fit; four do not), prefilled clock (~120 s)
step b_qwen 150 python3 -m patchray.distributed.bench.dit_bench --device $DEV --size $SIZE --ranks 2 --ns 1,2 \
    --preset qwen_image_1328 --alone-clock prefilled --deadline-s 110 --watchdog-s 90 --timeout-s 140 \
    --out "$R/dit_qwen_prefilled.json"

# (c) SDXL UNet 1024x1024 sampling, N = 2 then 4, full_sync / displaced / compressed, turn-taking only (~100 s each;
# gloo carries every exchange of CUDA tensors through host memory: ~0.2-0.6 GB/s, which is most of the time)
step c_sdxl_n2 150 python3 -m patchray sample-bench --launcher spawn --device $DEV --ranks 2 $SB \
    --steps $S2 --split off --timing alone --alone-clock prefilled --preset full_sync --preset displaced \
    --preset compressed --out "$R/sdxl_n2_prefilled.json"
[ "$S4" -gt 0 ] && step c_sdxl_n4 150 python3 -m patchray sample-bench --launcher spawn --device $DEV --ranks 4 $SB \
    --steps $S4 --split off --timing alone --alone-clock prefilled --preset full_sync --preset displaced \
    --preset compressed --out "$R/sdxl_n4_prefilled.json"

# (e) if time is left: FLUX.1 N = 1, 2 under the earlier clock (each stage from an idle GPU), the same-machine comparison
step e_flux_idle 70 python3 -m patchray.distributed.bench.dit_bench --device $DEV --size $SIZE --ranks 2 --ns 1,2 \
    --preset flux1_1024 --mode gathered --mode ulysses --alone-clock idle --deadline-s 45 --watchdog-s 60 \
    --timeout-s 65 --out "$R/dit_flux_idle.json"

wait  # the optional alone check
[ -f "$R/alone_check.log" ] && tail -n 6 "$R/alone_check.log" >> "$SUMMARY"
echo "total $(( $(date +%s) - T0 )) s" | tee -a "$SUMMARY"
pack
