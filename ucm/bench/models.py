"""Tiny Llama-style models with random weights and a locally trained tokenizer, built on disk
in seconds, for the demo, the benchmarks and the vLLM tests (no model hub).

    path = build_model("/tmp/m", ModelSpec(layers=2, hidden=128))

Weights are written straight to safetensors (no transformers model is instantiated, so an
8-layer, 1024-wide model takes seconds). The same spec and seed give the same bytes.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_WORD_TEXT = (
    "the a of to and in is it that for on with as was at by this be from or an are not have "
    "cache block key value storage load store prefix tier memory disk request token model "
    "layer attention prompt chat user assistant document section report summary question "
    "answer system engine worker scheduler kernel driver event trace hit miss latency fast "
    "slow data page file write read copy shared long short first second third next last time"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class ModelSpec:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int | None = None
    vocab: int = 2048
    max_positions: int = 4096
    dtype: str = "float32"
    seed: int = 0
    # Hybrid attention (Gemma-3-like): per layer "sliding_attention" or "full_attention",
    # vLLM's Llama reading `layer_types` and `sliding_window` from the config; None: all full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # "llama"; "gpt_oss": gpt-oss's architecture (attention sinks, biases, a small MoE of
    # `experts`, sliding and full layers alternating; `sliding_window` required);
    # "deepseek_v2": DeepSeek-V2-Lite's latent attention (MLA), dense MLPs
    family: str = "llama"
    experts: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        size = 2 if (dtype or self.dtype) in ("bfloat16", "float16") else 4
        return 2 * self.layers * self.kv_heads * self.head_dim * size


def sample_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _train_tokenizer(out: Path, vocab: int, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [sample_text(200, seed) for seed in range(50)] + [" ".join(WORDS)] * 10
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", model_max_length=max_len)
    hf.save_pretrained(str(out))


def build_model(path: str | os.PathLike, spec: ModelSpec | None = None) -> Path:
    """Writes config, tokenizer and random weights into `path` (reused if already built)."""
    import torch
    from safetensors.torch import save_file

    spec = spec or ModelSpec()
    out = Path(path)
    stamp = out / "ucm-model-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(asdict(spec))):
        return out
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out, spec.vocab, spec.max_positions)
    inter = spec.intermediate or spec.hidden * 2
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": inter,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "torch_dtype": spec.dtype, "initializer_range": 0.02,
    }
    if spec.layer_types is not None:
        if len(spec.layer_types) != spec.layers or spec.sliding_window is None:
            raise ValueError("layer_types needs one entry per layer and a sliding_window")
        config.update(layer_types=list(spec.layer_types), sliding_window=spec.sliding_window)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int) -> torch.Tensor:
        # Larger than the usual init so a random model's greedy output depends on its input.
        scale = 2.0 / shape[-1] ** 0.5
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    if spec.family in ("gpt_oss", "deepseek_v2"):
        config, weights = (_gpt_oss if spec.family == "gpt_oss" else _deepseek_v2)(
            spec, config, rand)
        (out / "config.json").write_text(json.dumps(config, indent=1))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        stamp.write_text(json.dumps(asdict(spec)))
        return out
    if spec.family != "llama":
        raise ValueError(f"unknown model family {spec.family!r}")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    weights = _outer_weights(spec, rand)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        })
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(json.dumps(asdict(spec)))
    return out


def _outer_weights(spec: ModelSpec, rand: Callable[..., Any]) -> dict[str, Any]:
    """The embedding, final norm and LM head that every family here has."""
    import torch

    h = spec.hidden
    return {"model.embed_tokens.weight": rand(spec.vocab, h),
            "model.norm.weight": torch.ones(h, dtype=getattr(torch, spec.dtype)),
            "lm_head.weight": rand(spec.vocab, h)}


def _gpt_oss(spec: ModelSpec, llama: dict[str, Any], rand: Callable[..., Any],
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """gpt-oss's config and weights (its checkpoint's names, unquantized experts) at `spec`'s
    size: attention with biases and a sink per head, sliding and full layers alternating,
    a mixture of `spec.experts` experts (two per token)."""
    import torch

    if spec.sliding_window is None:
        raise ValueError("a gpt_oss model needs a sliding_window")
    inter = spec.intermediate or spec.hidden
    config = {k: v for k, v in llama.items() if k not in ("rope_theta", "hidden_act")}
    config.update({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "intermediate_size": inter, "num_local_experts": spec.experts,
        "num_experts_per_tok": 2, "sliding_window": spec.sliding_window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(spec.layers)],
        "attention_bias": True, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                            "original_max_position_embeddings": spec.max_positions},
    })
    h, d = spec.hidden, spec.head_dim
    q, kv, e = spec.heads * d, spec.kv_heads * d, spec.experts
    weights = _outer_weights(spec, rand)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.q_proj.bias": rand(q),
            p + "self_attn.k_proj.weight": rand(kv, h), p + "self_attn.k_proj.bias": rand(kv),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.v_proj.bias": rand(kv),
            p + "self_attn.o_proj.weight": rand(h, q), p + "self_attn.o_proj.bias": rand(h),
            p + "self_attn.sinks": rand(spec.heads),
            p + "mlp.router.weight": rand(e, h), p + "mlp.router.bias": rand(e),
            p + "mlp.experts.gate_up_proj": rand(e, h, 2 * inter),
            p + "mlp.experts.gate_up_proj_bias": rand(e, 2 * inter),
            p + "mlp.experts.down_proj": rand(e, inter, h),
            p + "mlp.experts.down_proj_bias": rand(e, h),
            p + "input_layernorm.weight": torch.ones(h, dtype=getattr(torch, spec.dtype)),
            p + "post_attention_layernorm.weight": torch.ones(
                h, dtype=getattr(torch, spec.dtype)),
        })
    return config, weights


def _deepseek_v2(spec: ModelSpec, llama: dict[str, Any], rand: Callable[..., Any],
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSeek-V2-Lite's attention at `spec`'s size: latent attention (MLA, one 512 + 64
    latent vector per token in the cache), no query compression, dense MLPs (its experts
    start after the last layer)."""
    import torch

    lora, rope, nope, v = 512, 64, 128, 128
    config = dict(llama)
    config.update({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "num_key_value_heads": spec.heads, "q_lora_rank": None, "kv_lora_rank": lora,
        "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v,
        "head_dim": rope, "first_k_dense_replace": spec.layers, "n_routed_experts": spec.experts,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "moe_layer_freq": 1, "norm_topk_prob": False, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax", "aux_loss_alpha": 0.0, "seq_aux": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    })
    h, n = spec.hidden, spec.heads
    inter = spec.intermediate or h * 2
    ones = getattr(torch, spec.dtype)
    weights = _outer_weights(spec, rand)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(n * (nope + rope), h),
            p + "self_attn.kv_a_proj_with_mqa.weight": rand(lora + rope, h),
            p + "self_attn.kv_a_layernorm.weight": torch.ones(lora, dtype=ones),
            p + "self_attn.kv_b_proj.weight": rand(n * (nope + v), lora),
            p + "self_attn.o_proj.weight": rand(h, n * v),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=ones),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=ones),
        })
    return config, weights
