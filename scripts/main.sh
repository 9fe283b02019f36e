#!/usr/bin/env bash
# The README's main job: installs ucm and vLLM (CPU), then runs `ucm demo` on the embedded
# default config: a cold vLLM engine stores a chat workload's KV, a fresh one loads it back.
# It prints how long the install (or, once installed, its check) and the demo took.
set -euo pipefail
cd "$(dirname "$0")/.."
now() { date +%s.%N; }
since() { awk -v t0="$1" -v t1="$(now)" 'BEGIN { printf "%.1f s", t1 - t0 }'; }
start=$(now)
if [ -x .venv/bin/ucm ]; then what=".venv was there: checked, what changed installed"; else
    what="the first install"; fi
UCM_EXTRAS="dev,vllm" bash scripts/setup.sh
echo "[main] setup took $(since "$start") ($what)"
demo_start=$(now)
status=0
.venv/bin/ucm demo "$@" || status=$?
echo "[main] ucm demo took $(since "$demo_start") (exit status $status); main.sh took" \
     "$(since "$start") in all"
exit "$status"
