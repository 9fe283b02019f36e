#!/usr/bin/env bash
# Private network namespaces for the Mooncake and NFS tests (root, iproute2).
#   netns.sh up NAME              create it (idempotent) with only `lo`, brought up
#   netns.sh veth NAME PEER A B   join NAME and PEER (both made if missing) by a veth pair;
#                                 NAME gets address A, PEER gets B (/24, e.g. 10.77.0.1/.2)
#   netns.sh lan NAME A PEER B [PEER B]...
#                                 one private LAN: a bridge `br0` in NAME with address A, and
#                                 each PEER (made if missing) joined to it by a veth pair with
#                                 address B (/24). Peers reach NAME and each other directly
#                                 (bridged in NAME, no routing): what peer-to-peer clients need
#   netns.sh down NAME            delete it (its processes must be gone)
# Nothing here touches the host's own namespace: traffic stays inside namespaces we made.
set -euo pipefail
cmd=${1:-}; ns=${2:-}
usage() { echo "usage: $0 up|veth|lan|down NAME ..." >&2; exit 2; }
[ -n "$ns" ] || usage
exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }
ensure() { exists "$1" || ip netns add "$1"; ip -n "$1" link set lo up; }
case "$cmd" in
  up)
    ensure "$ns" ;;
  veth)
    [ $# -eq 5 ] || usage
    peer=$3; a=$4; b=$5
    ensure "$ns"; ensure "$peer"
    ip -n "$ns" link show "v-$peer" >/dev/null 2>&1 || \
      ip link add "v-$peer" netns "$ns" type veth peer name "v-$ns" netns "$peer"
    ip -n "$ns" addr replace "$a/24" dev "v-$peer"; ip -n "$ns" link set "v-$peer" up
    ip -n "$peer" addr replace "$b/24" dev "v-$ns"; ip -n "$peer" link set "v-$ns" up ;;
  lan)
    [ $# -ge 5 ] && [ $(($# % 2)) -eq 1 ] || usage
    a=$3; shift 3
    ensure "$ns"
    ip -n "$ns" link show br0 >/dev/null 2>&1 || ip -n "$ns" link add br0 type bridge
    ip -n "$ns" addr replace "$a/24" dev br0; ip -n "$ns" link set br0 up
    while [ $# -gt 0 ]; do
      peer=$1; b=$2; shift 2
      ensure "$peer"
      ip -n "$ns" link show "v-$peer" >/dev/null 2>&1 || \
        ip link add "v-$peer" netns "$ns" type veth peer name "v-$ns" netns "$peer"
      ip -n "$ns" link set "v-$peer" master br0 up
      ip -n "$peer" addr replace "$b/24" dev "v-$ns"; ip -n "$peer" link set "v-$ns" up
    done ;;
  down)
    exists "$ns" && ip netns del "$ns"; true ;;
  *) usage ;;
esac
