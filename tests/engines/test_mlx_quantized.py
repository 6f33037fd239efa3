"""engines/mlx/kernels/quantized.py where a CPU can check it: which layers are routed and which the kernel
takes, that routing is undone exactly, that flattened products match the layers' own,
that the engine routes nothing off CUDA; and that a pre-quantized folder (``mesh_llm.bench.synth --quantize 4``, what the H200's 4-bit runs serve) loads and predicts
as its float source does. The kernel itself runs on CUDA only: test_mlx_gpu.py checks it there."""

from __future__ import annotations

import pytest

from mesh_llm.engines import engine_class, is_installed
from mesh_llm.engines.base import EngineOptions

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

if not is_installed("mlx"):  # checked without importing mlx.core, which must come after the BLAS fix
    pytest.skip("the mlx extra is not installed", allow_module_level=True)

MLXEngine = engine_class("mlx")  # imports mlx.core after the BLAS fix


def test_quantized_layers_are_routed_and_undone_and_their_products_flattened():
    """Every quantized layer is routed (the CUDA-core kernel takes 4- and 8-bit affine ones, the
    tensor-core one 4-bit layers of half types with inputs a multiple of 64) and routing is undone
    exactly; products of decode batches (B, 1, k) flattened into MLX's kernels (weights too small for
    ours), of one or two prompts, and of prompt chunks of ``DEQUANTIZED_ROWS`` rows or more (through
    the dequantized weights), match the layer's own."""
    import mlx.core as mx
    from mlx import nn

    from mesh_llm.engines.mlx.kernels import quantized as mlx_quantized

    layers = {
        "4-bit g64": nn.QuantizedLinear(128, 64, bits=4, group_size=64),
        "4-bit g32, bias": nn.QuantizedLinear(64, 32, bias=True, bits=4, group_size=32),
        "4-bit embedding": nn.QuantizedEmbedding(100, 128, bits=4, group_size=128),
        "8-bit": nn.QuantizedLinear(128, 64, bits=8, group_size=64),
        "mxfp4": nn.QuantizedLinear(128, 64, mode="mxfp4"),
        "float": nn.Linear(128, 64),
    }
    model = nn.Sequential(*layers.values())
    fitting = {name for name, layer in layers.items() if isinstance(layer, (nn.QuantizedLinear,
                                                                           nn.QuantizedEmbedding))
               and mlx_quantized.fits(layer)}
    assert fitting == {"4-bit g64", "4-bit g32, bias", "4-bit embedding", "8-bit"}
    assert not any(mlx_quantized.fits_mma(layers[name]) for name in fitting)  # float32 scales: no mma
    halves = {name: nn.QuantizedLinear(128, 64, bits=bits, group_size=64) for name, bits in (("4", 4), ("8", 8))}
    halves["4, 96 inputs"] = nn.QuantizedLinear(96, 64, bits=4, group_size=32)
    for layer in halves.values():
        layer.set_dtype(mx.bfloat16)
    assert {name for name, layer in halves.items() if mlx_quantized.fits_mma(layer)} == {"4"}
    assert mlx_quantized.install(model) == 0  # not on CUDA
    assert mlx_quantized.DEQUANTIZED_ROWS in range(7, 300)
    shapes = [(1, 1), (3, 1), (8, 1), (12, 1), (1, 6), (2, 5), (1, 300), (2, 150)]  # decode batches, prompts
    inputs = {name: {shape: mx.random.normal((*shape, k), key=mx.random.key(sum(shape))) for shape in shapes}
              for name, k in (("4-bit g32, bias", 64), ("mxfp4", 128))}
    expected = {name: {shape: layers[name](x) for shape, x in xs.items()} for name, xs in inputs.items()}
    assert mlx_quantized.route(model, True) == 5
    assert type(layers["4-bit g64"]) is mlx_quantized.DecodeQuantizedLinear
    assert type(layers["mxfp4"]) is mlx_quantized.DecodeQuantizedLinear
    assert type(layers["4-bit embedding"]) is mlx_quantized.DecodeQuantizedEmbedding
    assert type(layers["float"]) is nn.Linear
    for name, xs in inputs.items():
        for shape, x in xs.items():
            got, want = layers[name](x), expected[name][shape]
            assert got.shape == want.shape
            assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), (name, shape)
    embedding = layers["4-bit embedding"]  # a tied output layer's product
    x = mx.random.normal((3, 1, 128), key=mx.random.key(7))
    assert mx.allclose(embedding.as_linear(x), nn.QuantizedEmbedding.as_linear(embedding, x), atol=1e-5).item()
    assert layers["4-bit g64"].takes_qmv and not layers["mxfp4"].takes_qmv
    assert not any(layer.takes_mma for layer in layers.values() if hasattr(layer, "takes_mma"))  # no CUDA
    assert mlx_quantized.route(model, False) == 5
    assert not any(hasattr(layer, "takes_mma") or hasattr(layer, "takes_qmv") for layer in layers.values())
    assert {type(layer).__name__ for layer in layers.values()} == {"QuantizedLinear", "QuantizedEmbedding",
                                                                    "Linear"}


def test_a_pre_quantized_folder_loads_and_predicts_as_its_source(tmp_path, default_gguf):
    """synth --quantize 4: every product and the embedding quantized (affine, groups of 64) with
    ``config["quantization"]`` saying so; on a CPU the engine dequantizes it on load (no 4-bit decode
    kernel here) and scores within 4-bit rounding of the float folder, the same top token where the
    float one's two best are clearly apart."""
    import json

    import numpy as np
    from safetensors import safe_open

    from mesh_llm.bench.synth import write_pair, write_quantized

    folder, _ = write_pair("tiny", tmp_path, default_gguf, dtype="float32")
    quantized = write_quantized(folder, 4)
    assert quantized.name == "tiny-q4-mlx"
    assert json.loads((quantized / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 4}
    with safe_open(quantized / "model.safetensors", "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.down_proj.scales" in names and "model.embed_tokens.biases" in names
    assert not any(n.endswith("norm.scales") for n in names)
    engines = [MLXEngine.load(path, EngineOptions(warm_up=False, cache_bytes=0)) for path in (folder, quantized)]
    try:
        assert engines[1].info().details["quantization"] == "dequantized from 4-bit affine g64"
        assert "quantized_decode" not in engines[1].info().details
        ids = [(13 * i + 5) % 1000 + 10 for i in range(48)]
        source, ours = (e.score(ids) for e in engines)
        assert np.abs(ours - source).max() <= 0.15 * np.abs(source).max()  # measured 0.097
        top2 = np.sort(source, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(ours - source).max(-1)
        assert clear.any()
        assert (ours.argmax(-1) == source.argmax(-1))[clear].all()
    finally:
        for e in engines:
            e.close()


def test_a_prompt_read_through_dequantized_weights_holds_about_one_layers_at_a_time():
    """A prompt's chunk of ``DEQUANTIZED_ROWS`` rows or more is multiplied by dequantized weights;
    each layer's are made only once its input is ready, so the peak memory of reading it does not
    grow with the model's depth (MLX would otherwise dequantize layers ahead: without that order, 16
    more layers held 3 more layers' weights on this CPU)."""
    import mlx.core as mx
    from mlx import nn
    from mlx_lm.models import qwen2
    from mlx_lm.models.cache import make_prompt_cache

    from mesh_llm.engines.mlx.kernels import quantized as mlx_quantized

    def peak(layers: int) -> int:
        args = qwen2.ModelArgs(model_type="qwen2", hidden_size=512, num_hidden_layers=layers,
                               intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
                               rms_norm_eps=1e-6, vocab_size=1000, rope_theta=1e6, tie_word_embeddings=False)
        model = qwen2.Model(args)
        nn.quantize(model, 64, 4)
        mx.eval(model.parameters())
        mlx_quantized.route(model, True)  # (MLX's own CPU kernel would take half a minute here)
        cache = make_prompt_cache(model)
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        model(mx.array([list(range(mlx_quantized.DEQUANTIZED_ROWS + 44))]), cache=cache)
        mx.eval([c.state for c in cache])
        return mx.get_peak_memory() - base

    layer = 4 * (2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 2048)  # one layer's weights as float32
    kv = 2 * 4 * 128 * (mlx_quantized.DEQUANTIZED_ROWS + 44)  # a layer's keys and values
    shallow, deep = peak(8), peak(24)
    assert deep - shallow < 16 * kv + layer / 2, (shallow, deep, kv, layer)
    assert shallow < 3 * layer, (shallow, layer)  # all 8 layers would be 8
