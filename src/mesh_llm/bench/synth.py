"""Random-weight model pairs (an MLX folder and a GGUF with the same weights) of real model shapes.

Speed depends on shapes, not on weight values, so a random model of Qwen2.5-7B's shape benchmarks the
engines as the real one would, with nothing to download: the vocabulary and chat template are copied
from any GGUF that has them (llama.cpp's vocab-only ``models/ggml-vocab-*.gguf`` files in the
llama-cpp-python sdist, or the embedded SmolLM2 GGUF). Run it where the benchmark runs::

    python -m mesh_llm.bench.synth qwen2.5-7b OUT_DIR --vocab ggml-vocab-qwen2.gguf --dtype float16

``--quantize 4`` also writes ``<shape>-q4-mlx/``: the MLX folder's products quantized as mlx-lm's
``convert -q`` writes them (affine, groups of 64), served as a pre-quantized model is.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama" or "qwen2" (which adds q/k/v biases)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int
    rope_theta: float
    tied: bool


SHAPES = {
    "tiny": Shape("llama", 64, 2, 4, 2, 128, 4096, 10000.0, True),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 32768, 1000000.0, True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 32768, 1000000.0, False),
}


def write_pair(shape_name: str, out_dir: Path, vocab_gguf: Path, dtype: str = "float16",
               seed: int = 0) -> tuple[Path, Path]:
    """Write ``OUT_DIR/<shape>-mlx/`` and ``OUT_DIR/<shape>.gguf``; return both paths."""
    import gguf
    from safetensors.numpy import save_file

    from mesh_llm.models.gguf_tokenizer import build_tokenizer, eos_token_ids

    shape = SHAPES[shape_name]
    reader = gguf.GGUFReader(vocab_gguf)
    vocab = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    meta = {k: f.contents() for k, f in vocab.items()}
    n_vocab = len(meta["tokenizer.ggml.tokens"])
    weights = _weights(shape, n_vocab, np.dtype(dtype), seed)

    folder = out_dir / f"{shape_name}-mlx"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    text, tok_config = build_tokenizer(meta, shape.context)
    (folder / "tokenizer.json").write_text(text)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    eos = eos_token_ids(meta)
    (folder / "config.json").write_text(json.dumps(_hf_config(shape, n_vocab, dtype, eos), indent=1))

    path = out_dir / f"{shape_name}.gguf"
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"random {shape_name}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "float32" else gguf.LlamaFileType.MOSTLY_F16)
    for key, field in vocab.items():
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for name, array in _gguf_tensors(shape, weights):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder, path


def write_quantized(folder: Path, bits: int, group_size: int = 64) -> Path:
    """A copy of an MLX folder beside it (``<name>-q<bits>-mlx``) whose linear and embedding weights
    are quantized with MLX itself, with ``config["quantization"]`` saying so."""
    import shutil

    import mlx.core as mx

    out = folder.with_name(folder.name.removesuffix("-mlx") + f"-q{bits}-mlx")
    out.mkdir(parents=True, exist_ok=True)
    weights = {}
    for name, w in mx.load(str(folder / "model.safetensors")).items():
        if name.endswith("weight") and w.ndim == 2 and w.shape[-1] % group_size == 0 and "norm" not in name:
            stem = name.removesuffix("weight")
            weights[name], weights[stem + "scales"], weights[stem + "biases"] = mx.quantize(w, group_size, bits)
        else:
            weights[name] = w
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    return out


def _weights(shape: Shape, n_vocab: int, dtype: np.dtype, seed: int) -> dict[str, np.ndarray]:
    """Hugging Face-named tensors. Values come from one random pool, cycled: cheap for 7B shapes."""
    pool = (np.random.default_rng(seed).standard_normal(1 << 22, dtype=np.float32) * 0.02).astype(dtype)
    count = 0

    def rand(*dims: int) -> np.ndarray:
        nonlocal count
        count += 1
        return np.resize(np.roll(pool, count * 7919), dims)

    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    w = {"model.embed_tokens.weight": rand(n_vocab, shape.hidden),
         "model.norm.weight": np.ones(shape.hidden, dtype)}
    if not shape.tied:
        w["lm_head.weight"] = rand(n_vocab, shape.hidden)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(shape.hidden, dtype)
        w[p + "post_attention_layernorm.weight"] = np.ones(shape.hidden, dtype)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = rand(rows, shape.hidden)
            if shape.arch == "qwen2":
                w[p + f"self_attn.{name}_proj.bias"] = rand(rows)
        w[p + "self_attn.o_proj.weight"] = rand(shape.hidden, q)
        w[p + "mlp.gate_proj.weight"] = rand(shape.ffn, shape.hidden)
        w[p + "mlp.up_proj.weight"] = rand(shape.ffn, shape.hidden)
        w[p + "mlp.down_proj.weight"] = rand(shape.hidden, shape.ffn)
    return w


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_tensors(shape: Shape, weights: dict[str, np.ndarray]):
    """The same tensors under llama.cpp's names; norms in float32, as llama.cpp expects them; llama's
    Q and K rows permuted to llama.cpp's rotary layout (qwen2 GGUFs keep Hugging Face's)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, array in weights.items():
        if name in top:
            gguf_name = top[name]
        else:
            _, _, i, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{i}.{_GGUF_NAMES[module]}.{kind}"
            if shape.arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = shape.heads if module.endswith("q_proj") else shape.kv_heads
                array = _permute(array, heads)
        yield gguf_name, array.astype(np.float32) if array.ndim == 1 or "norm" in gguf_name else array


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(shape: Shape, n_vocab: int, dtype: str, eos: list[int]) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM" if shape.arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": shape.arch, "hidden_size": shape.hidden, "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.hidden // shape.heads,
        "max_position_embeddings": shape.context, "rms_norm_eps": 1e-6, "rope_theta": shape.rope_theta,
        "vocab_size": n_vocab, "tie_word_embeddings": shape.tied, "torch_dtype": dtype,
        "eos_token_id": eos, "hidden_act": "silu",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab", type=Path, required=True, help="a GGUF with tokenizer.* metadata")
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--quantize", type=int, choices=[4, 8], help="also a quantized copy of the MLX folder")
    args = parser.parse_args()
    folder = args.out_dir / f"{args.shape}-mlx"
    gguf_path = args.out_dir / f"{args.shape}.gguf"
    if not (folder / "model.safetensors").exists() or not gguf_path.exists():
        folder, gguf_path = write_pair(args.shape, args.out_dir, args.vocab, args.dtype)
    print(f"--model-pair {folder},{gguf_path}")
    if args.quantize:
        print(f"--model-pair {write_quantized(folder, args.quantize)},{gguf_path}")


if __name__ == "__main__":
    main()
