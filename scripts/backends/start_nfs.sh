#!/usr/bin/env bash
# Starts nfs-ganesha (NFSv4.1, VFS export) for the nfs driver's tests.
#   NFS_PORT        TCP port (default 2049), bound on 127.0.0.1 only
#   NFS_EXPORT_DIR  the exported directory (default $UCM_DATA_DIR/nfs_export-$NFS_PORT)
#   NFS_NETNS       run the server inside this network namespace (made by netns.sh); there
#                   it binds every address of the namespace, which a test wires up itself
# Ready means the log says "NFS SERVER INITIALIZED" and the port accepts a TCP connection.
# Prints NFS_URL=... for the nfs driver / nfs-rs; its other lines are shell comments, so
# eval "$(start_nfs.sh)" sets it. Pid and log: $UCM_RUN_DIR/ganesha-$NFS_PORT/.
set -euo pipefail
PORT=${NFS_PORT:-2049}
EXPORT=${NFS_EXPORT_DIR:-${UCM_DATA_DIR:-/tmp/ucm-backends/data}/nfs_export-$PORT}
NETNS=${NFS_NETNS:-}
DIR=${UCM_RUN_DIR:-/tmp/ucm-backends/run}/ganesha-$PORT
mkdir -p "$EXPORT" "$DIR/recovery"
if [ -f "$DIR/ganesha.pid" ] && kill -0 "$(cat "$DIR/ganesha.pid")" 2>/dev/null; then
  echo "nfs-ganesha already running (pid $(cat "$DIR/ganesha.pid")); stop_nfs.sh first" >&2
  exit 1
fi
BIND=127.0.0.1
# In a namespace, getaddrinfo(AI_ADDRCONFIG) may find no IPv4 for 127.0.0.1: bind all of
# the namespace's addresses instead (the namespace is the isolation).
[ -n "$NETNS" ] && BIND=0.0.0.0
sed -e "s|@EXPORT@|$EXPORT|" -e "s|@RECOVERY@|$DIR/recovery|" -e "s|@NFS_PORT@|$PORT|" \
    -e "s|@BIND_ADDR@|$BIND|" "$(dirname "$0")/ganesha.conf.in" > "$DIR/ganesha.conf"
: > "$DIR/ganesha.log"
EXEC=()
[ -n "$NETNS" ] && EXEC=(ip netns exec "$NETNS")
t0=$(date +%s.%N)
# -F: foreground (so $! is the server); the pid file is ganesha's own.
nohup "${EXEC[@]}" /usr/bin/ganesha.nfsd -F -f "$DIR/ganesha.conf" -L "$DIR/ganesha.log" \
  -p "$DIR/ganesha.own.pid" -N NIV_EVENT > "$DIR/stdout.log" 2>&1 &
echo $! > "$DIR/ganesha.pid"
fail() {
  echo "nfs-ganesha failed to start: $1" >&2
  grep -Ev "DBUS|dbus|krb5|KRB5" "$DIR/ganesha.log" | tail -20 >&2 || true
  tail -5 "$DIR/stdout.log" >&2 || true
  kill -KILL "$(cat "$DIR/ganesha.pid")" 2>/dev/null; rm -f "$DIR/ganesha.pid"
  exit 1
}
for _ in $(seq 1 200); do
  grep -q "NFS SERVER INITIALIZED" "$DIR/ganesha.log" 2>/dev/null && break
  kill -0 "$(cat "$DIR/ganesha.pid")" 2>/dev/null || fail "the process exited"
  sleep 0.05
done
grep -q "NFS SERVER INITIALIZED" "$DIR/ganesha.log" || fail "not initialized after 10 s"
HOST=127.0.0.1
[ -n "$NETNS" ] && HOST=${NFS_HOST:-127.0.0.1}
for _ in $(seq 1 100); do
  "${EXEC[@]}" bash -c "exec 3<>/dev/tcp/$HOST/$PORT" 2>/dev/null && break
  sleep 0.05
done
"${EXEC[@]}" bash -c "exec 3<>/dev/tcp/$HOST/$PORT" 2>/dev/null || fail "port $PORT closed"
echo "# nfs-ganesha pid $(cat "$DIR/ganesha.pid") ready in $(echo "$(date +%s.%N) - $t0" | bc)s"
echo "NFS_URL=nfs://$HOST:$PORT/export?version=4.1"
