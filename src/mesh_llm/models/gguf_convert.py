"""GGUF -> MLX: the config, weights and tokenizer an mlx-lm model needs, from one GGUF file.

Used by ``mesh-llm models import-gguf`` (which writes a plain MLX folder) and by the MLX engine
(which loads a GGUF directly). ``gguf``'s reader validates the file and says what each tensor is;
``mx.load`` reads the tensors, already in MLX's affine quantized form for Q4_0/Q4_1/Q8_0. Only the
architectures mlx-lm runs exactly as llama.cpp does are accepted; anything else is refused with a
pointer to the llama engine rather than served wrongly.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from mesh_llm.models.gguf_tokenizer import build_tokenizer, eos_token_ids
from mesh_llm.system.blas import ensure_fast_blas

ensure_fast_blas()  # before mlx.core's first import, or MLX in this process keeps the slow reference BLAS
import mlx.core as mx

Progress = Callable[[int, int], None]

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter permutes Q/K rows for its rotary layout only for llama (see
# conversion/llama.py, LlamaModel.permute); qwen2/qwen3 keep Hugging Face's order.
_PERMUTED_QK = {"llama"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_QUANTIZED = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
_FLOATS = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class GGUFConvertError(Exception):
    """A GGUF file cannot be turned into an MLX model; the message names the file and the problem."""


@dataclass
class GGUFModel:
    config: dict  # HF-style config.json content (with mlx-lm's "quantization" block when quantized)
    weights: dict[str, mx.array]  # mlx-lm parameter names, Q/K rows in Hugging Face order
    tokenizer_json: str
    tokenizer_config: dict


def read_gguf(path: Path, dtype: str | None = None, progress: Progress | None = None) -> GGUFModel:
    """Read a llama/qwen2/qwen3 GGUF. ``dtype`` None keeps Q4_0/Q4_1/Q8_0 tensors quantized (and
    float tensors as stored); "float32", "bfloat16" or "float16" dequantizes and casts everything."""
    path = Path(path)
    if dtype is not None and dtype not in _DTYPES:
        raise GGUFConvertError(f"{path}: unknown dtype {dtype!r} (use one of {', '.join(_DTYPES)})")
    reader = _open(path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch not in _HF_CLASSES:
        raise GGUFConvertError(
            f"{path}: architecture {arch!r} is not supported by the MLX engine "
            f"(only {', '.join(_HF_CLASSES)}); use the llama engine"
        )
    tensors = {t.name: t for t in reader.tensors}
    names = _check_tensors(path, arch, tensors)
    try:
        config = _config(arch, meta, tensors)
        tokenizer_json, tokenizer_config = build_tokenizer(meta, config["max_position_embeddings"])
    except (KeyError, ValueError, TypeError) as e:
        raise GGUFConvertError(f"{path}: {_first_line(e)}") from e
    try:
        loaded = mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise GGUFConvertError(f"{path}: cannot read tensors ({_first_line(e)})") from e

    weights: dict[str, mx.array] = {}
    quantized: dict[str, tuple[int, int]] = {}  # module -> (group_size, bits)
    floats: list[str] = []  # 2-D float weights mlx-lm could otherwise take for quantized
    for done, (gguf_name, hf_name) in enumerate(names.items(), 1):
        tensor, module = tensors[gguf_name], hf_name.rsplit(".", 1)[0]
        arrays = _arrays(loaded, tensor)
        if arch in _PERMUTED_QK and module.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"]
            arrays = [_unpermute(a, heads) for a in arrays]
        if tensor.tensor_type in _QUANTIZED and dtype is None:
            quantized[module] = _group_size_and_bits(tensor, arrays)
            converted = dict(zip((hf_name, f"{module}.scales", f"{module}.biases"), arrays))
        else:
            if tensor.tensor_type in _QUANTIZED:
                w, scales, biases = arrays
                group_size, bits = _group_size_and_bits(tensor, arrays)
                f32 = mx.float32
                arrays = [mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits)]
            elif len(tensor.shape) == 2:
                floats.append(module)
            converted = {hf_name: arrays[0].astype(_DTYPES[dtype]) if dtype else arrays[0]}
        mx.eval(converted)  # one tensor at a time, so its source can be freed before the next
        weights.update(converted)
        if progress:
            progress(done, len(names))
    if quantized:
        config["quantization"] = _quantization_block(quantized, floats)
    return GGUFModel(config, weights, tokenizer_json, tokenizer_config)


def import_gguf(src: Path, out_dir: Path, dtype: str | None = None, progress: Progress | None = None) -> Path:
    """Write a standard MLX model folder that plain ``mlx_lm.load`` opens. It is built in a hidden
    sibling folder and renamed into place, so ``out_dir`` either appears complete or not at all."""
    src, out_dir = Path(src), Path(out_dir)
    if out_dir.exists():
        raise GGUFConvertError(f"{out_dir}: already exists")
    temp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        temp.mkdir(parents=True)
        total = None

        def tensor_progress(done: int, count: int) -> None:
            nonlocal total
            total = count + 1  # the last step is writing the safetensors file
            if progress:
                progress(done, total)

        model = read_gguf(src, dtype, tensor_progress)
        config = dict(model.config)
        if "quantization" in config:
            config["quantization_config"] = config["quantization"]  # what mlx_lm.convert writes too
        mx.save_safetensors(str(temp / "model.safetensors"), model.weights, metadata={"format": "mlx"})
        _write_json(temp / "config.json", config)
        _write_json(temp / "tokenizer_config.json", model.tokenizer_config)
        (temp / "tokenizer.json").write_text(model.tokenizer_json, encoding="utf-8")
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        _write_json(temp / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
        if progress and total:
            progress(total, total)
        os.rename(temp, out_dir)
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        raise GGUFConvertError(f"{out_dir}: cannot write the MLX folder ({_first_line(e)})") from e
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out_dir


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise GGUFConvertError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFConvertError(f"{path}: cannot read ({_first_line(e)})") from e
    if magic != b"GGUF":
        raise GGUFConvertError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader fails on a short file with IndexError, ValueError, ...
        raise GGUFConvertError(f"{path}: truncated or corrupt GGUF file ({_first_line(e)})") from e


def _check_tensors(path: Path, arch: str, tensors: dict) -> dict[str, str]:
    """GGUF tensor name -> mlx-lm parameter name, refusing types and tensors MLX cannot take."""
    names = {}
    layer_names = {**_LAYER_NAMES, **(_QWEN3_NORMS if arch == "qwen3" else {})}
    for name, tensor in tensors.items():
        if tensor.tensor_type not in _QUANTIZED | _FLOATS:
            raise GGUFConvertError(
                f"{path}: tensor {name} is {tensor.tensor_type.name}, which MLX cannot read "
                f"(only Q4_0, Q4_1, Q8_0, F16, BF16, F32); use the llama engine or a GGUF with those types"
            )
        if name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        parts = name.split(".")
        if len(parts) == 2 and parts[0] in _GLOBAL_NAMES and parts[1] == "weight":
            names[name] = f"{_GLOBAL_NAMES[parts[0]]}.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names and parts[3] in ("weight", "bias"):
            names[name] = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        else:
            raise GGUFConvertError(f"{path}: unexpected tensor {name} for a {arch} model; use the llama engine")
    if "token_embd.weight" not in names:
        raise GGUFConvertError(f"{path}: no token_embd.weight tensor (a vocabulary-only GGUF?)")
    return names


def _config(arch: str, meta: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """HF-style config.json content from the ``{arch}.*`` metadata (KeyError names a missing key)."""

    def get(key: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is KeyError:
            raise KeyError(f"missing metadata key {arch}.{key}")
        if isinstance(value, list):
            raise TypeError(f"per-layer {arch}.{key} is not supported; use the llama engine")
        return value

    if get("expert_count", 0):
        raise ValueError("mixture-of-experts models are not supported by the MLX engine; use the llama engine")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings are not supported by the MLX engine; use the llama engine")
    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if rope_scaling := _rope_scaling(get, tensors.get("rope_freqs.weight"), head_dim, config["rope_theta"]):
        config["rope_scaling"] = rope_scaling
    if (bos := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = int(bos)
    if "tokenizer.ggml.tokens" in meta and (eos := eos_token_ids(meta)):
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _rope_scaling(get: Callable, rope_freqs, head_dim: int, theta: float) -> dict | None:
    """mlx-lm's rope_scaling for the file's rotary scaling: linear, or Llama 3's, which GGUF keeps
    only as the per-frequency factors it implies (``rope_freqs``); those must match the standard
    Llama 3 parameters for the given factor, or the model would run with the wrong rotary."""
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        return {"type": "linear", "factor": _float32(get("rope.scaling.factor"))}
    if kind != "none":
        raise ValueError(f"rope scaling {kind!r} is not supported by the MLX engine; use the llama engine")
    if rope_freqs is None:
        return None
    factors = np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    if not np.allclose(factors, _llama3_factors(scaling, head_dim, theta), rtol=1e-3):
        raise ValueError("rope_freqs do not match Llama 3 rotary scaling; use the llama engine")
    return scaling


def _llama3_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """The factors llama.cpp's converter writes for Llama 3 rope scaling (LlamaModel.generate_extra_tensors)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (old_context / wavelen - low) / (high - low)
    factors = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_context / high, 1.0, np.where(wavelen > old_context / low, factor, factors))


def _arrays(loaded: dict[str, mx.array], tensor) -> list[mx.array]:
    """The tensor as MLX arrays, [weight, scales, biases] when quantized, else [value]; taken out of
    ``loaded`` so the source is freed as soon as the converted tensor is evaluated."""
    name = tensor.name
    if tensor.tensor_type in _QUANTIZED:
        stem = name.rsplit(".", 1)[0]
        return [loaded.pop(name), loaded.pop(f"{stem}.scales"), loaded.pop(f"{stem}.biases")]
    if tensor.tensor_type == GGMLQuantizationType.BF16:
        # mx.load narrows BF16 to float16, losing range; take the raw bits from the reader instead.
        bits = np.ascontiguousarray(tensor.data).view(np.uint16)
        return [mx.array(bits).view(mx.bfloat16).reshape(loaded.pop(name).shape)]
    return [loaded.pop(name)]


def _group_size_and_bits(tensor, arrays: list[mx.array]) -> tuple[int, int]:
    """MLX's quantization parameters of a Q4_0/Q4_1/Q8_0 tensor, from the packed shapes."""
    weight, scales, _ = arrays
    in_dims = int(tensor.shape[0])  # GGML lists dimensions innermost first
    return in_dims // scales.shape[-1], weight.shape[-1] * 32 // in_dims


def _unpermute(rows: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (each head's two rotary halves interleaved)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _quantization_block(quantized: dict[str, tuple[int, int]], floats: list[str]) -> dict:
    """mlx-lm's quantization config: the most common (group_size, bits), overrides for modules
    that differ (GGUFs often keep embeddings at 8 bits), False for the ones left in float."""
    (group_size, bits), _ = Counter(quantized.values()).most_common(1)[0]
    block: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for module, (g, b) in quantized.items():
        if (g, b) != (group_size, bits):
            block[module] = {"group_size": g, "bits": b}
    block.update({module: False for module in floats})
    return block


def _float32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
