#!/usr/bin/env bash
# Stops the nfs-ganesha that start_nfs.sh started on NFS_PORT (TERM, KILL after 5 s; a paused
# server is continued first). Keeps the export directory.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_stop.sh"
DIR=${UCM_RUN_DIR:-/tmp/ucm-backends/run}/ganesha-${NFS_PORT:-2049}
pid_file=$DIR/ganesha.pid
stop_pid_file "$pid_file" nfs-ganesha
rm -f "$DIR/ganesha.own.pid"
exit 0
