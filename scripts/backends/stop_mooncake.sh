#!/usr/bin/env bash
# Stops the Mooncake segment holder, master and metadata server that start_mooncake.sh started on
# MC_RPC_PORT (TERM, KILL after 5 s; a paused process is continued first).
set -uo pipefail
dir=${UCM_RUN_DIR:-/tmp/ucm-backends/run}/mooncake-${MC_RPC_PORT:-50051}
for f in holder master meta; do
  pid_file=$dir/$f.pid
  [ -f "$pid_file" ] || continue
  pid=$(cat "$pid_file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -CONT "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "# mooncake $f pid $pid stopped"
  fi
  rm -f "$pid_file"
done
exit 0
