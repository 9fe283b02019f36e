#!/usr/bin/env bash
# The README's main job: installs ucm, then runs the benchmark on the embedded default config.
set -euo pipefail
cd "$(dirname "$0")/.."
UCM_EXTRAS="dev,vllm" bash scripts/setup.sh
exec .venv/bin/ucm bench "$@"
