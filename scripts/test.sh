#!/usr/bin/env bash
# The README's test command: installs what the suite needs, then runs ruff and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
UCM_EXTRAS="dev,torch,trace,vllm" bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
