"""engines/mlx/projections.py: q/k/v and gate/up computed as one product each, against the separate
products, on the embedded SmolLM2 (llama) and tiny random qwen2, llama and qwen3 layers: the
same logits up to float32 rounding, the same greedy tokens, memory unchanged; quantized layers fused
too (bit for bit); layers of mixed quantization, other architectures and the switch left alone. The engine fuses on a GPU (where the H200 gave float16
logits bit for bit equal); here the tests fuse by hand."""

from __future__ import annotations

import pytest

from mesh_llm.engines import engine_class, is_installed
from mesh_llm.engines.base import EngineOptions, SamplingParams

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

if not is_installed("mlx"):  # checked without importing mlx.core, which must come after the BLAS fix
    pytest.skip("the mlx extra is not installed", allow_module_level=True)

MLXEngine = engine_class("mlx")  # imports mlx.core after the BLAS fix

from random_mlx import random_model  # noqa: E402

TOLERANCE = 1e-4


def param_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def test_the_embedded_model_fused_gives_the_separate_products_logits():
    """The engine fuses on a GPU only; here the same loaded model is scored before and after
    fusing. OpenBLAS rounds a wider product differently: logits within 1e-5 of their largest
    (measured 3.5e-6), the same top token everywhere, the same greedy text."""
    import numpy as np

    from mesh_llm.engines.mlx.projections import fuse_projections
    from mesh_llm.models import default_mlx_folder
    from mesh_llm.runtime.chat import encode_chat

    engine = MLXEngine.load(default_mlx_folder(), EngineOptions(ctx_size=1024, cache_bytes=0))
    try:
        assert "projections" not in engine.info().details  # not on a CPU
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
        greedy = SamplingParams(temperature=0)
        before, text = engine.score(ids), [s.token for s in engine.generate(ids, greedy, 12)]
        size = param_bytes(engine._model)
        assert fuse_projections(engine._model) == len(engine._model.model.layers)
        assert type(engine._model.model.layers[0].self_attn).__name__ == "FusedAttention"
        assert param_bytes(engine._model) == size
        after = engine.score(ids)
        assert np.abs(after - before).max() <= 1e-5 * np.abs(before).max()
        assert (after.argmax(-1) == before.argmax(-1)).all()
        assert [s.token for s in engine.generate(ids, greedy, 12)] == text
    finally:
        engine.close()


@pytest.mark.parametrize("kind,config", [
    ("qwen2", {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
               "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 97}),
    ("llama", {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
               "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 97,
               "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    ("qwen3", {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
               "vocab_size": 97, "max_position_embeddings": 512, "rope_theta": 1e6,
               "tie_word_embeddings": True}),
])
def test_layers_with_biases_fused_decode_as_before(kind, config):
    """Prompt then decode steps through a KV cache, fused against separate: biases (qwen2, llama's
    optional ones), each head's q and k norm (qwen3), a head size other than hidden / heads."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from mesh_llm.engines.mlx.projections import fuse_projections

    separate = random_model(kind, config)
    fused = random_model(kind, config)
    fused.load_weights(tree_flatten(separate.parameters()))
    assert fuse_projections(fused) == config["num_hidden_layers"]
    assert param_bytes(fused) == param_bytes(separate)
    caches = [make_prompt_cache(m) for m in (separate, fused)]
    tokens = mx.array([[5, 17, 3, 88, 41, 9, 60]])
    for step in range(4):
        a, b = (m(tokens, cache=c)[:, -1, :] for m, c in zip((separate, fused), caches))
        assert mx.max(mx.abs(a - b)).item() <= 1e-5, step
        tokens = mx.argmax(a, axis=-1)[:, None]
        assert tokens.tolist() == mx.argmax(b, axis=-1)[:, None].tolist()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_quantized_layers_fused_decode_as_before(kind):
    """Quantized q/k/v and gate/up stack as their float weights do (each output row is quantized on its
    own): the same memory and the same logits, bit for bit on this CPU; layers of mixed bits are
    left as they are."""
    import mlx.core as mx
    from mlx import nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from mesh_llm.engines.mlx.projections import fuse_projections

    config = {"model_type": kind, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 97}
    separate, fused = random_model(kind, config), random_model(kind, config)
    for model in (separate, fused):
        nn.quantize(model, 32, 4)
    fused.load_weights(tree_flatten(separate.parameters()))
    assert fuse_projections(fused) == 2
    assert type(fused.model.layers[0].mlp.gate_up_proj) is nn.QuantizedLinear
    assert param_bytes(fused) == param_bytes(separate)
    caches = [make_prompt_cache(m) for m in (separate, fused)]
    tokens = mx.array([[5, 17, 3, 88, 41, 9, 60]])
    for _ in range(4):
        a, b = (m(tokens, cache=c)[:, -1, :] for m, c in zip((separate, fused), caches))
        assert mx.array_equal(a, b).item()
        tokens = mx.argmax(a, axis=-1)[:, None]
    mixed = random_model(kind, config)
    nn.quantize(mixed, 32, 4, class_predicate=lambda p, m: isinstance(m, nn.Linear) and not p.endswith("v_proj"))
    nn.quantize(mixed, 32, 8, class_predicate=lambda p, m: type(m) is nn.Linear and p.endswith("v_proj"))
    assert fuse_projections(mixed) == 0


def test_other_architectures_are_left_alone():
    from mesh_llm.engines.mlx.projections import fuse_projections

    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 97}
    gemma3 = random_model("gemma3", {
        "model_type": "gemma3_text", "vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 2})
    assert fuse_projections(gemma3) == 0
    model = random_model("llama", llama)
    assert fuse_projections(model) == 2
    assert fuse_projections(model) == 0  # already fused


def test_fused_layers_decode_a_batch_as_each_sequence_alone_unfused():
    """The engine's batched decode (left-padded rows, a BatchKVCache: the split q, k and v are
    strided views there) through fused layers, against each sequence alone through separate ones."""
    from batch_runs import Case, compare, run_alone, run_batched

    from mesh_llm.engines.mlx.projections import fuse_projections
    from mesh_llm.models import default_mlx_folder
    from mesh_llm.runtime.chat import encode_chat

    options = EngineOptions(ctx_size=1024, cache_bytes=0, prefill_step=32)
    separate = MLXEngine.load(default_mlx_folder(), options)
    fused = MLXEngine.load(default_mlx_folder(), options)
    try:
        assert fuse_projections(fused._model) > 0
        questions = ["What is the capital of France?", "Write a haiku about autumn.",
                     "List five prime numbers.", "Why is the sky blue? Answer in one long sentence."]
        cases = [Case(encode_chat(fused.tokenizer, [{"role": "user", "content": q}]),
                      lambda: SamplingParams(temperature=0, logprobs=2), 10, start)
                 for q, start in zip(questions, [0, 0, 2, 5])]
        batched = run_batched(fused, cases, budget=64)
        for i, case in enumerate(cases):
            compare(run_alone(separate, case), batched[i], 1e-3)  # asserts: logprobs, near-ties only
    finally:
        fused.close()
        separate.close()
