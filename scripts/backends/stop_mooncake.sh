#!/usr/bin/env bash
# Stops the Mooncake segment holder, master and metadata server that start_mooncake.sh started on
# MC_RPC_PORT (TERM, KILL after 5 s; a paused process is continued first).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_stop.sh"
dir=${UCM_RUN_DIR:-/tmp/ucm-backends/run}/mooncake-${MC_RPC_PORT:-50051}
for f in holder master meta; do
  stop_pid_file "$dir/$f.pid" "mooncake $f"
done
exit 0
