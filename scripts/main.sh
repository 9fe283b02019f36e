#!/usr/bin/env bash
# The README's main job: installs ucm and vLLM (CPU), then runs `ucm demo` on the embedded
# default config: a cold vLLM engine stores a chat workload's KV, a fresh one loads it back.
set -euo pipefail
cd "$(dirname "$0")/.."
UCM_EXTRAS="dev,vllm" bash scripts/setup.sh
exec .venv/bin/ucm demo "$@"
