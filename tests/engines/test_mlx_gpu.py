"""MLX on a GPU: `--quantize 4|8` quantizes on load (affine, group 64) and stays close to the source;
sequences decoded in a batch match their solo runs. Runs on the GPU machine; skipped on a CPU-only
one (where the engine dequantizes instead, and test_mlx_batch.py checks batching)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from mesh_llm.engines.base import EngineOptions, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bits,tolerance", [(8, 0.02), (4, 0.25)])
def test_quantize_on_load_keeps_the_logits_close(checkpoints, bits, tolerance):
    from mesh_llm.engines.mlx import MLXEngine

    folder = checkpoints["llama"].path
    source = MLXEngine.load(folder, EngineOptions())
    quantized = MLXEngine.load(folder, EngineOptions(quantize=bits))
    info = quantized.info()
    assert info.device == "gpu"
    assert f"{bits}" in info.details["quantization"] and "64" in info.details["quantization"]
    tokens = list(range(3, 40))
    a, b = source.score(tokens).astype(np.float64), quantized.score(tokens).astype(np.float64)
    error = np.linalg.norm(a - b) / np.linalg.norm(a)
    agree = float((a.argmax(1) == b.argmax(1)).mean())
    print(f"\n{bits}-bit: relative logit error {error:.4f}, top-1 agreement {agree:.2%}")
    assert 1e-4 < error < tolerance  # quantizing must change the logits, a little
    assert agree >= (0.9 if bits == 8 else 0.6)
    steps = quantized.generate(tokens, SamplingParams(temperature=0.0))
    assert [next(steps).token for _ in range(4)]  # decodes through the quantized kernels
    steps.close()


def _batch_models(checkpoints):
    """The tiny checkpoints (float32 and float16 on disk), and a real model when one is given:
    MESH_LLM_GPU_MODEL=/path/to/mlx-folder (benchmarks/gpu_session.sh writes random-weight Qwen2.5
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
    near-tie, seeded tokens equal. Prints how many diverge, and where."""
    from batch_runs import AllowOnly, Case, compare, run_alone, run_batched

    from mesh_llm.engines.mlx import MLXEngine

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
        cases = [Case([rng.randrange(3, min(vocab, 300)) for _ in range(n)], params(i), 24, start=i)
                 for i, n in enumerate(lengths)]
        alone = [run_alone(engine, c) for c in cases]
        batched = run_batched(engine, cases, budget=64, leave={7: 14})
        diverged, errors = [], []
        for i in range(7):
            result = compare(alone[i], batched[i], tolerance)
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
