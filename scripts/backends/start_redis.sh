#!/usr/bin/env bash
# Starts redis-server (Debian package redis-server) on 127.0.0.1 only, with a password
# enforced and no persistence, then waits until it answers an authenticated INFO and checks
# that an unauthenticated one is refused. Prints the connection settings as shell assignments
# (the password is never printed: it is in the config file, mode 600).
#
#   REDIS_PORT (6390)  REDIS_PASSWORD (ucmtest-redis)  REDIS_MAXMEMORY (0: no limit)
#   UCM_RUN_DIR        config, pid, log and the server's directory (/tmp/ucm-backends/run)
#   REDIS_NETNS        run the server inside this network namespace (made by netns.sh); there
#                      it binds 127.0.0.1 and REDIS_HOST, an address of the namespace that
#                      other namespaces reach, and the ready checks run inside it
set -euo pipefail
run=${UCM_RUN_DIR:-/tmp/ucm-backends/run}
port=${REDIS_PORT:-6390}
password=${REDIS_PASSWORD:-ucmtest-redis}
server=${REDIS_SERVER_BIN:-redis-server}
netns=${REDIS_NETNS:-}
host=${REDIS_HOST:-127.0.0.1}
in_ns=()
bind=127.0.0.1
if [ -n "$netns" ]; then
  ip netns list | awk '{print $1}' | grep -qx "$netns" || {
    echo "network namespace $netns does not exist: scripts/backends/netns.sh up $netns" >&2
    exit 1; }
  in_ns=(ip netns exec "$netns")
  [ "$host" = 127.0.0.1 ] || bind="127.0.0.1 $host"
elif [ "$host" != 127.0.0.1 ]; then
  echo "REDIS_HOST=$host needs REDIS_NETNS: outside a namespace of our own, bind 127.0.0.1 only" >&2
  exit 2
fi
command -v "$server" >/dev/null || {
  echo "redis-server not found: bash scripts/backends/install.sh redis" >&2; exit 1; }
command -v redis-cli >/dev/null || {
  echo "redis-cli not found: bash scripts/backends/install.sh redis" >&2; exit 1; }
dir=$run/redis-$port
pid_file=$run/redis-$port.pid
log=$run/redis-$port.log
conf=$run/redis-$port.conf
mkdir -p "$dir"
if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
  echo "redis already running on port $port (pid $(cat "$pid_file")); stop it first" >&2; exit 1
fi
rm -f "$dir"/*.rdb "$dir"/*.aof
# The config file keeps the password off the command line (ps shows arguments).
(umask 077; cat >"$conf" <<CONF
bind $bind
port $port
protected-mode yes
requirepass "$password"
daemonize no
dir $dir
logfile $log
save ""
appendonly no
maxmemory ${REDIS_MAXMEMORY:-0}
maxmemory-policy noeviction
CONF
)
start=$(date +%s.%N)
setsid "${in_ns[@]}" "$server" "$conf" </dev/null >/dev/null 2>&1 &
echo $! >"$pid_file"
cli() { REDISCLI_AUTH=$password "${in_ns[@]}" redis-cli -h "$host" -p "$port" "$@" 2>/dev/null || true; }
answer=""
for _ in $(seq 1 100); do
  # Ready when the server answering on the port is this one (not another on the same port).
  answer=$(cli info server | tr -d '\r' | sed -n 's/^process_id://p')
  [ "$answer" = "$(cat "$pid_file")" ] && break
  if ! kill -0 "$(cat "$pid_file")" 2>/dev/null; then
    echo "redis-server exited during start; last log lines:" >&2; tail -20 "$log" >&2; exit 1
  fi
  sleep 0.1
done
if [ "$answer" != "$(cat "$pid_file")" ]; then
  echo "redis-server not ready after 10 s (answered by pid '$answer'); last log lines:" >&2
  tail -20 "$log" >&2; exit 1
fi
# The password must be enforced: a PING without it has to be refused.
anon=$("${in_ns[@]}" redis-cli -h "$host" -p "$port" ping 2>&1 || true)
if [ "$anon" = PONG ]; then echo "redis-server accepts clients without a password" >&2; exit 1; fi
echo "# redis-server pid $(cat "$pid_file") ready in $(echo "$(date +%s.%N) - $start" | bc) s; log $log"
echo "REDIS_URL=redis://$host:$port/0${netns:+ REDIS_NETNS=$netns} REDIS_PID=$(cat "$pid_file")"
