"""GGUF -> MLX conversion against real files and real libraries.

Synthetic GGUFs are written with gguf's own GGUFWriter and quantizers from random Hugging Face-layout
weights (Q/K permuted for llama as llama.cpp's converter does), so every import can be checked
against mlx-lm running the original weights. The embedded SmolLM2 GGUF checks the real thing: it
must answer "Paris", and its tokenizer must give llama.cpp's ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

# Imported before mlx.core: it interposes OpenBLAS for the whole test session.
from mesh_llm.models.gguf_convert import GGUFConvertError, import_gguf, read_gguf  # isort: skip
import mlx.core as mx
import mlx_lm
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from mlx_lm.utils import load_model
from tokenizers import Tokenizer

from mesh_llm.models.gguf_tokenizer import build_tokenizer

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 128}
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LAYER = {  # GGUF block tensor -> Hugging Face module (gguf-py's tensor map)
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
TEXTS = [
    "Hello world",
    " Hello world",
    "   three leading spaces",
    "\n\nnewlines\n\n\n",
    "What is the capital of France?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "numbers 1234567 3.14159 1,000,000",
    "unicode: naïve café, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어, مرحبا",
    "emoji 🤗🚀👍🏽 ❤️ 🇫🇷",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\r\nwindows line ends",
    "I've don't we'll they're YOU'RE",
    "   ",
    "",
    "<|endoftext|>text<|endoftext|>",
    "x = {'a': [1, 2, 3]}  # comment\n\t\tindent",
    "http://example.com/path?x=1&y=2 $$$ ### @@@",
]


# --- synthetic GGUFs -------------------------------------------------------------------------


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """A tiny but complete byte-level BPE vocabulary: 3 control tokens, the 256 byte symbols, 3 merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = [chr(b) if b in printable else None for b in range(256)]
    spare = iter(range(256, 512))
    symbols = [s if s is not None else chr(next(spare)) for s in symbols]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols, "Ġt", "he", "Ġthe"]
    return tokens, [3, 3, 3] + [1] * 259, ["Ġ t", "h e", "Ġt he"]


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (conversion/llama.py, LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(arch: str, vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, hd, inter = SHAPE["hidden"], SHAPE["head_dim"], SHAPE["inter"]
    q, kv = SHAPE["heads"] * hd, SHAPE["kv_heads"] * hd

    def rand(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, h, scale=1.0), "model.norm.weight": 1 + rand(h)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, h)
    for i in range(SHAPE["layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + rand(h),
            p + "post_attention_layernorm.weight": 1 + rand(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
        if arch == "qwen2":
            w |= {p + f"self_attn.{x}_proj.bias": rand(n) for x, n in (("q", q), ("k", kv), ("v", kv))}
        if arch == "qwen3":
            w |= {p + "self_attn.q_norm.weight": 1 + rand(hd), p + "self_attn.k_norm.weight": 1 + rand(hd)}
    return w


def hf_config(arch: str, vocab: int, tied: bool) -> dict:
    return {
        "model_type": arch,
        "architectures": [HF_CLASS[arch]],
        "hidden_size": SHAPE["hidden"],
        "num_hidden_layers": SHAPE["layers"],
        "intermediate_size": SHAPE["inter"],
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv_heads"],
        "head_dim": SHAPE["head_dim"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, *module, kind = hf_name.split(".")
        part = {v: k for k, v in LAYER.items()}[".".join(module)]
        return f"blk.{i}.{part}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]  # fmt: skip


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], types=None, meta=None, tensors=None) -> Path:
    """A GGUF as llama.cpp's converter writes one. ``types`` maps GGUF tensor names to a GGML type
    (default: F32 for 1-D, F32 otherwise); ``tensors`` adds raw (name, array, type) entries."""
    types = types or {}
    tokens, token_types, merges = byte_level_vocab()
    w = GGUFWriter(str(path), arch)
    w.add_block_count(SHAPE["layers"])
    w.add_context_length(256)
    w.add_embedding_length(SHAPE["hidden"])
    w.add_feed_forward_length(SHAPE["inter"])
    w.add_head_count(SHAPE["heads"])
    w.add_head_count_kv(SHAPE["kv_heads"])
    w.add_key_length(SHAPE["head_dim"])
    w.add_value_length(SHAPE["head_dim"])
    w.add_rope_dimension_count(SHAPE["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for key, value in (meta or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, value)
    for hf, data in weights.items():
        name = gguf_name(hf)
        if arch == "llama" and ".q_proj." in hf:
            data = llama_permute(data, SHAPE["heads"])
        if arch == "llama" and ".k_proj." in hf:
            data = llama_permute(data, SHAPE["kv_heads"])
        qtype = types.get(name, QT.F32) if data.ndim == 2 else QT.F32
        if qtype == QT.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif qtype == QT.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    for name, data, qtype in tensors or ():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def as_stored(data: np.ndarray, qtype) -> np.ndarray:
    """What a tensor of ``qtype`` holds, in float32. Quantization is per row, so this commutes with
    llama.cpp's Q/K row permutation."""
    if qtype == QT.F32 or data.ndim == 1:
        return data
    if qtype == QT.F16:
        return data.astype(np.float16).astype(np.float32)
    return dequantize(quantize(data, qtype), qtype)


def logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def reference_model(tmp: Path, arch: str, weights: dict[str, np.ndarray], tied: bool):
    """mlx-lm running the given Hugging Face-layout weights directly."""
    tmp.mkdir()
    (tmp / "config.json").write_text(json.dumps(hf_config(arch, len(byte_level_vocab()[0]), tied)))
    mx.save_safetensors(str(tmp / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return load_model(tmp)[0]


# --- conversion of synthetic models ----------------------------------------------------------

VOCAB = len(byte_level_vocab()[0])
CASES = [  # arch, type of the 2-D weights, tied embeddings
    ("llama", QT.F32, True),
    ("qwen2", QT.F32, False),
    ("qwen3", QT.F32, True),
    ("llama", QT.Q4_0, False),
    ("llama", QT.Q4_1, True),
    ("qwen2", QT.Q8_0, True),
    ("qwen3", QT.F16, False),
    ("llama", QT.BF16, True),
]


@pytest.mark.parametrize(
    "arch,qtype,tied", CASES, ids=[f"{a}-{q.name}-{'tied' if t else 'untied'}" for a, q, t in CASES]
)
def test_import_matches_mlx_lm_on_the_original_weights(tmp_path, arch, qtype, tied):
    weights = hf_weights(arch, VOCAB, tied)
    types = {gguf_name(k): qtype for k in weights}
    src = write_gguf(tmp_path / "m.gguf", arch, weights, types)
    stored = {k: as_stored(v, qtype) for k, v in weights.items()}
    ref = logits(reference_model(tmp_path / "ref", arch, stored, tied), list(range(3, 40)))

    float_dir = import_gguf(src, tmp_path / "f32", dtype="float32")
    model, _ = mlx_lm.load(str(float_dir))
    assert json.loads((float_dir / "config.json").read_text())["model_type"] == arch
    np.testing.assert_allclose(logits(model, list(range(3, 40))), ref, atol=2e-4, rtol=1e-4)

    kept = read_gguf(src)
    quantized = qtype in (QT.Q4_0, QT.Q4_1, QT.Q8_0)
    assert ("quantization" in kept.config) == quantized
    for name, value in weights.items():
        if quantized and value.ndim == 2:
            module = name.rsplit(".", 1)[0]
            w = mx.dequantize(kept.weights[name], kept.weights[f"{module}.scales"].astype(mx.float32),
                              kept.weights[f"{module}.biases"].astype(mx.float32), group_size=32,
                              bits=kept.config["quantization"]["bits"])  # fmt: skip
        else:
            w = kept.weights[name].astype(mx.float32)
        np.testing.assert_array_equal(np.array(w), stored[name], err_msg=name)

    kept_dir = import_gguf(src, tmp_path / "kept")
    model, _ = mlx_lm.load(str(kept_dir))
    got = logits(model, list(range(3, 40)))  # computed in float16/bfloat16
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9
    np.testing.assert_allclose(got, ref, atol=0.1 * np.abs(ref).max())


def test_mixed_types_get_per_layer_quantization(tmp_path):
    """GGUFs mix types (Q8_0 embeddings, an F16 output): mlx-lm must quantize exactly those layers."""
    weights = hf_weights("llama", VOCAB, tied=False)
    types = {gguf_name(k): QT.Q4_0 for k in weights} | {"token_embd.weight": QT.Q8_0, "output.weight": QT.F16}
    src = write_gguf(tmp_path / "m.gguf", "llama", weights, types)
    out = import_gguf(src, tmp_path / "out")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8},
                     "lm_head": False}  # fmt: skip
    model, _ = mlx_lm.load(str(out))
    stored = {k: as_stored(v, types.get(gguf_name(k), QT.F32)) for k, v in weights.items()}
    ref = logits(reference_model(tmp_path / "ref", "llama", stored, False), [5, 6, 7])
    assert np.abs(logits(model, [5, 6, 7]) - ref).max() < 0.05 * np.abs(ref).max()


def test_bfloat16_import(tmp_path, small_gguf):
    out = import_gguf(small_gguf, tmp_path / "bf16", dtype="bfloat16")
    assert {v.dtype for v in mx.load(str(out / "model.safetensors")).values()} == {mx.bfloat16}
    assert "quantization" not in json.loads((out / "config.json").read_text())
    model, _ = mlx_lm.load(str(out))
    assert np.isfinite(logits(model, [5, 6, 7])).all()


def test_bf16_keeps_its_range(tmp_path):
    """mx.load narrows BF16 to float16 (max 65504); the import must not."""
    weights = hf_weights("llama", VOCAB, tied=True)
    big = weights["model.layers.0.mlp.up_proj.weight"]
    big[0, 0] = 1e6
    src = write_gguf(tmp_path / "m.gguf", "llama", weights, {"blk.0.ffn_up.weight": QT.BF16})
    value = read_gguf(src).weights["model.layers.0.mlp.up_proj.weight"]
    assert value.dtype == mx.bfloat16
    assert float(value[0, 0]) == pytest.approx(1e6, rel=1e-2)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    """Llama 3 GGUFs keep rope scaling only as rope_freqs (conversion/llama.py, generate_extra_tensors)."""
    hd, base, factor = SHAPE["head_dim"], 10000.0, 32.0  # base: the file's rope.freq_base
    freqs = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    wavelen = 2 * np.pi / freqs
    old_context, low, high = 8192, 1.0, 4.0
    smooth = (old_context / wavelen - low) / (high - low)
    rope_factors = np.where(wavelen < old_context / high, 1.0,
                            np.where(wavelen > old_context / low, factor, 1 / ((1 - smooth) / factor + smooth)))  # fmt: skip
    weights = hf_weights("llama", VOCAB, tied=True)
    rope = [("rope_freqs.weight", rope_factors.astype(np.float32), QT.F32)]
    src = write_gguf(tmp_path / "m.gguf", "llama", weights, tensors=rope)
    config = read_gguf(src).config
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    bad = [("rope_freqs.weight", np.linspace(1, 3, hd // 2, dtype=np.float32), QT.F32)]
    with pytest.raises(GGUFConvertError, match="rope_freqs"):
        read_gguf(write_gguf(tmp_path / "bad.gguf", "llama", weights, tensors=bad))


# --- bad input -----------------------------------------------------------------------------


@pytest.fixture
def small_gguf(tmp_path) -> Path:
    weights = hf_weights("llama", VOCAB, tied=True)
    return write_gguf(tmp_path / "small.gguf", "llama", weights, {gguf_name(k): QT.Q4_0 for k in weights})


def assert_one_line_error(path: Path, match: str, **kwargs) -> None:
    with pytest.raises(GGUFConvertError, match=match) as info:
        read_gguf(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message


def test_missing_file(tmp_path):
    assert_one_line_error(tmp_path / "nope.gguf", "no such file")


def test_not_a_gguf(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "text.gguf").write_text("<html>rate limited</html>")
    assert_one_line_error(tmp_path / "empty.gguf", "not a GGUF")
    assert_one_line_error(tmp_path / "text.gguf", "not a GGUF")


@pytest.mark.parametrize("keep", [10, 200, 0.5, -1], ids=["header", "metadata", "half", "last-byte"])
def test_truncated_gguf(tmp_path, small_gguf, keep):
    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    assert_one_line_error(cut, "truncated or corrupt")


def test_unsupported_architecture_and_types(tmp_path):
    weights = hf_weights("llama", VOCAB, tied=True)
    assert_one_line_error(write_gguf(tmp_path / "g.gguf", "gemma", {}), "architecture 'gemma'.*llama engine")
    k_quant = [("blk.0.ffn_gate_k.weight", np.zeros((4, 144), np.uint8), QT.Q4_K)]
    assert_one_line_error(write_gguf(tmp_path / "k.gguf", "llama", weights, tensors=k_quant), "Q4_K.*llama engine")
    moe = write_gguf(tmp_path / "moe.gguf", "llama", weights, meta={"llama.expert_count": 8})
    assert_one_line_error(moe, "mixture-of-experts")
    assert_one_line_error(write_gguf(tmp_path / "vocab.gguf", "llama", {}), "vocabulary-only")
    assert_one_line_error(tmp_path / "vocab.gguf", "dtype", dtype="int8")


def test_unknown_pre_tokenizer_is_refused_not_guessed(tmp_path):
    weights = hf_weights("llama", VOCAB, tied=True)
    src = write_gguf(tmp_path / "m.gguf", "llama", weights)
    data = src.read_bytes().replace(b"smollm", b"falcon", 1)
    (tmp_path / "f.gguf").write_bytes(data)
    assert_one_line_error(tmp_path / "f.gguf", "pre-tokenizer 'falcon'.*llama engine")


# --- atomicity -----------------------------------------------------------------------------


class Stop(Exception):
    pass


@pytest.mark.parametrize("fail_at", ["first", "last"])
def test_failed_import_leaves_nothing_behind(tmp_path, small_gguf, fail_at):
    """Interrupted while converting, or after every file is written but before the rename."""
    parent = tmp_path / "models"
    parent.mkdir()
    before = set(parent.iterdir())

    def progress(done, total):
        if fail_at == "first" or done == total:
            raise Stop

    with pytest.raises(Stop):
        import_gguf(small_gguf, parent / "out", progress=progress)
    assert set(parent.iterdir()) == before


def test_bad_input_leaves_nothing_behind(tmp_path, small_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_gguf.read_bytes()[:-100])
    with pytest.raises(GGUFConvertError):
        import_gguf(cut, tmp_path / "models" / "out")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_import_refuses_an_existing_folder(tmp_path, small_gguf):
    (tmp_path / "out").mkdir()
    with pytest.raises(GGUFConvertError, match="already exists"):
        import_gguf(small_gguf, tmp_path / "out")


def test_progress_counts_up_to_total(tmp_path, small_gguf):
    calls = []
    import_gguf(small_gguf, tmp_path / "out", progress=lambda done, total: calls.append((done, total)))
    total = len(GGUFReader(small_gguf).tensors) + 1
    assert calls == [(done, total) for done in range(1, total + 1)]  # every tensor, then the files
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip


# --- the embedded SmolLM2 GGUF -------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_imports(default_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm")
    return import_gguf(default_gguf, root / "q4"), import_gguf(default_gguf, root / "f32", dtype="float32")


@pytest.mark.slow
def test_smollm_config(smollm_imports):
    kept, full = (json.loads((p / "config.json").read_text()) for p in smollm_imports)
    assert kept["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert "quantization" not in full
    for config in kept, full:
        assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
        assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
        assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
        assert config["eos_token_id"] == [2, 0]  # <|im_end|>, and <|endoftext|> which llama.cpp also stops on
    tokenizer_config = json.loads((smollm_imports[0] / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and tokenizer_config["add_bos_token"] is False
    assert "<|im_start|>" in tokenizer_config["chat_template"]


@pytest.mark.slow
def test_smollm_quantized_and_float32_imports_agree(smollm_imports):
    (kept, _), (full, tokenizer) = (mlx_lm.load(str(p)) for p in smollm_imports)
    ids = tokenizer.encode("The capital of France is Paris. The capital of Germany is", add_special_tokens=False)
    a, b = logits(kept, ids), logits(full, ids)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
    assert np.abs(a - b).max() < 0.02 * np.abs(b).max()
    # The float32 import is exactly the kept one dequantized.
    layer = kept.model.layers[3].self_attn.k_proj
    w = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                      group_size=layer.group_size, bits=layer.bits)  # fmt: skip
    np.testing.assert_array_equal(np.array(w), np.array(full.model.layers[3].self_attn.k_proj.weight))


@pytest.mark.slow
def test_smollm_float32_answers_paris(smollm_imports):
    import jinja2

    model, tokenizer = mlx_lm.load(str(smollm_imports[1]))
    template = json.loads((smollm_imports[1] / "tokenizer_config.json").read_text())["chat_template"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.count(1) == 3  # every <|im_start|> is its one special id
    answer = mlx_lm.generate(model, tokenizer, prompt=ids, max_tokens=12)
    assert "Paris" in answer


# --- tokenizer parity with llama.cpp -------------------------------------------------------


def gguf_tokenizer(path: Path) -> Tokenizer:
    meta = {name: field.contents() for name, field in GGUFReader(path).fields.items()}
    return Tokenizer.from_str(build_tokenizer(meta)[0])


def assert_same_ids_as_llama_cpp(path: Path, texts: list[str], round_trip: bool = True) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    ours = gguf_tokenizer(path)
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in texts:
        for add_bos in (False, True):
            expected = theirs.tokenize(text.encode(), add_bos=add_bos, special=True)
            assert ours.encode(text, add_special_tokens=add_bos).ids == expected, (path.name, add_bos, text)
        if round_trip:
            assert ours.decode(ours.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm_tokenizer_matches_llama_cpp(default_gguf):
    assert_same_ids_as_llama_cpp(default_gguf, TEXTS)


def test_synthetic_tokenizer_matches_llama_cpp(small_gguf):
    assert_same_ids_as_llama_cpp(small_gguf, TEXTS)


def llama_cpp_vocab(name: str) -> Path:
    """llama.cpp's vocab-only test GGUFs (vendor/llama.cpp/models in the llama-cpp-python sdist),
    from the folder named by MESH_LLM_GGUF_VOCABS; skipped when absent."""
    folder = os.environ.get("MESH_LLM_GGUF_VOCABS")
    path = Path(folder or "/nonexistent") / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"set MESH_LLM_GGUF_VOCABS to a folder with ggml-vocab-{name}.gguf (llama-cpp-python sdist)")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "qwen35", "llama-bpe", "llama-spm", "gpt-2", "starcoder", "mpt"])
def test_llama_cpp_vocabularies(name):
    """Their own test inputs (``.inp``) plus ours. SentencePiece text after a special token gains the
    prefix space llama.cpp gives it, so it round-trips only without special tokens."""
    path = llama_cpp_vocab(name)
    inputs = path.with_name(path.name + ".inp")
    texts = TEXTS + (inputs.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inputs.exists() else [])
    assert_same_ids_as_llama_cpp(path, texts, round_trip=name != "llama-spm")
