"""Decode-time products of a few activation rows with a small float weight matrix on CUDA, in one kernel.

A decode step of several sequences multiplies a few rows (one per sequence) by every weight matrix.
MLX 0.32's CUDA backend has a matrix-vector kernel for one row and sends 2 rows and more to cuBLAS,
whose products of a few rows with a small matrix cost nearly as much as with a large one (the 0.5B
shape's 896x896 layer: 18-25 us for 2-8 rows, against 6.4 us for one). :func:`matmul_t` computes
``x @ w.T`` for 2 to ``MAX_ROWS`` rows in one pass over the weights: 16-byte loads, four weight rows
per warp sharing each activation load, float accumulation, the bias added in the same pass. It is
used only where it measured faster on the H200 (``benchmarks/gpu_gemv.py``,
``benchmarks/results/h200-gemv-20261203/``): weights of at most ``MAX_WEIGHT_BYTES``. One row stays
on MLX's kernel, which leads there, and so do large matrices, where cuBLAS leads from 4 rows on (the
7B shape's 18944x3584 layers: 84 against 155 us at 8 rows; a whole 7B step at 8 rows took 16-17 ms
with the kernel on every layer against 8.5-8.9 ms without). :func:`install` swaps a model's float
``nn.Linear`` layers (and a tied embedding's ``as_linear``) to it; every other call, and every
quantized layer, keeps MLX's own product. ``MESH_LLM_FUSED_GEMV=0`` turns it off.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 8
MAX_WEIGHT_BYTES = 16 * 2**20  # the 0.5B shape's layers (at most 8.7 MB) and the 7B shape's k/v (3.7 MB)
_WARPS = 4  # warps per block
_WROWS = 4  # weight rows per warp
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

_SOURCE = """
    constexpr int VEC = 16 / sizeof(T);  // elements in one 16-byte load
    constexpr int CHUNKS = K / VEC;
    const int rows = x_shape[0];
    const int n_out = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int first = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * WROWS;
    if (first >= n_out) return;  // the whole warp

    const T* wr[WROWS];
#pragma unroll
    for (int r = 0; r < WROWS; ++r) wr[r] = w + (size_t)min(first + r, n_out - 1) * K;
    float acc[WROWS][MAXM];
#pragma unroll
    for (int r = 0; r < WROWS; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.0f;

    const bool aligned = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w)) & 15) == 0;
    if (aligned) {
#pragma unroll 2
        for (int c = lane; c < CHUNKS; c += 32) {
            uint4 wv[WROWS];
#pragma unroll
            for (int r = 0; r < WROWS; ++r) wv[r] = __ldg(reinterpret_cast<const uint4*>(wr[r]) + c);
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m < rows) {
                    const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K) + c);
                    const T* xs = reinterpret_cast<const T*>(&xv);
#pragma unroll
                    for (int r = 0; r < WROWS; ++r) {
                        const T* ws = reinterpret_cast<const T*>(&wv[r]);
                        float s = acc[r][m];
#pragma unroll
                        for (int i = 0; i < VEC; ++i) s += static_cast<float>(ws[i]) * static_cast<float>(xs[i]);
                        acc[r][m] = s;
                    }
                }
            }
        }
    } else {  // a view at an odd offset: element by element, still correct
        for (int k = lane; k < K; k += 32) {
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m < rows) {
                    const float xk = static_cast<float>(x[(size_t)m * K + k]);
#pragma unroll
                    for (int r = 0; r < WROWS; ++r) acc[r][m] += static_cast<float>(wr[r][k]) * xk;
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            float s = acc[r][m];
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
            acc[r][m] = s;
        }
    }
    // every lane holds every sum now: lane r * MAXM + m writes row r's product with activation m
#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            const int n = first + r;
            if (lane == r * MAXM + m && n < n_out && m < rows) {
                out[(size_t)m * n_out + n] = static_cast<T>(acc[r][m] BIAS);
            }
        }
    }
"""

_kernels: dict[bool, object] = {}
_templates: dict[tuple, list] = {}


def _kernel(has_bias: bool):
    if has_bias not in _kernels:
        _kernels[has_bias] = mx.fast.cuda_kernel(
            name="mesh_llm_gemv_bias" if has_bias else "mesh_llm_gemv",
            input_names=["x", "w", "bias"] if has_bias else ["x", "w"],
            output_names=["out"],
            source=_SOURCE.replace("BIAS", "+ static_cast<float>(bias[n])" if has_bias else ""),
        )
    return _kernels[has_bias]


def applies(x: mx.array, w: mx.array) -> bool:
    """Whether :func:`matmul_t` computes ``x @ w.T`` for these operands."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    return (2 <= rows <= MAX_ROWS and w.ndim == 2 and w.nbytes <= MAX_WEIGHT_BYTES
            and x.shape[-1] == w.shape[1] and x.dtype == w.dtype and w.dtype in _DTYPES
            and w.shape[1] % (16 // w.dtype.size) == 0)


def matmul_t(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ w.T (+ bias)`` for x (..., K) with at most ``MAX_ROWS`` rows and w (N, K), as MLX's own
    product gives it up to float rounding (accumulated in float32)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    rows, n = flat.shape[0], w.shape[0]
    inputs = [flat, w] if bias is None else [flat, w, bias if bias.dtype == x.dtype else bias.astype(x.dtype)]
    blocks = -(-n // (_WARPS * _WROWS))
    key = (x.dtype, k)
    if (template := _templates.get(key)) is None:  # built once: a model makes hundreds of calls a step
        template = _templates[key] = [("T", x.dtype), ("K", k), ("MAXM", MAX_ROWS), ("WARPS", _WARPS),
                                      ("WROWS", _WROWS)]
    (out,) = _kernel(bias is not None)(
        inputs=inputs,
        template=template,
        grid=(blocks * 32 * _WARPS, 1, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)


class FastLinear(nn.Linear):
    """An ``nn.Linear`` whose calls of 2 to ``MAX_ROWS`` rows use :func:`matmul_t` where it applies."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        if applies(x, w):
            return matmul_t(x, w, self["bias"] if "bias" in self else None)
        return super().__call__(x)


class FastEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose ``as_linear`` (tied output weights) uses :func:`matmul_t`."""

    def as_linear(self, x: mx.array) -> mx.array:
        if applies(x, self.weight):
            return matmul_t(x, self.weight)
        return super().as_linear(x)


def install(model: nn.Module) -> int:
    """Swap ``model``'s float linear layers to :class:`FastLinear` (and embeddings to
    :class:`FastEmbedding`), on CUDA only, unless ``MESH_LLM_FUSED_GEMV=0``. Returns how many."""
    if os.environ.get("MESH_LLM_FUSED_GEMV", "1") == "0":
        return 0
    if not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        return 0
    swapped = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.dtype in _DTYPES:
            module.__class__ = FastLinear
            swapped += 1
        elif type(module) is nn.Embedding and module.weight.dtype in _DTYPES:
            module.__class__ = FastEmbedding
            swapped += 1
    return swapped
