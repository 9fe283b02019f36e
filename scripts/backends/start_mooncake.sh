#!/usr/bin/env bash
# Starts a Mooncake Store: the HTTP metadata server and mooncake_master (127.0.0.1 or MC_HOST).
#   MC_RPC_PORT (50051)  MC_META_PORT (8080)  MC_METRICS_PORT (9003)
#   MC_HOST (127.0.0.1) the address everything binds and advertises; another one only with
#              MC_NETNS, where it is an address of that namespace (netns.sh lan gives one that
#              clients in other namespaces reach)
#   MC_CLIENT_TTL (10 s: a crashed client's segment is dropped after this)
#   MC_LEASE_TTL_MS (10000: a read lease blocks removal this long)
#   MC_NETNS   run everything inside this network namespace (netns.sh up NAME); Mooncake
#              clients listen on all interfaces, so tests keep clients and servers in a
#              lo-only one
#   MC_SEGMENT_SIZE ("256 MB"; 0 = none) also start a segment holder (`mooncake_client`) that
#              lends this much RAM to the pool. Objects live in the segments of clients, so
#              without a long-lived holder a block vanishes when its writer exits. Its transfer
#              engine listens on all interfaces: it starts only inside MC_NETNS.
# Ready means the metadata server answers HTTP, the master's /health says OK and, with a
# holder, a store client inside the namespace can put, get and remove a probe object.
# Prints MC_MASTER=... MC_METADATA=...; its other lines are shell comments, so
# eval "$(start_mooncake.sh)" sets them. Pids and logs: $UCM_RUN_DIR/mooncake-$MC_RPC_PORT/.
# The master's built-in metadata server is not used: it binds 0.0.0.0 whatever it is told.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${UCM_VENV:-$repo/.venv}
rpc=${MC_RPC_PORT:-50051}; meta=${MC_META_PORT:-8080}; metrics=${MC_METRICS_PORT:-9003}
dir=${UCM_RUN_DIR:-/tmp/ucm-backends/run}/mooncake-$rpc
ns=${MC_NETNS:-}
host=${MC_HOST:-127.0.0.1}
[ -n "$ns" ] || [ "$host" = 127.0.0.1 ] || {
  echo "MC_HOST=$host needs MC_NETNS: outside a namespace of our own, bind 127.0.0.1 only" >&2
  exit 2; }
[ -x "$venv/bin/mooncake_master" ] || {
  echo "mooncake_master not found in $venv: pip install 'ucm[mooncake]'" >&2; exit 1; }
mkdir -p "$dir"
segment=${MC_SEGMENT_SIZE:-256 MB}
[ -z "$ns" ] && segment=0
for f in master meta holder; do
  if [ -f "$dir/$f.pid" ] && kill -0 "$(cat "$dir/$f.pid")" 2>/dev/null; then
    echo "mooncake $f already running (pid $(cat "$dir/$f.pid")); stop_mooncake.sh first" >&2
    exit 1
  fi
done
exec_in=()
[ -n "$ns" ] && exec_in=(ip netns exec "$ns")
t0=$(date +%s.%N)
nohup "${exec_in[@]}" "$venv/bin/python" "$venv/bin/mooncake_http_metadata_server" \
  --host "$host" --port "$meta" --log-level WARNING > "$dir/meta.log" 2>&1 &
echo $! > "$dir/meta.pid"
# The wrapper script execs the real binary, so $! is the master itself.
nohup "${exec_in[@]}" "$venv/bin/mooncake_master" --rpc_address="$host" --rpc_port="$rpc" \
  --metrics_host="$host" --metrics_port="$metrics" --rpc_thread_num=2 \
  --client_ttl="${MC_CLIENT_TTL:-10}" --default_kv_lease_ttl="${MC_LEASE_TTL_MS:-10000}" \
  > "$dir/master.log" 2>&1 &
echo $! > "$dir/master.pid"
fail() {
  echo "mooncake failed to start: $1" >&2
  echo "--- master.log" >&2; tail -20 "$dir/master.log" >&2 || true
  echo "--- meta.log" >&2; tail -20 "$dir/meta.log" >&2 || true
  for f in holder master meta; do  # leave nothing half-started behind
    [ -f "$dir/$f.pid" ] && kill -KILL "$(cat "$dir/$f.pid")" 2>/dev/null
    rm -f "$dir/$f.pid"
  done
  exit 1
}
http_ok() { "${exec_in[@]}" curl -sf -o /dev/null --max-time 1 "$1"; }
for _ in $(seq 1 200); do
  kill -0 "$(cat "$dir/master.pid")" 2>/dev/null || fail "mooncake_master exited"
  kill -0 "$(cat "$dir/meta.pid")" 2>/dev/null || fail "the metadata server exited"
  # The metadata server answers 404 for an unknown key: any HTTP answer means it serves.
  code=$("${exec_in[@]}" curl -s -o /dev/null -w '%{http_code}' --max-time 1 \
         "http://$host:$meta/metadata?key=ucm-ready-probe" || true)
  if [ "$code" != 000 ] && http_ok "http://$host:$metrics/health"; then
    break
  fi
  sleep 0.05
done
[ "$code" != 000 ] || fail "not ready after 10 s"
if [ "$segment" != 0 ]; then
  nohup ip netns exec "$ns" env MC_TCP_BIND_ADDRESS="$host" MC_LOG_LEVEL=ERROR \
    "$venv/bin/python" "$venv/bin/mooncake_client" --host="$host" \
    --global_segment_size="$segment" --master_server_address="$host:$rpc" \
    --metadata_server="http://$host:$meta/metadata" --port="${MC_HOLDER_PORT:-$((rpc + 1))}" \
    > "$dir/holder.log" 2>&1 &
  echo $! > "$dir/holder.pid"
  probe='
import os, sys, time
from mooncake.store import MooncakeDistributedStore
master, meta, host = sys.argv[1:4]
deadline = time.monotonic() + 15
s = MooncakeDistributedStore()
assert s.setup(host, meta, 0, 16 << 20, "tcp", "", master) == 0, "setup failed"
while time.monotonic() < deadline:
    if s.put("ucm-ready-probe", b"ok") == 0 and s.get("ucm-ready-probe") == b"ok":
        s.remove("ucm-ready-probe", True); s.close(); sys.exit(0)
    time.sleep(0.1)
sys.exit("the segment holder lent no memory within 15 s")'
  ip netns exec "$ns" env MC_TCP_BIND_ADDRESS="$host" MC_LOG_LEVEL=ERROR \
    "$venv/bin/python" -c "$probe" "$host:$rpc" "http://$host:$meta/metadata" "$host" \
    > "$dir/probe.log" 2>&1 || { cat "$dir/probe.log" >&2; echo "--- holder.log" >&2
                                 tail -20 "$dir/holder.log" >&2; fail "probe put/get failed"; }
fi
echo "# mooncake master pid $(cat "$dir/master.pid"), metadata pid $(cat "$dir/meta.pid")" \
     "${segment:+holder (${segment}) }ready in $(echo "$(date +%s.%N) - $t0" | bc)s${ns:+ (netns $ns)}"
echo "MC_MASTER=$host:$rpc MC_METADATA=http://$host:$meta/metadata"
