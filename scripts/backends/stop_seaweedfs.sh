#!/usr/bin/env bash
# Stops the SeaweedFS started by start_seaweedfs.sh on S3_PORT (TERM, KILL after 5 s; a
# paused server is continued first) and removes its sockets. Keeps the data unless WEED_WIPE=1.
set -uo pipefail
run=${UCM_RUN_DIR:-/tmp/ucm-backends/run}
data=${UCM_DATA_DIR:-/tmp/ucm-backends/data}/weed
port=${S3_PORT:-8333}
master=${WEED_PORT_BASE:-9333}
pid_file=$run/weed-$port.pid
if [ -f "$pid_file" ]; then
  pid=$(cat "$pid_file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -CONT "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "# seaweedfs pid $pid stopped"
  fi
  rm -f "$pid_file"
fi
# After a hard kill, weed leaves gRPC sockets whose /tmp path is hardcoded: remove ours.
for p in $((master + 10000)) $((master + 7 + 10000)) $((master - 445 + 10000)) $((port + 10000)) \
         $((master + 14313 + 10000)); do
  rm -f /tmp/seaweedfs-*-grpc-"$p".sock
done
rm -f "$run/weedtmp/filer-$port.sock" "$run/weedtmp/s3-$port.sock"
[ "${WEED_WIPE:-0}" = 1 ] && rm -rf "$data"
exit 0
