#!/bin/bash
# start ComfyUI on 127.0.0.1:8473 with the qavae base dir; writes PID to /tmp/qavae/server.pid
cd /work/main/.comfyui
OMP_NUM_THREADS=1 setsid /work/main/.comfyui/.venv/bin/python main.py --cpu --listen 127.0.0.1 --port 8473 \
  --base-directory /tmp/qavae/base --disable-auto-launch --dont-print-server --disable-api-nodes > /tmp/qavae/server.log 2>&1 &
echo $! > /tmp/qavae/server.pid
for i in $(seq 1 120); do
  curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:8473/system_stats 2>/dev/null | grep -q 200 && { echo "up after $i s"; exit 0; }
  sleep 1
done
echo "not up"; tail -30 /tmp/qavae/server.log
