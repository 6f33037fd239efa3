"""mlx-lm's llama, qwen2 and qwen3 layers re-stated to run fewer kernels a token on a GPU.

On a GPU, MLX's one-stream decode is bound by the host: a kernel costs 6-13 µs to hand over, a biased
cuBLASLt product more, and a llama or qwen2 layer ran 17 kernels a token. Here:
- q, k and v are one product (one ``Linear`` over the concatenated weights, then split into views),
  gate and up another, and q and k take their rotary embedding in one call where no per-head norm
  (qwen3's) comes between (:func:`fuse_projections`);
- each residual sum and the RMS norm that reads it are one kernel (:func:`add_rms_norm`): a block
  takes its input normed already and hands the next block (or the model's final norm) its output
  normed, so a layer's two additions and two norms become two kernels (:func:`fuse_norms`).

On the H200, Qwen2.5-0.5B shape, one stream, alternated in one call (``benchmarks/gpu_fused_proj.py``,
``benchmarks/results/h200-host-20261203/machine-d/``), the fused projections alone: 412 → 340 kernels
a token, their GPU time 1.91 → 1.49 ms; a step 5.09 → 3.31 and 4.18 → 3.11 ms (197 → 302 and 239 →
321 tok/s); float16 logits bit for bit the same. The rotary embedding in one call and the fused norms
came after that run: 340 → 316 → 268 kernels a token predicted.

The weights are concatenated once at load, before they are read, and the separate ones dropped, so
memory does not grow. The engine does it on a GPU only: a CPU's step is bound by arithmetic, and
there the fused product rounds differently (float32 logits within 3.5e-6 of their size, measured on
the embedded SmolLM2), so the CPU keeps its results as they were. Only mlx-lm's own llama, qwen2
and qwen3 modules with float weights and plain RMS norms are re-stated here (``_MODULES``); every
other layer is left as it is. ``MESH_LLM_FUSED_PROJECTIONS=0`` keeps the products separate,
``MESH_LLM_FUSED_NORMS=0`` the sums and norms.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
from mlx import nn
from mlx_lm.models.activations import swiglu

from mesh_llm.engines.mlx_attention import on_cuda

# mlx-lm model modules whose Attention, MLP and inner model's __call__ are re-stated below, with that
# inner model's class (mistral models load through llama's module; qwen3's attention adds a norm of
# each head's q and k)
_MODULES = {"llama": "LlamaModel", "qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}
_fused_classes: dict[type, type] = {}


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of every layer that takes it; returns how many layers did."""
    module = _module(model, "MESH_LLM_FUSED_PROJECTIONS")
    if module is None:
        return 0
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (type(attn) is not getattr(module, "Attention", None)
                or type(mlp) is not getattr(module, "MLP", None)):
            continue
        parts = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if any(type(p) is not nn.Linear for p in parts):  # quantized: left as it is
            continue
        attn.qkv_proj, attn.head_size = _concatenated(parts[:3]), attn.q_proj.weight.shape[0] // attn.n_heads
        mlp.gate_up_proj = _concatenated(parts[3:])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        attn.__class__ = _fused_class(type(attn), {"__call__": _attention, "_module": module})
        mlp.__class__ = _fused_class(type(mlp), {"__call__": _mlp})
        fused += 1
    return fused


def fuse_norms(model: nn.Module) -> int:
    """Fuse each residual sum with the RMS norm that reads it, where every layer of the model is
    mlx-lm's block with plain RMS norms and all attend over the whole context (no sliding window);
    returns how many layers did."""
    module = _module(model, "MESH_LLM_FUSED_NORMS")
    inner = getattr(model, "model", None)
    if module is None or type(inner) is not getattr(module, _MODULES[module.__name__.rsplit(".", 1)[-1]], None):
        return 0
    layers = getattr(inner, "layers", [])
    block = getattr(module, "TransformerBlock", None)
    norms = [inner.norm] + [n for layer in layers for n in (getattr(layer, "input_layernorm", None),
                                                            getattr(layer, "post_attention_layernorm", None))]
    if (not layers or getattr(inner, "swa_idx", None) is not None
            or any(type(layer) is not block for layer in layers) or any(type(n) is not nn.RMSNorm for n in norms)):
        return 0
    inner.__class__ = _fused_class(type(inner), {"__call__": _model, "_module": module})
    for layer in layers:
        layer.__class__ = _fused_class(type(layer), {"step": _block})
    return len(layers)


def _module(model: nn.Module, switch: str):
    """The mlx-lm module of ``model``'s architecture where it is one re-stated here, unless the
    environment variable ``switch`` is 0."""
    if os.environ.get(switch, "1") == "0":
        return None
    name = type(model).__module__
    return sys.modules.get(name) if name.rsplit(".", 1)[-1] in _MODULES else None


def _concatenated(parts: list[nn.Linear]) -> nn.Linear:
    out = nn.Linear(1, 1, bias="bias" in parts[0])
    out.weight = mx.concatenate([p.weight for p in parts])
    if "bias" in parts[0]:
        out.bias = mx.concatenate([p.bias for p in parts])
    return out


def _fused_class(base: type, members: dict) -> type:
    if base not in _fused_classes:
        _fused_classes[base] = type("Fused" + base.__name__, (base,), members)
    return _fused_classes[base]


def _attention(self, x: mx.array, mask=None, cache=None) -> mx.array:
    """mlx-lm's llama, qwen2 and qwen3 attention, with q, k and v taken from one product, and q and
    k given their rotary embedding in one call where no per-head norm (qwen3's) comes between."""
    batch, length, _ = x.shape
    heads = self.qkv_proj(x).reshape(batch, length, -1, self.head_size)  # q, k and v heads in a row
    offset = cache.offset if cache is not None else 0
    n, kv = self.n_heads, self.n_heads + self.n_kv_heads
    if "q_norm" in self:  # qwen3
        queries = self.rope(self.q_norm(heads[:, :, :n]).transpose(0, 2, 1, 3), offset=offset)
        keys = self.rope(self.k_norm(heads[:, :, n:kv]).transpose(0, 2, 1, 3), offset=offset)
    else:
        qk = self.rope(heads[:, :, :kv].transpose(0, 2, 1, 3), offset=offset)
        queries, keys = qk[:, :n], qk[:, n:]
    values = heads[:, :, kv:].transpose(0, 2, 1, 3)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    # the module's own function, looked up now: mlx_attention may have routed it
    out = self._module.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                                    mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def _mlp(self, x: mx.array) -> mx.array:
    gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
    return self.down_proj(swiglu(gate, up))


def _model(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
    """mlx-lm's llama, qwen2 and qwen3 inner model, each block given its input normed already."""
    if getattr(self, "pipeline_size", 1) > 1:  # qwen2's layers split across processes: mlx-lm's loop
        return super(type(self), self).__call__(inputs, cache, input_embeddings)
    h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
    cache = cache if cache is not None else [None] * len(self.layers)
    mask = self._module.create_attention_mask(h, cache[0])
    normed = self.layers[0].input_layernorm(h)
    following = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
    for layer, layer_cache, norm in zip(self.layers, cache, following):
        h, normed = layer.step(h, normed, mask, layer_cache, norm)
    return normed


def _block(self, x: mx.array, normed: mx.array, mask, cache, following: nn.RMSNorm):
    """mlx-lm's block from its input ``x`` and that input normed; returns its output and that output
    normed by ``following`` (the next block's input norm or the model's final one)."""
    h, normed = add_rms_norm(x, self.self_attn(normed, mask, cache), self.post_attention_layernorm)
    return add_rms_norm(h, self.mlp(normed), following)


def add_rms_norm(x: mx.array, r: mx.array, norm: nn.RMSNorm) -> tuple[mx.array, mx.array]:
    """``x + r`` and that sum normed by ``norm``: one kernel on CUDA (rounded as MLX's addition and
    ``rms_norm`` round, the sum of squares in another order), two elsewhere."""
    weight = norm.weight
    if not (on_cuda() and x.shape == r.shape and x.size and x.dtype == r.dtype == weight.dtype
            and x.dtype in (mx.float16, mx.bfloat16, mx.float32) and weight.shape == x.shape[-1:]):
        h = x + r
        return h, mx.fast.rms_norm(h, weight, norm.eps)
    size = x.shape[-1]
    if norm.eps not in _norm_kernels:
        _norm_kernels[norm.eps] = mx.fast.cuda_kernel(
            name=f"mesh_llm_add_rms_norm_{len(_norm_kernels)}",
            input_names=["x", "r", "w"],
            output_names=["h", "y"],
            source=_ADD_RMS_NORM.replace("EPS", f"{norm.eps:.9e}f"),
        )
    threads = min(1024, -(-size // 128) * 32)  # about 4 elements a thread, whole warps
    h, y = _norm_kernels[norm.eps](
        inputs=[x, r, weight],
        template=[("T", x.dtype), ("N", size)],
        grid=(x.size // size * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, y


# One block a row: the sum written as MLX's addition rounds it (a sum of two 16-bit values rounded once
# through float is their correctly rounded sum), its squares summed in float, then MLX's rms_norm
# rounding: the normed value rounded to T, times the weight, rounded again.
_ADD_RMS_NORM = """
    const size_t base = size_t(blockIdx.x) * N;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const T value = static_cast<T>(static_cast<float>(x[base + i]) + static_cast<float>(r[base + i]));
        h[base + i] = value;
        const float f = static_cast<float>(value);
        sum += f * f;
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    __shared__ float warp_sums[32];
    __shared__ float total;
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        sum = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
        if (lane == 0) total = sum;
    }
    __syncthreads();
    const float scale = rsqrtf(total / N + EPS);
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const T normed = static_cast<T>(static_cast<float>(h[base + i]) * scale);
        y[base + i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
    }
"""
_norm_kernels: dict[float, object] = {}
