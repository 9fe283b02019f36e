#!/usr/bin/env bash
# Stops the SeaweedFS started by start_seaweedfs.sh on S3_PORT (TERM, KILL after 5 s; a
# paused server is continued first) and removes its sockets. Keeps the data unless WEED_WIPE=1.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_stop.sh"
run=${UCM_RUN_DIR:-/tmp/ucm-backends/run}
data=${UCM_DATA_DIR:-/tmp/ucm-backends/data}/weed
port=${S3_PORT:-8333}
master=${WEED_PORT_BASE:-9333}
pid_file=$run/weed-$port.pid
stop_pid_file "$pid_file" seaweedfs
# After a hard kill, weed leaves gRPC sockets whose /tmp path is hardcoded: remove ours.
for p in $((master + 10000)) $((master + 7 + 10000)) $((master - 445 + 10000)) $((port + 10000)) \
         $((master + 14313 + 10000)); do
  rm -f /tmp/seaweedfs-*-grpc-"$p".sock
done
rm -f "$run/weedtmp/filer-$port.sock" "$run/weedtmp/s3-$port.sock"
[ "${WEED_WIPE:-0}" = 1 ] && rm -rf "$data"
exit 0
