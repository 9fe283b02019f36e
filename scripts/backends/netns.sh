#!/usr/bin/env bash
# Private network namespaces for the Mooncake and NFS tests (root, iproute2).
#   netns.sh up NAME              create it (idempotent) with only `lo`, brought up
#   netns.sh veth NAME PEER A B   join NAME and PEER (both made if missing) by a veth pair;
#                                 NAME gets address A, PEER gets B (/24, e.g. 10.77.0.1/.2)
#   netns.sh down NAME            delete it (its processes must be gone)
# Nothing here touches the host's own namespace: traffic stays inside namespaces we made.
set -euo pipefail
cmd=${1:-}; ns=${2:-}
[ -n "$ns" ] || { echo "usage: $0 up|veth|down NAME ..." >&2; exit 2; }
exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }
case "$cmd" in
  up)
    exists "$ns" || ip netns add "$ns"
    ip -n "$ns" link set lo up ;;
  veth)
    peer=$3; a=$4; b=$5
    exists "$ns" || { ip netns add "$ns"; ip -n "$ns" link set lo up; }
    exists "$peer" || { ip netns add "$peer"; ip -n "$peer" link set lo up; }
    ip -n "$ns" link show "v-$peer" >/dev/null 2>&1 || \
      ip link add "v-$peer" netns "$ns" type veth peer name "v-$ns" netns "$peer"
    ip -n "$ns" addr replace "$a/24" dev "v-$peer"; ip -n "$ns" link set "v-$peer" up
    ip -n "$peer" addr replace "$b/24" dev "v-$ns"; ip -n "$peer" link set "v-$ns" up ;;
  down)
    exists "$ns" && ip netns del "$ns"; true ;;
  *) echo "usage: $0 up|veth|down NAME ..." >&2; exit 2 ;;
esac
