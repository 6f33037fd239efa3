"""MLX on a GPU: `--quantize 4|8` quantizes on load (affine, group 64) and stays close to the source;
sequences decoded in a batch match their solo runs. Runs on the GPU machine; skipped on a CPU-only
one (where the engine dequantizes instead, and test_mlx_batch.py checks batching)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from batch_runs import log_softmax

from mesh_llm.engines.base import EngineOptions, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.gpu]


TEXT = ("The library opens at nine in the morning and closes at six in the evening. On weekends it "
        "opens later, at ten, and closes earlier, at four. Members may borrow up to five books at a time "
        "for three weeks, and they can renew each book twice unless another member has reserved it.")
QUESTIONS = ["What is the capital of France?", "Give me three tips for learning a new language.",
             "Write a haiku about autumn."]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The embedded SmolLM2 (on a GPU host: `EMBEDDED=1 benchmarks/gpu_wheels.sh`), imported from its
    GGUF as float16 (dequantized from Q4_1), so that quantizing on load has float weights to start from:
    a real model, where quantization error shows as lost quality."""
    try:
        from mesh_llm.models import default_gguf
        from mesh_llm.models.gguf_convert import import_gguf

        return import_gguf(default_gguf(), tmp_path_factory.mktemp("smollm2") / "f16", dtype="float16")
    except Exception as exc:  # noqa: BLE001 - optional on the GPU machine
        pytest.skip(f"the embedded model is not here: {exc}")


# Measured on the H200 (2026-12-03): 8-bit NLL -0.2%, top-1 95.0%; 4-bit NLL +11.7%, top-1 56.7%. A
# 135M model loses more to 4 bits than large ones do, and its float16 source is itself Q4_1 (group 32)
# dequantized, which group-64 4-bit cannot represent exactly.
@pytest.mark.parametrize("bits,nll_rise,agree_min", [(8, 0.02, 0.9), (4, 0.25, 0.5)])
def test_quantize_on_load_keeps_a_real_models_predictions(embedded, bits, nll_rise, agree_min):
    """`--quantize 4|8` on the embedded SmolLM2: every linear layer quantized, the memory smaller, the
    text's mean negative log-likelihood within ``nll_rise`` of the source's, teacher-forced top-1
    agreement at least ``agree_min``; greedy answers printed side by side (8-bit: the same first 8
    tokens)."""
    from mlx.utils import tree_flatten

    from mesh_llm.engines.mlx.engine import MLXEngine
    from mesh_llm.runtime.chat import encode_chat

    source = MLXEngine.load(embedded, EngineOptions(warm_up=False))
    quantized = MLXEngine.load(embedded, EngineOptions(quantize=bits, warm_up=False))
    info = quantized.info()
    assert info.device == "gpu"
    assert f"{bits}-bit" in info.details["quantization"], info.details
    weights = [sum(v.nbytes for _, v in tree_flatten(e._model.parameters())) for e in (source, quantized)]
    assert weights[1] < weights[0] * (0.6 if bits == 8 else 0.35)
    ids = source.tokenizer.encode(TEXT, add_special_tokens=False)
    a = log_softmax(source.score(ids).astype(np.float64))
    b = log_softmax(quantized.score(ids).astype(np.float64))
    targets = np.array(ids[1:])
    nll_a = -a[np.arange(len(targets)), targets].mean()
    nll_b = -b[np.arange(len(targets)), targets].mean()
    agree = float((a.argmax(1) == b.argmax(1)).mean())
    print(f"\n{bits}-bit on {embedded.name}: NLL {nll_a:.3f} -> {nll_b:.3f} "
          f"({(nll_b - nll_a) / nll_a:+.1%}), top-1 agreement {agree:.1%}, weights "
          f"{weights[0] / 1e6:.0f} -> {weights[1] / 1e6:.0f} MB")
    assert (nll_b - nll_a) / nll_a < nll_rise
    assert agree >= agree_min
    for question in QUESTIONS:
        prompt = encode_chat(source.tokenizer, [{"role": "user", "content": question}])
        answers = []
        for engine in (source, quantized):
            tokens = [s.token for s in engine.generate(prompt, SamplingParams(temperature=0.0), 24)]
            answers.append(tokens)
        print(f"  {question!r}\n    source:    {source.tokenizer.decode(answers[0])!r}\n"
              f"    {bits}-bit:     {source.tokenizer.decode(answers[1])!r}")
        if bits == 8:
            assert answers[0][:8] == answers[1][:8]
    source.close()
    quantized.close()


def _batch_models(checkpoints):
    """The tiny checkpoints (float32 and float16 on disk), and a real model when one is given:
    MESH_LLM_GPU_MODEL=/path/to/mlx-folder (benchmarks/gpu.sh writes random-weight Qwen2.5
    shapes), else the embedded SmolLM2's imported folder if it is installed."""
    models = [("llama", checkpoints["llama"].path, 5e-3), ("qwen3", checkpoints["qwen3"].path, 5e-2)]
    folder = os.environ.get("MESH_LLM_GPU_MODEL")
    if folder is None:
        try:
            from mesh_llm.models import default_mlx_folder

            folder = str(default_mlx_folder())
        except Exception:  # noqa: BLE001 - the embedded model is optional on the GPU machine
            folder = None
    if folder:
        models.append((Path(folder).name, Path(folder), 0.1))  # 16-bit weights and activations
    return models


def test_eight_batched_sequences_match_their_solo_runs_on_the_gpu(checkpoints):
    """Eight sequences (greedy with logprobs, seeded samplers with filters, one constrained row),
    staggered, one removed mid-decode, against each alone: logprobs within the tolerance (float32
    checkpoints: TF32-like matmul rounding; 16-bit ones: their own), greedy tokens equal up to a
    near-tie, seeded tokens equal. Four arrive at once, so their prompt chunks are read together.
    Prints how many diverge, and where."""
    from batch_runs import AllowOnly, Case, compare, run_alone, run_batched

    from mesh_llm.engines.mlx.engine import MLXEngine

    for name, path, tolerance in _batch_models(checkpoints):
        engine = MLXEngine.load(path, EngineOptions(ctx_size=512, prefill_step=16, cache_bytes=0))
        assert engine.info().device == "gpu"
        vocab = engine.tokenizer.vocab_size
        rng = random.Random(name)
        allowed = sorted(rng.sample(range(3, min(vocab, 300)), 5))

        def params(i, allowed=allowed, vocab=vocab):
            if i == 6:
                return lambda: SamplingParams(temperature=0, logprobs=3,
                                              constraint=AllowOnly(allowed, vocab))
            if i % 2:
                return lambda: SamplingParams(temperature=0.9, seed=i, top_k=40 if i == 3 else 0,
                                              top_p=0.9 if i == 5 else 1.0, logprobs=2)
            return lambda: SamplingParams(temperature=0, logprobs=5)

        lengths = [rng.randrange(5, 120) for _ in range(7)] + [20]
        # rows 0-3 arrive together (their chunks are read in one pass each step), 4-7 one a step
        cases = [Case([rng.randrange(3, min(vocab, 300)) for _ in range(n)], params(i), 24,
                      start=max(0, i - 3)) for i, n in enumerate(lengths)]
        alone = [run_alone(engine, c) for c in cases]
        batched = run_batched(engine, cases, budget=64, leave={7: 14})
        diverged, errors = [], []
        for i in range(7):
            try:
                result = compare(alone[i], batched[i], tolerance)
            except AssertionError as e:
                raise AssertionError(f"{name}, row {i} (starts at step {max(0, i - 3)}; row 7 leaves "
                                     f"at its step 14): {e}") from None
            if i % 2 and i != 6:
                assert result.diverged_at is None, f"{name}: seeded row {i} diverged"
            if i == 6:
                assert {s.token for s in batched[i]} <= set(allowed)
            if result.diverged_at is not None:
                diverged.append((i, result.diverged_at, round(result.margin, 5)))
            errors.append(f"{result.max_error:.1e}")
        assert 0 < len(batched[7]) < 24
        print(f"\n{name}: max logprob error per row {errors}; {len(diverged)} of 7 rows diverge "
              f"(row, position, solo margin): {diverged}")
        engine.close()


def test_sequences_preempted_on_the_gpu_answer_as_alone(checkpoints, monkeypatch):
    """The GPU's pipelined read, slots kept and chunks read together, with KV memory for three
    256-token sequences (``--kv-memory``; one 768-token context) and room for 8 answer tokens: three ~240-token prompts
    without max_tokens outgrow it, the newest two are preempted mid-answer (their token in flight
    read first) and resume; each answers as alone (seeded rows: the same draws)."""
    import sys

    from batch_runs import Case, compare, run_alone

    from mesh_llm.engines.mlx.cache import Footprint
    from mesh_llm.engines.mlx.engine import MLXEngine

    for name, path, tolerance in _batch_models(checkpoints):
        alone_engine = MLXEngine.load(path, EngineOptions(ctx_size=1024, prefill_step=64, cache_bytes=0))
        monkeypatch.setattr(sys.modules[MLXEngine.__module__], "ANSWER_HEADROOM", 8)
        kv = 2 * Footprint.measure(alone_engine._model).bytes(256)
        engine = MLXEngine.load(path, EngineOptions(ctx_size=768, prefill_step=64, cache_bytes=0, max_batch=3,
                                                    kv_bytes=3 * kv + kv // 2))
        vocab = engine.tokenizer.vocab_size
        rng = random.Random(name)
        params = [lambda: SamplingParams(temperature=0, logprobs=3),
                  lambda: SamplingParams(temperature=0.9, seed=1, logprobs=2),
                  lambda: SamplingParams(temperature=0.9, seed=2, logprobs=2)]
        cases = [Case([rng.randrange(3, min(vocab, 300)) for _ in range(n)], p, 24)
                 for n, p in zip((236, 240, 244), params)]
        steps = {i: [] for i in range(3)}
        for i, case in enumerate(cases):
            engine.add(i, case.prompt, case.params(), 768 - len(case.prompt))  # the whole context
        while any(len(steps[i]) < 24 for i in range(3)):
            for seq, step in engine.step(4096):
                steps[seq].append(step)
                if len(steps[seq]) == 24:
                    engine.remove(seq)
        assert engine.cache_stats()["kv_preemptions"] >= 2, name
        for i, case in enumerate(cases):
            result = compare(run_alone(alone_engine, case), steps[i], tolerance)
            assert i == 0 or result.diverged_at is None, f"{name}: seeded row {i} diverged"
        engine.close()
        alone_engine.close()
        monkeypatch.undo()


@pytest.mark.parametrize("rows", [6, 1])
@pytest.mark.parametrize("heads,kv_heads,size,keys,dtype", [
    (14, 2, 64, 700, "float16"), (28, 4, 128, 37, "float16"), (8, 8, 96, 300, "bfloat16"), (4, 4, 64, 129, "float32")])
def test_the_fused_decode_attention_matches_mlxs_masked_attention(heads, kv_heads, size, keys, dtype, rows):
    """engines/mlx/kernels/attention.py against mx.fast.scaled_dot_product_attention with the left-padding
    mask: every row from its own start, the first ``keys`` positions of a larger buffer read (as a
    cache holds them), grouped heads; one row (32 warps a block) and six."""
    import mlx.core as mx

    from mesh_llm.engines.mlx.kernels.attention import decode_attention

    if not mx.cuda.is_available():
        pytest.skip("the fused kernel is CUDA's")
    dt = getattr(mx, dtype)
    q = mx.random.normal((rows, heads, 1, size), key=mx.random.key(1)).astype(dt)
    k_all = mx.random.normal((rows, kv_heads, keys + 200, size), key=mx.random.key(2)).astype(dt)
    v_all = mx.random.normal((rows, kv_heads, keys + 200, size), key=mx.random.key(3)).astype(dt)
    k, v = k_all[:, :, :keys], v_all[:, :, :keys]
    starts = mx.array([0, keys - 1, keys // 2, 1, keys // 3, 0][:rows], dtype=mx.int32)
    mask = mx.arange(keys)[None, None, None, :] >= starts[:, None, None, None]
    fused = decode_attention(q, k_all, v_all, size ** -0.5, starts, length=keys).astype(mx.float32)
    reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=size ** -0.5, mask=mask).astype(mx.float32)
    tolerance = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
    assert mx.max(mx.abs(fused - reference)).item() <= tolerance


def test_the_decode_attention_binary_is_kept_on_disk_and_loaded_without_a_compiler(tmp_path, monkeypatch):
    """engines/mlx/kernels/nvrtc.py: the first call compiles with NVRTC and stores the cubin in MLX's kernel
    folder; a later process (here: the engine's in-memory copy forgotten) loads it with no compile
    at all, and a changed source is compiled afresh, never served a stale binary."""
    import mlx.core as mx

    from mesh_llm.engines.mlx.kernels import attention as mlx_attention
    from mesh_llm.engines.mlx.kernels import nvrtc
    from mesh_llm.engines.mlx.kernels.attention import decode_attention, kernel_source

    if not mx.cuda.is_available():
        pytest.skip("NVRTC is CUDA's")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mlx_attention, "_binaries", {})
    q = mx.random.normal((3, 14, 1, 64), key=mx.random.key(1)).astype(mx.float16)
    k = mx.random.normal((3, 2, 512, 64), key=mx.random.key(2)).astype(mx.float16)
    starts = mx.array([0, 5, 300], dtype=mx.int32)
    first = decode_attention(q, k, k, 0.125, starts, length=400)
    mx.eval(first)
    stored = sorted(p.name for p in tmp_path.glob("*.cubin"))
    assert stored and all(name.startswith("mesh_llm_decode_attention_float16_14_2_64") for name in stored)

    def no_compiler(*args):
        raise AssertionError("compiled again although the binary is on disk")

    monkeypatch.setattr(mlx_attention, "_binaries", {})
    monkeypatch.setattr(nvrtc, "_compile", no_compiler)
    again = decode_attention(q, k, k, 0.125, starts, length=400)
    assert mx.array_equal(first, again).item()
    with pytest.raises(AssertionError, match="compiled again"):
        nvrtc.cubin("changed", kernel_source("changed", mx.float16, 14, 2, 64) + "// changed\n")


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k,group,dtype,bits", [
    (4100, 1088, 64, "float16", 4), (512, 3584, 64, "float16", 4), (300, 896, 32, "bfloat16", 4),
    (5000, 640, 128, "float32", 4), (151936, 896, 64, "float16", 4), (4100, 1088, 64, "float16", 8),
    (300, 896, 32, "bfloat16", 8)])
def test_the_quantized_decode_product_matches_the_dequantized_weights(rows, n, k, group, dtype, bits):
    """engines/mlx/kernels/quantized.py against a float32 product of the dequantized weights: outputs not a
    multiple of a block's (4,100), inputs not a multiple of a warp's 512 (1,088, 640), each group size
    and activation type, 4 and 8 bits, several output rows a warp (over 4,096 outputs) and one, 1-8
    activation rows; within the output type's rounding, and no farther than MLX's own product."""
    import mlx.core as mx

    from mesh_llm.engines.mlx.kernels.quantized import qmv

    if not mx.cuda.is_available():
        pytest.skip("the kernel is CUDA's")
    dt = getattr(mx, dtype)
    w = (mx.random.normal((n, k), key=mx.random.key(4)) * k ** -0.5).astype(dt)
    q = mx.quantize(w, group, bits)
    x = mx.random.normal((rows, 1, k), key=mx.random.key(5)).astype(dt)
    reference = x.astype(mx.float32) @ mx.dequantize(*q, group, bits).astype(mx.float32).T
    ours = qmv(x, *q, group, bits)
    theirs = mx.quantized_matmul(x, *q, transpose=True, group_size=group, bits=bits)
    assert ours.shape == theirs.shape == (rows, 1, n) and ours.dtype == dt
    error = mx.max(mx.abs(ours.astype(mx.float32) - reference)).item()
    their_error = mx.max(mx.abs(theirs.astype(mx.float32) - reference)).item()
    scale = mx.max(mx.abs(reference)).item()
    rounding = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    assert error <= rounding * scale, (error, their_error, scale)
    assert error <= their_error * 1.5 + 1e-6, (error, their_error)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k,group,dtype", [
    (4100, 1088, 64, "float16"), (3584, 18944, 64, "float16"), (300, 896, 32, "bfloat16"),
    (37888, 640, 128, "float16"), (151936, 896, 64, "bfloat16")])
def test_the_tensor_core_product_matches_the_dequantized_weights(rows, n, k, group, dtype):
    """engines/mlx/kernels/quantized.py's ``qmm`` (4 bits, tensor cores) against a float32 product of the
    dequantized weights: outputs not a multiple of a tile's 16 (4,100, 300), inputs not a multiple of
    a block's 256 (1,088, 640), each group size, both half types, one and two tiles of outputs a warp
    (37,888 and 151,936 outputs), one and two tiles of input rows (9, 16), blocks of 4, 8 and 16
    warps; within the output type's rounding, and no farther than MLX's own product."""
    import mlx.core as mx

    from mesh_llm.engines.mlx.kernels.quantized import qmm

    if not mx.cuda.is_available():
        pytest.skip("the kernel is CUDA's")
    dt = getattr(mx, dtype)
    w = (mx.random.normal((n, k), key=mx.random.key(4)) * k ** -0.5).astype(dt)
    q = mx.quantize(w, group, 4)
    x = mx.random.normal((rows, 1, k), key=mx.random.key(5)).astype(dt)
    reference = x.astype(mx.float32) @ mx.dequantize(*q, group, 4).astype(mx.float32).T
    theirs = mx.quantized_matmul(x, *q, transpose=True, group_size=group, bits=4)
    their_error = mx.max(mx.abs(theirs.astype(mx.float32) - reference)).item()
    scale = mx.max(mx.abs(reference)).item()
    for warps in (None, 4, 8, 16):  # None: the rule's
        ours = qmm(x, *q, group, warps=warps)
        assert ours.shape == theirs.shape == (rows, 1, n) and ours.dtype == dt
        error = mx.max(mx.abs(ours.astype(mx.float32) - reference)).item()
        assert error <= {"float16": 2e-3, "bfloat16": 1e-2}[dtype] * scale, (warps, error, their_error, scale)
        assert error <= their_error * 1.5 + 1e-6, (warps, error, their_error)


def test_a_4bit_model_decodes_as_through_its_dequantized_weights(checkpoints, monkeypatch):
    """`--quantize 4` on a GPU routes quantized layers through engines/mlx/kernels/quantized.py: a batch of 3
    decoded for 12 steps with every product through the dequantized weights, then the same tokens fed
    with the layers routed as served (the prompts' products through the dequantized weights, every
    product of 3 rows through our kernels, whatever its size: the tensor-core one for 4-bit half
    weights), gives logits within 2% of their size, and the same greedy token wherever the top two
    are farther apart than the two runs. The reference is not MLX's own quantized product: MLX
    0.32.4's CUDA one gives zeros for 2 rows or more of 64 inputs, the tests' tiny llama's width
    (measured on an H100: docs/performance.md)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mesh_llm.engines.mlx.kernels import quantized as mlx_quantized
    from mesh_llm.engines.mlx.load import load_any

    if not mx.cuda.is_available():
        pytest.skip("the kernel is CUDA's")
    folder = os.environ.get("MESH_LLM_GPU_MODEL") or str(checkpoints["llama"].path)
    model, *_, details, _ = load_any(Path(folder), EngineOptions(quantize=4))
    assert "quantized_decode" in details, details
    monkeypatch.setattr(mlx_quantized, "KERNEL_BYTES", 0)
    monkeypatch.setattr(mlx_quantized, "MMA_BYTES", 0)
    prompt = mx.array([[(7 * i + r) % 100 + 3 for i in range(40)] for r in range(3)])
    tokens, runs = [], []  # the layers are routed (details): only where each product goes changes
    for on in (False, True):
        # off: every product dequantized; on: the prompts' 3 x 40 rows dequantized, the rest ours
        monkeypatch.setattr(mlx_quantized, "DEQUANTIZED_ROWS", 64 if on else 1)
        cache = make_prompt_cache(model)
        logits = model(prompt, cache=cache)[:, -1]
        steps = []
        for step in range(12):
            if not on:
                tokens.append(mx.argmax(logits, axis=-1))
            steps.append(logits.astype(mx.float32))
            logits = model(tokens[step][:, None], cache=cache)[:, -1]
        mx.eval(steps, tokens)
        runs.append(steps)
    for off, on in zip(*runs):
        scale, gap = mx.max(mx.abs(off)).item(), mx.max(mx.abs(on - off)).item()
        assert gap <= 0.02 * scale, (gap, scale)
        top2 = mx.sort(off, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * gap
        assert mx.all(mx.where(clear, mx.argmax(on, axis=-1) == mx.argmax(off, axis=-1), True)).item()
