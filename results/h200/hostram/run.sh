#!/usr/bin/env bash
# Host memory of the Distributed KSampler's weight transport with GPU ranks: FLUX.1-dev's transformer (23.8 GB bf16,
# random weights held in host memory by the driver, as ComfyUI holds a loaded model) shipped in 256 MB parts
# (sampling/ship.py) to 2 and 4 ranks sharing one H200, sharding blocks and none; then, while time remains, the
# former placement of a whole model (none-host, 2 ranks) and Wan 2.1 14B (4 ranks, blocks).
#
# Device (from the repository root, carry [".whl", ".stage/raybundle"]; no network, no Ray installed there):
#   bash results/h200/hostram/run.sh
# Expected wall time: about 200 s (kept under 220 s by a deadline: a step that would not fit is skipped, a step
# that overruns is stopped and its finished cases kept). Output: $OUT/hostram.tar.gz (records, summary.json,
# hostram.png, log) and a table on stdout.
# CPU check of the same logic (tiny model, CPU ranks, this machine's Ray bundle):
#   HOSTRAM_DEVICE=cpu HOSTRAM_MODEL=flux1-tiny HOSTRAM_RANKS=2 HOSTRAM_EXTRA=0 RAYBUNDLE=/tmp/bundle OUT=/tmp/o \
#     PYTHON=.venv/bin/python bash results/h200/hostram/run.sh
set -uo pipefail
T0=$(date +%s)
BUDGET=${HOSTRAM_BUDGET_S:-220}
PY=${PYTHON:-python3}
DEVICE=${HOSTRAM_DEVICE:-cuda}
MODEL=${HOSTRAM_MODEL:-flux1}
RANKS=${HOSTRAM_RANKS:-"2 4"}
EXTRA=${HOSTRAM_EXTRA:-1}
BUNDLE_DIR=${RAYBUNDLE:-.stage/raybundle}
OUT=${OUT:-/tmp/hostram_out}
mkdir -p "$OUT"
W=$(mktemp -d /tmp/hostram.XXXXXX)
mkdir -p "$W/hostram"
R="$W/hostram"
LOG="$R/log.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(elapsed) s] $*" | tee -a "$LOG"; }

# Python path: the unpacked Ray bundle first, then PatchRay as the package `patchray` (and the .whl folder's
# diffusers when the setup prefix has not installed it yet)
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
BUNDLE="$BUNDLE_DIR/raysite-$TAG.tar.xz"
[ -f "$BUNDLE" ] || { echo "no Ray bundle $BUNDLE (results/h200/hostram/make_ray_bundle.sh builds it)"; exit 2; }
"$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$BUNDLE" "$W/raysite"
mkdir -p "$W/pp" && ln -sfn "$PWD" "$W/pp/patchray"
export PYTHONPATH="$W/raysite/site:$W/pp${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PY" -c "import diffusers" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$W/site"
fi
"$PY" -c "import ray, patchray, diffusers, psutil; print('ray', ray.__version__, ray.__file__, 'patchray', patchray.__file__); print('diffusers', diffusers.__version__)" 2>&1 | tee -a "$LOG"
if [ "${PIPESTATUS[0]}" != 0 ]; then
    echo "imports failed (log above)"; tar -czf "$OUT/hostram.tar.gz" -C "$W" hostram; exit 3
fi
say "bundle unpacked"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1 | tee -a "$LOG"
free -g | tee -a "$LOG"
df -h /dev/shm /tmp 2>&1 | tee -a "$LOG"  # Ray's object store lives in /dev/shm (in /tmp, slower, when it is too small)

# one process (one Ray cluster) per rank count; each case builds its own driver model and ships it
step() {  # step NAME MIN_SECONDS_LEFT ARGS...
    local name=$1 need=$2; shift 2
    local left=$(( BUDGET - $(elapsed) ))
    if [ "$left" -lt "$need" ]; then say "skip $name: ${left} s left, it needs about ${need} s"; return; fi
    say "start $name ($left s left)"
    timeout --signal=TERM --kill-after=5 "$left" "$PY" -m patchray.distributed.bench.host_copy --device "$DEVICE" \
        --part-mb 256 --later 1 --object-store-mb "${HOSTRAM_STORE_MB:-2048}" --run-blocks "${HOSTRAM_RUN_BLOCKS:-2}" --out "$R/$name.json" "$@" >> "$LOG" 2>&1
    say "end $name (rc $?)"
}
for n in $RANKS; do
    step "${MODEL}-n$n" 40 --model "$MODEL" --ranks "$n" --cases parts:blocks,parts:none
done
if [ "$EXTRA" = 1 ]; then
    step "${MODEL}-n2-none-host" 45 --model "$MODEL" --ranks 2 --cases parts:none-host
    [ "$DEVICE" = cuda ] && step "wan21-14b-n4" 55 --model wan21-14b --ranks 4 --cases parts:blocks
fi
grep -E "^host_copy:|Error|error|Traceback" "$LOG" | tail -20
"$PY" results/h200/hostram/summarize.py "$R" "$R"/*.json 2>&1 | tee "$R/table.md"
tar -czf "$OUT/hostram.tar.gz" -C "$W" hostram
say "wrote $OUT/hostram.tar.gz ($(du -h "$OUT/hostram.tar.gz" | cut -f1))"
