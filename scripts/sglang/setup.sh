#!/usr/bin/env bash
# Creates .venv-sglang (a venv of its own: SGLang 0.5.19 pins a transformers the vLLM venv
# does not have) with SGLang 0.5.19 for the CPU and ucm installed editable into it. Safe to run
# again: a stamp file makes it a no-op once done.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${UCM_SGLANG_VENV:-.venv-sglang}
here=scripts/sglang
stamp="$venv/.ucm-sglang-installed"
if [ -f "$stamp" ] && [ ! "$here/setup.sh" -nt "$stamp" ] && [ ! "$here/patch_sglang.py" -nt "$stamp" ] &&
        [ ! pyproject.toml -nt "$stamp" ]; then
    exit 0
fi
echo "[sglang] building $venv (SGLang 0.5.19 on the CPU)"
[ -x "$venv/bin/python" ] || python3.11 -m venv "$venv"
pip=("$venv/bin/pip" install --quiet)
"${pip[@]}" --upgrade pip
# SGLang 0.5.19 pins torch 2.13.0: the CPU build is among the local wheels.
"${pip[@]}" "torch==2.13.0+cpu"
# --no-deps: SGLang's own requirements name CUDA packages (flashinfer, sglang-kernel, ...)
# that have no CPU build; what the CPU path imports is listed by hand below.
"${pip[@]}" --no-deps "sglang==0.5.19" "torchvision==0.28.*"
"${pip[@]}" numpy aiohttp fastapi "uvicorn>=0.30" uvloop orjson "pyzmq>=25.1.2" msgspec pybase64 \
    psutil setproctitle requests pydantic "transformers==5.12.1" tokenizers sentencepiece tiktoken \
    "xgrammar==0.2.1" interegular partial_json_parser python-multipart "prometheus-client>=0.20.0" \
    einops packaging pillow scipy tqdm "openai==2.6.1" "openai-harmony==0.0.4" \
    "llguidance<2.0.0,>=1.7.6" xxhash zstandard IPython "blobfile==3.0.0" gguf distro watchfiles \
    easydict "compressed-tensors==0.18.0" triton ninja datasets jsonschema "soundfile==0.13.1" \
    safetensors
# ucm itself, editable, with its light dependencies only (no vLLM, no torch pin of its own).
"${pip[@]}" trio msgpack zstandard numpy xxhash pyyaml pydantic rich
"${pip[@]}" --no-deps -e .
site=$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
# sgl_kernel has no CPU build on the registry: a pure-torch stand-in, found through a .pth.
echo "$PWD/$here/stub" > "$site/ucm_sgl_kernel_stub.pth"
"$venv/bin/python" "$here/patch_sglang.py"
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c \
    "import sglang, sgl_kernel, ucm.sglang_hook; from sglang.srt.entrypoints.engine import Engine"
touch "$stamp"
echo "[sglang] $venv ready"
