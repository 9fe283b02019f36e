#!/usr/bin/env bash
# Hosts that look like a cluster (root, iproute2): N host namespaces and one storage namespace
# on one private bridged LAN, every link shaped by tc in both directions.
#
#   cluster.sh up N [--link RATE:DELAY]   build (idempotent: again reshapes, drops hosts > N)
#                                         RATE:DELAY e.g. 10gbit:0.1ms (default), 1gbit:0.5ms
#   cluster.sh shape HOST RATE:DELAY      reshape one host's link (HOST: 1..N)
#   cluster.sh cut HOST | heal HOST       pull / plug HOST's cable at the switch (its bridge
#                                         port goes down: packets to and from it vanish)
#   cluster.sh servers start|stop [mooncake,s3,nfs,redis]
#                                         the project's start_*/stop_* scripts, run in the
#                                         storage namespace on ports of the cluster's own;
#                                         start prints the settings hosts use (shell lines)
#   cluster.sh exec HOST CMD...           run CMD in HOST's namespace (HOST 0: storage)
#   cluster.sh status                     namespaces, addresses, qdiscs, servers
#   cluster.sh down                       stop the servers, end what still runs in the
#                                         namespaces (TERM, then KILL), delete them
#
# Layout (CLUSTER_PREFIX ucmc, CLUSTER_NET 10.88.0): namespace $P-s holds the bridge br0 at
# $NET.1 and the storage servers; host i is namespace $P-h$i at $NET.$((10+i)), joined to br0
# by a veth pair (netns.sh lan). A host's own end, v-$P-s, shapes what it sends; the bridge's
# end, v-$P-h$i, shapes what it receives; traffic between two hosts crosses both hosts' links,
# as through a switch. Shaping is tbf (rate) with a netem child (delay); a kernel without
# sch_netem gets the rate only, and `up` says so on stderr. Nothing touches the host's own
# network namespace.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
P=${CLUSTER_PREFIX:-ucmc}
NET=${CLUSTER_NET:-10.88.0}
RUN=${CLUSTER_RUN_DIR:-/tmp/ucm-backends/cluster-$P}
STORAGE=$P-s
# Interface names are v-$P-h<i>, at most 15 characters for up to 200 hosts.
[[ $P =~ ^[a-z][a-z0-9]{0,7}$ ]] || {
  echo "CLUSTER_PREFIX '$P': 1 to 8 lower-case letters and digits, a letter first" >&2; exit 2; }
SERVER_ADDR=$NET.1
# Ports of the cluster's own, so that it runs beside the test suite's servers.
export MC_RPC_PORT=${MC_RPC_PORT:-50451} MC_META_PORT=${MC_META_PORT:-8481}
export MC_METRICS_PORT=${MC_METRICS_PORT:-9451}
export S3_PORT=${S3_PORT:-8453} WEED_PORT_BASE=${WEED_PORT_BASE:-9453}
export S3_ACCESS_KEY=${S3_ACCESS_KEY:-ucmtest} S3_SECRET_KEY=${S3_SECRET_KEY:-ucmtest-secret}
export S3_BUCKET=${S3_BUCKET:-ucm}
export NFS_PORT=${NFS_PORT:-20450} REDIS_PORT=${REDIS_PORT:-6450}
export REDIS_PASSWORD=${REDIS_PASSWORD:-ucmtest-redis}
export UCM_RUN_DIR=$RUN/run UCM_DATA_DIR=$RUN/data

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
          exit 2; }
exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }
host_ns() { echo "$P-h$1"; }
host_addr() { echo "$NET.$((10 + $1))"; }
hosts() { ip netns list | awk '{print $1}' | sed -n "s/^$P-h\([0-9][0-9]*\)\$/\1/p" | sort -n; }

# RATE:DELAY -> tbf and netem on one device of one namespace (replacing what was there).
has_netem=
shape_dev() {
  local ns=$1 dev=$2 rate=${3%%:*} delay=${3#*:} bits burst
  [[ $3 == *:* && -n $rate && -n $delay ]] || { echo "--link wants RATE:DELAY, got '$3'" >&2
                                                exit 2; }
  bits=$(tc_rate_bits "$rate")
  # One millisecond at the rate, at least 64 KiB: a TSO/GSO burst passes whole.
  burst=$(( bits / 8 / 1000 )); [ "$burst" -ge 65536 ] || burst=65536
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  tc -n "$ns" qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst "$burst" latency 50ms
  if [ -z "$has_netem" ]; then
    if tc -n "$ns" qdisc add dev "$dev" parent 1:1 handle 10: netem delay "$delay" \
         limit 100000 2>/dev/null; then has_netem=yes; else has_netem=no; fi
  elif [ "$has_netem" = yes ]; then
    tc -n "$ns" qdisc add dev "$dev" parent 1:1 handle 10: netem delay "$delay" limit 100000
  fi
}
tc_rate_bits() {  # 10gbit, 1gbit, 500mbit, 100kbit -> bits per second
  local n=${1%%[a-zA-Z]*} unit=${1##*[0-9.]}
  case "${unit,,}" in
    gbit) echo $(( n * 1000000000 ));; mbit) echo $(( n * 1000000 ));;
    kbit) echo $(( n * 1000 ));; bit|"") echo "$n";;
    *) echo "rate '$1': use bit, kbit, mbit or gbit" >&2; exit 2;;
  esac
}
shape_host() {  # both directions of host $1's link
  shape_dev "$(host_ns "$1")" "v-$STORAGE" "$2"
  shape_dev "$STORAGE" "v-$(host_ns "$1")" "$2"
  echo "$2" > "$RUN/link-h$1"
}
netem_note() {
  [ "$has_netem" = no ] && echo "cluster.sh: this kernel has no sch_netem (CONFIG_NET_SCH_NETEM):" \
    "links get the rate, not the delay" >&2
  true
}
need_host() {
  [[ ${1:-} =~ ^[0-9]+$ ]] && exists "$(host_ns "$1")" || {
    echo "no host '${1:-}' in cluster $P (hosts: $(hosts | tr '\n' ' '))" >&2; exit 2; }
}

servers() {
  local what=$1 list=${2:-mooncake,s3,nfs,redis} s
  mkdir -p "$UCM_RUN_DIR" "$UCM_DATA_DIR"
  for s in ${list//,/ }; do
    case "$s" in
      mooncake)
        if [ "$what" = start ]; then
          MC_NETNS=$STORAGE MC_HOST=$SERVER_ADDR MC_SEGMENT_SIZE=${MC_SEGMENT_SIZE:-0} \
            bash "$here/start_mooncake.sh"
        else bash "$here/stop_mooncake.sh"; fi ;;
      s3)
        if [ "$what" = start ]; then
          WEED_NETNS=$STORAGE bash "$here/start_seaweedfs.sh" | sed "s|//127.0.0.1:|//$SERVER_ADDR:|"
        else WEED_WIPE=1 bash "$here/stop_seaweedfs.sh"; fi ;;
      nfs)
        if [ "$what" = start ]; then
          NFS_NETNS=$STORAGE NFS_HOST=$SERVER_ADDR NFS_EXPORT_DIR=$UCM_DATA_DIR/nfs_export \
            bash "$here/start_nfs.sh"
        else bash "$here/stop_nfs.sh"; fi ;;
      redis)
        if [ "$what" = start ]; then
          REDIS_NETNS=$STORAGE REDIS_HOST=$SERVER_ADDR bash "$here/start_redis.sh"
        else bash "$here/stop_redis.sh"; fi ;;
      *) echo "unknown server '$s': mooncake, s3, nfs or redis" >&2; exit 2 ;;
    esac
  done
}

cmd=${1:-}; shift || true
case "$cmd" in
  up)
    n=${1:-}; shift || true
    [[ $n =~ ^[1-9][0-9]*$ ]] && [ "$n" -le 200 ] || { echo "up wants N hosts (1..200)" >&2
                                                       exit 2; }
    link=10gbit:0.1ms
    while [ $# -gt 0 ]; do
      case "$1" in --link) link=${2:-}; shift 2 ;; *) usage ;; esac
    done
    [[ $link == *:* ]] || { echo "--link wants RATE:DELAY, got '$link'" >&2; exit 2; }
    mkdir -p "$RUN"
    for i in $(hosts); do  # a smaller cluster than last time: the extra hosts go
      [ "$i" -le "$n" ] || { ip netns pids "$(host_ns "$i")" | xargs -r kill -KILL
                             ip netns del "$(host_ns "$i")"; rm -f "$RUN/link-h$i"; }
    done
    peers=()
    for i in $(seq 1 "$n"); do peers+=("$(host_ns "$i")" "$(host_addr "$i")"); done
    bash "$here/netns.sh" lan "$STORAGE" "$SERVER_ADDR" "${peers[@]}"
    for i in $(seq 1 "$n"); do shape_host "$i" "$link"; done
    netem_note
    echo "# cluster $P: storage $STORAGE at $SERVER_ADDR; hosts" \
         "$(for i in $(seq 1 "$n"); do printf '%s=%s ' "$(host_ns "$i")" "$(host_addr "$i")"; done)" \
         "links $link"
    echo "CLUSTER_STORAGE=$STORAGE CLUSTER_SERVER=$SERVER_ADDR" ;;
  shape)
    need_host "${1:-}"; [ $# -eq 2 ] || usage
    shape_host "$1" "$2"; netem_note ;;
  cut|heal)
    need_host "${1:-}"
    ip -n "$STORAGE" link set "v-$(host_ns "$1")" "$([ "$cmd" = cut ] && echo down || echo up)"
    if [ "$cmd" = heal ]; then  # the bridge port forwards again once its carrier is back
      for _ in $(seq 1 50); do
        ip -n "$(host_ns "$1")" -br link show "v-$STORAGE" | grep -q ' UP ' && break
        sleep 0.05
      done
    fi ;;
  servers)
    [ "${1:-}" = start ] || [ "${1:-}" = stop ] || usage
    [ "$1" = stop ] || exists "$STORAGE" || { echo "no cluster $P: cluster.sh up N first" >&2
                                              exit 1; }
    servers "$@" ;;
  exec)
    [ "${1:-}" = 0 ] && { shift; exec ip netns exec "$STORAGE" "$@"; }
    need_host "${1:-}"; ns=$(host_ns "$1"); shift
    exec ip netns exec "$ns" "$@" ;;
  status)
    for ns in "$STORAGE" $(for i in $(hosts); do host_ns "$i"; done); do
      exists "$ns" || continue
      echo "== $ns"; ip -n "$ns" -br addr show | grep -v '^lo'
      tc -n "$ns" qdisc show | grep -v noqueue || true
    done
    for f in "$UCM_RUN_DIR"/*.pid "$UCM_RUN_DIR"/*/*.pid; do
      [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && echo "running: $f pid $(cat "$f")"
    done; true ;;
  down)
    for s in mooncake s3 nfs redis; do  # at once: each may wait out its server's TERM
      servers stop "$s" >/dev/null 2>&1 &
    done
    wait
    for ns in $(for i in $(hosts); do host_ns "$i"; done) "$STORAGE"; do
      exists "$ns" || continue
      pids=$(ip netns pids "$ns" | tr '\n' ' ')
      if [ -n "${pids// /}" ]; then
        echo "# ending what still runs in $ns: $pids" >&2
        kill -TERM $pids 2>/dev/null || true
        for _ in $(seq 1 50); do [ -z "$(ip netns pids "$ns")" ] && break; sleep 0.1; done
        ip netns pids "$ns" | xargs -r kill -KILL 2>/dev/null || true
      fi
      bash "$here/netns.sh" down "$ns"
    done
    rm -rf "$RUN" ;;
  *) usage ;;
esac
