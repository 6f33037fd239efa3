"""Tiny random-weight Hugging Face checkpoints (llama, qwen2, qwen3) with a real trained BPE tokenizer.

Weights are written with numpy only, so the test process never imports ``mlx.core`` before the MLX
engine has interposed OpenBLAS. Each checkpoint carries the float64 weights and config
that the numpy reference forward pass in ``test_mlx.py`` needs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Float32 matrix products in float32 on CUDA, not TF32 (MLX's CUDA default): with TF32 a batched
# product rounds each row differently from a one-row one, enough to flip a seeded sample (measured on
# the H200: a seeded top-p row diverged at its 15th token; with TF32 off, logprobs within 2.4e-6 of
# the solo run's). Read at MLX's first matmul, so set before any test runs one. Serving precision is
# 16-bit, which TF32 does not touch.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Large language models predict the next token from the tokens before it.",
    "MLX evaluates arrays lazily; mx.eval forces the computation graph to run.",
    "Ünïcödé text, emoji 🙂 and numbers 12345 should round-trip through byte-level BPE.",
] * 20


@dataclass
class Checkpoint:
    path: Path
    config: dict
    weights: dict[str, np.ndarray]  # float64, HF names, exactly the values the file holds


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(folder: Path, tok: Tokenizer, eos_in_generation_config: list[int]) -> None:
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
    }))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_in_generation_config}))


def make_checkpoint(folder: Path, model_type: str, tok: Tokenizer, dtype=np.float32) -> Checkpoint:
    """A 2-layer model with GQA (4 query heads, 2 KV heads) and a head_dim of 16."""
    rng = np.random.default_rng(sum(map(ord, model_type)))
    vocab, hidden, inter, layers, heads, kv_heads, head_dim = tok.get_vocab_size(), 64, 96, 2, 4, 2, 16
    config = {
        "model_type": model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[model_type]],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rope_theta": {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 500000.0}[model_type],
        "tie_word_embeddings": model_type != "llama",
        "eos_token_id": tok.token_to_id("<|endoftext|>"),
        "torch_dtype": "float32" if dtype == np.float32 else "float16",
    }

    def w(*shape, scale=0.15):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    weights = {"model.embed_tokens.weight": w(vocab, hidden, scale=0.5),
               "model.norm.weight": (1 + w(hidden, scale=0.1))}
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + w(hidden, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + w(hidden, scale=0.1),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
        if model_type == "qwen2":
            for n, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                weights[p + f"self_attn.{n}_proj.bias"] = w(size * head_dim, scale=0.3)
        if model_type == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = 1 + w(head_dim, scale=0.2)
            weights[p + "self_attn.k_norm.weight"] = 1 + w(head_dim, scale=0.2)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    write_tokenizer(folder, tok, [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])
    return Checkpoint(folder, config, {k: v.astype(np.float64) for k, v in weights.items()})


@pytest.fixture(scope="session")
def tokenizer_obj() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer_obj) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("mlx-models")
    return {
        "llama": make_checkpoint(root / "llama", "llama", tokenizer_obj),
        "qwen2": make_checkpoint(root / "qwen2", "qwen2", tokenizer_obj),
        # float16 on disk: exercises the cast to float32 the engine does on CPU.
        "qwen3": make_checkpoint(root / "qwen3", "qwen3", tokenizer_obj, dtype=np.float16),
    }
