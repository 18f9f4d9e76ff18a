#!/bin/bash
# ComfyUI 0.3.64 (--cpu) on 127.0.0.1:$PORT with a private base dir: this checkout linked as custom_nodes/PatchRay,
# the random-weight model files of tests/comfyui/make_models.py under models/, example.png under input/.
# Usage: BASE=/tmp/qa3_base PORT=8493 bash start.sh   (PID in $BASE/server.pid; stop.sh stops its whole session)
set -e
BASE=${BASE:-/tmp/qa3_base}; PORT=${PORT:-8493}; HERE=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$BASE/custom_nodes" "$BASE/input"
ln -sfn "$HERE" "$BASE/custom_nodes/PatchRay"
cp -n /work/main/.comfyui/input/example.png "$BASE/input/" 2>/dev/null || true
cd /work/main/.comfyui
OMP_NUM_THREADS=1 setsid /work/main/.comfyui/.venv/bin/python main.py --cpu --listen 127.0.0.1 --port "$PORT" \
  --base-directory "$BASE" --disable-auto-launch --dont-print-server --disable-api-nodes > "$BASE/server.log" 2>&1 &
echo $! > "$BASE/server.pid"
for i in $(seq 1 180); do
  curl -s -o /dev/null -w "%{http_code}" "http://127.0.0.1:$PORT/system_stats" 2>/dev/null | grep -q 200 && { echo "up after $i s"; exit 0; }
  sleep 1
done
echo "not up"; tail -30 "$BASE/server.log"; exit 1
