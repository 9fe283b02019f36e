#!/usr/bin/env bash
# Stops the redis-server started by start_redis.sh on REDIS_PORT (TERM, KILL after 5 s; a
# paused server is continued first). Removes its data directory and config file.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_stop.sh"
run=${UCM_RUN_DIR:-/tmp/ucm-backends/run}
port=${REDIS_PORT:-6390}
pid_file=$run/redis-$port.pid
stop_pid_file "$pid_file" redis-server
rm -rf "$run/redis-$port" "$run/redis-$port.conf"
exit 0
