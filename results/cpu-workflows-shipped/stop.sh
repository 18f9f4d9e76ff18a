#!/bin/bash
BASE=${BASE:-/tmp/qa3_base}
PID=$(cat "$BASE/server.pid")
kill -INT "$PID" 2>/dev/null
for i in $(seq 1 30); do kill -0 "$PID" 2>/dev/null || break; sleep 1; done
kill -KILL -- "-$PID" 2>/dev/null   # the server's own session (setsid): the Ray processes it started
echo stopped
