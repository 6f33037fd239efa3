"""Decode products of 4- and 8-bit weights on CUDA, in one kernel that reads each weight once.

MLX 0.32's CUDA backend multiplies a few rows by quantized weights with its vector kernel (``qmv``)
only for one row and at most 16,384 outputs and inputs; every other case (an MLP's 18,944-wide
products on Qwen2.5-7B, its output layer, any batch of 2-8 rows) goes to the tiled tensor-core kernel
made for prompts. On the H200 a 4-bit 7B decoded one row at 176 tok/s against 195 at 16 bits, and 8
rows at 298 against 916 (``benchmarks/GPU.md``), where a quarter of the weights' bytes should make it
faster.

:func:`qmv` is that product for 1-8 rows of any width: each warp takes a few output rows, its lanes
walk the inputs 16 weights at a time (within one group's scale and bias), the values turned into
floats by bit arithmetic and summed in float32 as ``scale * dot(x, q) + bias * sum(x)``. It is written
against no header and compiled once per shape and GPU architecture by NVRTC, its binary kept on disk
(:mod:`mesh_llm.engines.nvrtc`), as the decode attention is. :func:`install` routes a model's 4- and
8-bit ``QuantizedLinear`` and ``QuantizedEmbedding`` layers (affine, groups of 32, 64 or 128) to it
for inputs of at most :data:`MAX_ROWS` rows on CUDA; prompts keep MLX's kernel.
``MESH_LLM_QUANTIZED_DECODE=0`` leaves every layer as it is.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx import nn

from mesh_llm.engines import nvrtc
from mesh_llm.engines.mlx_attention import on_cuda

MAX_ROWS = 8  # a decode step's rows; more go to MLX's tiled kernel, made for them
_GROUP_SIZES = (32, 64, 128)
_LANE = 16  # weights a lane reads at a time: 8 bytes, within one group of any size above

# 16-bit rows are read 8 values (16 bytes) at a time and turned into floats by hand, so that NVRTC
# needs no header.
_TYPES = {
    "float16": """typedef unsigned short T;
__device__ __forceinline__ float load1(T x) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
__device__ __forceinline__ T store(float x) {
    T h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h; }
__device__ __forceinline__ void load8(const T* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) { out[2 * i] = load1((T)(w[i] & 0xffffu)); out[2 * i + 1] = load1((T)(w[i] >> 16)); }
}
""",
    "bfloat16": """typedef unsigned short T;
__device__ __forceinline__ float load1(T x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ T store(float x) {  // round to nearest even, as MLX does
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40u);
    return (T)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
__device__ __forceinline__ void load8(const T* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) { out[2 * i] = __uint_as_float(w[i] << 16); out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
}
""",
    "float32": """typedef float T;
__device__ __forceinline__ float load1(T x) { return x; }
__device__ __forceinline__ T store(float x) { return x; }
__device__ __forceinline__ void load8(const T* p, float* out) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
""",
}

# x (M, k) rows, w (n, k * BITS / 32) words of 32 / BITS values (the first in the low bits), scales
# and biases (n, k / GS); out (M, n). Warp ``w`` of block ``b`` computes outputs R * (b * warps + w) on.
_SOURCE = """
#define WORDS (BITS / 2)  // a lane's 16 values
struct Pack { unsigned int v[WORDS]; };
extern "C" __global__ void NAME(const T* x, const unsigned int* w, const T* scales, const T* biases,
                                T* out, int n, int k) {
    const int lane = threadIdx.x & 31;
    const int first = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (first >= n) return;
    const int words = k / (32 / BITS), groups = k / GS;
    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    #pragma unroll UNROLL
    for (int base = lane * 16; base < k; base += 32 * 16) {
        Pack packed[R];
        float scale[R], bias[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {  // every row's loads first: R requests in flight
            const long long row = min(first + r, n - 1);
            const unsigned int* p = w + row * words + base / (32 / BITS);
#if BITS == 4
            const uint2 u = *reinterpret_cast<const uint2*>(p);
            packed[r].v[0] = u.x; packed[r].v[1] = u.y;
#else
            const uint4 u = *reinterpret_cast<const uint4*>(p);
            packed[r].v[0] = u.x; packed[r].v[1] = u.y; packed[r].v[2] = u.z; packed[r].v[3] = u.w;
#endif
            scale[r] = load1(scales[row * groups + base / GS]);
            bias[r] = load1(biases[row * groups + base / GS]);
        }
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            float xs[M][8], total[M];
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                load8(x + (long long)m * k + base + 8 * half, xs[m]);
                total[m] = 0.0f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) total[m] += xs[m][i];
            }
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                float q[8];  // 2^23 + v as a float, less 2^23: exact for v below 2^23
                #pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int at = (8 * half + i) * BITS;
                    const unsigned int v = (packed[r].v[at / 32] >> (at % 32)) & ((1u << BITS) - 1u);
                    q[i] = __int_as_float(0x4b000000 | v) - 8388608.0f;
                }
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    float dot = 0.0f;
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(xs[m][i], q[i], dot);
                    acc[r][m] = fmaf(scale[r], dot, fmaf(bias[r], total[m], acc[r][m]));
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int m = 0; m < M; ++m)
            #pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1)
                acc[r][m] += __shfl_xor_sync(0xffffffff, acc[r][m], offset);
    if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < R; ++r)
            #pragma unroll
            for (int m = 0; m < M; ++m)
                if (first + r < n) out[(long long)m * n + first + r] = store(acc[r][m]);
    }
}
"""

_WARPS = 4  # a block's warps
UNROLL = 2  # iterations of the inputs' loop unrolled: the next weights' loads issued early
_binaries: dict[tuple, tuple[str, bytes]] = {}  # per shape: the kernel's name and cubin


def rows_per_warp(rows: int, outputs: int) -> int:
    """Output rows a warp computes: several share the lanes' inputs (fewer reads of x) where the
    outputs are many enough to keep every multiprocessor busy."""
    if outputs <= 4096:
        return 1
    return 4 if rows <= 2 else 2


def kernel_source(name: str, dtype: str, bits: int, rows: int, per_warp: int, group_size: int,
                  unroll: int = 1) -> str:
    return (f"#define BITS {bits}\n#define M {rows}\n#define R {per_warp}\n#define GS {group_size}\n"
            f"#define UNROLL {unroll}\n" + _TYPES[dtype] + _SOURCE.replace("NAME", name))


def qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int = 4,
        per_warp: int | None = None, unroll: int = UNROLL) -> mx.array:
    """``x @ dequantize(w).T`` for 4- or 8-bit affine weights ``w`` (n, k * bits / 32) and 1-8 rows
    of ``x`` (..., k); returns (..., n) in ``x``'s dtype. ``per_warp`` and ``unroll`` (of the inputs'
    loop) are for benchmarks/gpu_qmv.py to compare."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    dtype = str(x.dtype).rsplit(".", 1)[-1]
    per_warp = per_warp or rows_per_warp(rows, n)
    shape = (dtype, bits, rows, per_warp, group_size, unroll)
    if shape not in _binaries:
        name = f"mesh_llm_qmv{bits}_{dtype}_m{rows}_r{per_warp}_g{group_size}_u{unroll}"
        _binaries[shape] = name, nvrtc.cubin(name, kernel_source(name, *shape))
    name, binary = _binaries[shape]
    blocks = -(-n // (per_warp * _WARPS))
    (out,) = mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=binary, inputs=[x.reshape(rows, k), w, scales, biases], scalars=[n, k],
        grid=(blocks * 32 * _WARPS, 1, 1), threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype], ensure_row_contiguous=True)
    return out.reshape(*x.shape[:-1], n)


def fits(layer: nn.QuantizedLinear | nn.QuantizedEmbedding) -> bool:
    """A layer :func:`qmv` can serve: 4- or 8-bit affine weights in groups it reads whole."""
    k = layer.weight.shape[-1] * 32 // layer.bits
    return (layer.bits in (4, 8) and getattr(layer, "mode", "affine") == "affine" and layer.get("biases") is not None
            and layer.group_size in _GROUP_SIZES and k % _LANE == 0 and layer.weight.ndim == 2
            and layer.scales.dtype in (mx.float16, mx.bfloat16, mx.float32))


def _decodes(x: mx.array, layer) -> bool:
    return x.size <= MAX_ROWS * x.shape[-1] and x.dtype == layer.scales.dtype


class DecodeQuantizedLinear(nn.QuantizedLinear):
    """A quantized layer whose decode products (at most :data:`MAX_ROWS` rows) run :func:`qmv`."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _decodes(x, self):
            return super().__call__(x)
        out = qmv(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        return out + self["bias"] if "bias" in self else out


class DecodeQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose product as the output layer (tied weights) runs :func:`qmv` in decode."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _decodes(x, self):
            return super().as_linear(x)
        return qmv(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)


_ROUTES = {nn.QuantizedLinear: DecodeQuantizedLinear, nn.QuantizedEmbedding: DecodeQuantizedEmbedding}


def install(model: nn.Module) -> int:
    """Route the decode products of ``model``'s 4- and 8-bit layers to :func:`qmv` on CUDA (with an NVRTC to
    build it), unless ``MESH_LLM_QUANTIZED_DECODE=0``; returns how many layers were routed."""
    if os.environ.get("MESH_LLM_QUANTIZED_DECODE", "1") == "0" or not on_cuda() or not nvrtc.available():
        return 0
    return route(model, True)


def route(model: nn.Module, on: bool) -> int:
    """Set each fitting quantized layer's class to its decode class (``on``) or back; returns how many."""
    routed = 0
    for _, module in model.named_modules():
        for plain, decode in _ROUTES.items():
            if type(module) is (plain if on else decode) and fits(module):
                module.__class__ = decode if on else plain
                routed += 1
    return routed
