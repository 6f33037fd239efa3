"""MLX on a GPU: `--quantize 4|8` quantizes on load (affine, group 64) and stays close to the source.
Runs on the GPU machine; skipped on a CPU-only one (where the engine dequantizes instead)."""

from __future__ import annotations

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
