#!/usr/bin/env bash
# Stops the nfs-ganesha that start_nfs.sh started on NFS_PORT (TERM, KILL after 5 s; a paused
# server is continued first). Keeps the export directory.
set -uo pipefail
DIR=${UCM_RUN_DIR:-/tmp/ucm-backends/run}/ganesha-${NFS_PORT:-2049}
pid_file=$DIR/ganesha.pid
if [ -f "$pid_file" ]; then
  pid=$(cat "$pid_file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -CONT "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "# nfs-ganesha pid $pid stopped"
  fi
  rm -f "$pid_file" "$DIR/ganesha.own.pid"
fi
exit 0
