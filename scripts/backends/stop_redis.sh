#!/usr/bin/env bash
# Stops the redis-server started by start_redis.sh on REDIS_PORT (TERM, KILL after 5 s; a
# paused server is continued first). Removes its data directory and config file.
set -uo pipefail
run=${UCM_RUN_DIR:-/tmp/ucm-backends/run}
port=${REDIS_PORT:-6390}
pid_file=$run/redis-$port.pid
if [ -f "$pid_file" ]; then
  pid=$(cat "$pid_file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -CONT "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "# redis-server pid $pid stopped"
  fi
  rm -f "$pid_file"
fi
rm -rf "$run/redis-$port" "$run/redis-$port.conf"
exit 0
