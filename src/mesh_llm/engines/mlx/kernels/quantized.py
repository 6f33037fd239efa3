"""Products of quantized weights on CUDA as a decode step and a prompt make them: MLX's kernels where
they are fast enough, mesh-llm's own where MLX's read the weights once per row or leave the GPU idle.

MLX 0.32's CUDA backend, with groups narrower than a row (every mlx-lm quantization; its Hopper
tiled kernel needs a group as wide as the input), multiplies quantized weights (read in its source,
``mlx/backend/cuda/quantized/``, and timed each call alone on an H100, 2026-12-05)
- by 1-7 rows with its vector kernel, once per row, so each row reads all the weights again (the
  4-bit 7B's 37,888 x 3,584 gate/up product: 77 / 150 / 295 us for 1 / 2 / 4 rows);
- by 8 rows and more with its Ampere tiled kernel (16 x 128 tiles), which reads them once but keeps
  few multiprocessors busy: 73 us for 8 rows, the 7B's down product 243 us (157 GB/s); a 4-bit 7B
  step of 8 rows spent 11.7 ms in it, where a 16-bit step's products take about 5.5; a 7B layer's
  products at a prompt's 640 rows 2.5 ms, against 0.9 through the dequantized weights;
- by a decode batch shaped (B, 1, k), as mlx-lm's layers pass it, as B products of one row.

:func:`product` makes a decode batch's rows one product and picks the kernel. :func:`qmm`
(tensor cores, 4-bit weights, float16 or bfloat16 rows, 1-16 of them) dequantizes each warp's 16
output rows into registers and multiplies them by up to 16 input rows with ``mma.sync``: 1.6-2.4
TB/s on the 7B's gate/up, down and output-layer products at 1-8 rows (38, 24 and 130 us for 8
rows). :func:`qmv` (CUDA cores, 4 or 8 bits, any float type, 1-8 rows) serves what qmm does not:
each warp a few output rows, its lanes walking the inputs 16 values at a time, summed in float32 as
``scale * dot(x, q) + bias * sum(x)``. Both are written against no header, compiled once per shape
and GPU architecture by NVRTC and kept on disk (:mod:`mesh_llm.engines.mlx.kernels.nvrtc`), as the decode
attention is. A call of either costs the host more than one of MLX's own, which is why one row, and
small weights, stay MLX's. A prompt's chunk of ``DEQUANTIZED_ROWS`` or more goes through the
dequantized weights and a 16-bit product. :func:`install` routes a model's ``QuantizedLinear`` and
``QuantizedEmbedding`` layers through :func:`product` on CUDA.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx import nn

from mesh_llm.engines.mlx.kernels import nvrtc
from mesh_llm.engines.mlx.kernels.attention import on_cuda

_GROUP_SIZES = (32, 64, 128)
_LANE = 16  # values a lane reads at a time (8 bytes at 4 bits, 16 at 8), within one group

# Eight values of a row (16 or 32 bytes) read at once and turned into floats, after the element type's
# conversions (``nvrtc.TYPES``).
_LOAD8 = {
    "float16": """__device__ __forceinline__ void load8(const T* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) { out[2 * i] = load((T)(w[i] & 0xffffu)); out[2 * i + 1] = load((T)(w[i] >> 16)); }
}
""",
    "bfloat16": """__device__ __forceinline__ void load8(const T* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) { out[2 * i] = __uint_as_float(w[i] << 16); out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
}
""",
    "float32": """__device__ __forceinline__ void load8(const T* p, float* out) {
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
            scale[r] = load(scales[row * groups + base / GS]);
            bias[r] = load(biases[row * groups + base / GS]);
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
UNROLL = 1  # iterations of the inputs' loop unrolled (2 and 4 were no faster on the H100)
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
            f"#define UNROLL {unroll}\n" + nvrtc.TYPES[dtype] + _LOAD8[dtype] + _SOURCE.replace("NAME", name))


def qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int = 4,
        per_warp: int | None = None, unroll: int = UNROLL) -> mx.array:
    """``x @ dequantize(w).T`` for 4- or 8-bit affine weights ``w`` (n, k * bits / 32) and 1-8 rows
    of ``x`` (..., k); returns (..., n) in ``x``'s dtype. ``per_warp`` and ``unroll`` (of the inputs'
    loop) override the tuned defaults, for comparing them."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    per_warp = per_warp or rows_per_warp(rows, n)
    shape = (x.dtype, bits, rows, per_warp, group_size, unroll)
    if shape not in _binaries:  # a look-up a call: this runs for every quantized product of a step
        dtype = str(x.dtype).rsplit(".", 1)[-1]
        name = f"mesh_llm_qmv{bits}_{dtype}_m{rows}_r{per_warp}_g{group_size}_u{unroll}"
        _binaries[shape] = name, nvrtc.cubin(name, kernel_source(name, dtype, *shape[1:]))
    return _launch(_binaries[shape], x, (w, scales, biases), [n, k], -(-n // (per_warp * _WARPS)))


def _launch(binary: tuple[str, bytes], x: mx.array, q: tuple, scalars: list[int], blocks: int,
            warps: int = _WARPS) -> mx.array:
    """One product kernel of ours over ``x``'s rows as one matrix (the kernel sees only pointers, so
    no reshape, which would be a node more to build): ``blocks`` blocks of ``warps`` warps; returns
    (..., n) in ``x``'s dtype."""
    name, cubin = binary
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin, inputs=[x, *q], scalars=scalars,
        grid=(blocks * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*x.shape[:-1], q[0].shape[0])], output_dtypes=[x.dtype], ensure_row_contiguous=True)[0]


# The same product on tensor cores, for 4-bit weights and float16 or bfloat16 rows (1-16): each warp
# dequantizes 16 output rows x 64 inputs into registers and multiplies them by 8 input rows at a time
# (``mma.sync`` m16n8k16, float32 sums). A lane's 16 inputs are contiguous (8 bytes of weights, 32 of
# x); the pairs the mma takes as neighbouring inputs are the pairs the unpacking makes, values v and
# v + 4 of each word, and x's halves are permuted to match (a dot product is blind to the order). A
# block's warps take turns over the inputs (64 each) for the same ``TILES`` x 16 outputs and add
# their sums at the end, so even 3,584 outputs make 224 blocks; where blocks are that few, they
# have more warps (:func:`mma_warps`).
_MMA_SOURCE = """
__device__ __forceinline__ unsigned int fma2(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d; asm("fma.rn." PAIR " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
__device__ __forceinline__ void mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                    unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." HALF "." HALF ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
extern "C" __global__ void NAME(const T* x, const unsigned int* w, const T* scales, const T* biases,
                                T* out, int n, int k, int m) {
    __shared__ float partial[WARPS][TILES * NT * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int first = blockIdx.x * TILES * 16;
    const int words = k / 8, groups = k / GS;
    float acc[TILES][NT][4];
    #pragma unroll
    for (int i = 0; i < TILES; ++i)
        #pragma unroll
        for (int j = 0; j < NT; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;
    #pragma unroll 1
    for (int c = warp * 64; c < k; c += WARPS * 64) {
        const int at = c + 16 * t;  // the lane's 16 inputs, in one group
        unsigned int b[NT][8];  // x row g + 8 nt: the pairs (v, v + 4) of each 8 inputs
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (g + 8 * j < m) {
                const T* p = x + (long long)(g + 8 * j) * k + at;
                const uint4 lo = *reinterpret_cast<const uint4*>(p), hi = *reinterpret_cast<const uint4*>(p + 8);
                b[j][0] = __byte_perm(lo.x, lo.z, 0x5410); b[j][1] = __byte_perm(lo.x, lo.z, 0x7632);
                b[j][2] = __byte_perm(lo.y, lo.w, 0x5410); b[j][3] = __byte_perm(lo.y, lo.w, 0x7632);
                b[j][4] = __byte_perm(hi.x, hi.z, 0x5410); b[j][5] = __byte_perm(hi.x, hi.z, 0x7632);
                b[j][6] = __byte_perm(hi.y, hi.w, 0x5410); b[j][7] = __byte_perm(hi.y, hi.w, 0x7632);
            } else {
                #pragma unroll
                for (int i = 0; i < 8; ++i) b[j][i] = 0u;
            }
        }
        #pragma unroll
        for (int i = 0; i < TILES; ++i) {
            unsigned int a[2][8];  // output rows g and g + 8: the same pairs of their weights
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long row = min(first + 16 * i + g + 8 * h, n - 1);
                const uint2 u = *reinterpret_cast<const uint2*>(w + row * words + at / 8);
                const unsigned int s = scales[row * groups + at / GS], o = biases[row * groups + at / GS];
                const unsigned int s2 = s | (s << 16), o2 = o | (o << 16), word[2] = {u.x, u.y};
                #pragma unroll
                for (int q = 0; q < 8; ++q) {  // 2^e + v as a float less 2^e: exact
                    const unsigned int v = ((word[q / 4] >> (4 * (q % 4))) & 0x000f000fu) | MAGIC;
                    a[h][q] = fma2(fma2(v, ONE, MINUS), s2, o2);
                }
            }
            #pragma unroll
            for (int j = 0; j < NT; ++j)
                #pragma unroll
                for (int q = 0; q < 4; ++q)
                    mma(acc[i][j], a[0][2 * q], a[1][2 * q], a[0][2 * q + 1], a[1][2 * q + 1],
                        b[j][2 * q], b[j][2 * q + 1]);
        }
    }
    #pragma unroll
    for (int i = 0; i < TILES; ++i)
        #pragma unroll
        for (int j = 0; j < NT; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) partial[warp][(i * NT + j) * 4 + r][lane] = acc[i][j][r];
    __syncthreads();
    if (warp != 0) return;
    #pragma unroll
    for (int i = 0; i < TILES; ++i)
        #pragma unroll
        for (int j = 0; j < NT; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                float sum = 0.0f;
                #pragma unroll
                for (int v = 0; v < WARPS; ++v) sum += partial[v][(i * NT + j) * 4 + r][lane];
                const int row = first + 16 * i + g + 8 * (r / 2), input = 8 * j + 2 * t + (r % 2);
                if (row < n && input < m) out[(long long)input * n + row] = store(sum);
            }
}
"""
# Per element type: the pair's PTX name, 2^e in both halves (the exponent leaving 4 bits of mantissa
# for v), -2^e and 1 in both halves.
_MMA_TYPES = {"float16": ('"f16x2"', '"f16"', "0x64006400u", "0xe400e400u", "0x3c003c00u"),
              "bfloat16": ('"bf16x2"', '"bf16"', "0x43004300u", "0xc300c300u", "0x3f803f80u")}


def mma_source(name: str, dtype: str, row_tiles: int, tiles: int, group_size: int, warps: int = _WARPS) -> str:
    pair, half, magic, minus, one = _MMA_TYPES[dtype]
    return (f"#define NT {row_tiles}\n#define TILES {tiles}\n#define GS {group_size}\n"
            f"#define WARPS {warps}\n#define PAIR {pair}\n#define HALF {half}\n#define MAGIC {magic}\n"
            f"#define MINUS {minus}\n#define ONE {one}\n" + nvrtc.TYPES[dtype] + _MMA_SOURCE.replace("NAME", name))


_MMA_IN_FLIGHT = 8192  # warps a product should have: about 62 a multiprocessor of an H100 (132)


def mma_warps(blocks: int, k: int) -> int:
    """A block's warps for :func:`qmm`: 4, doubled up to 16 while the product's warps are fewer than
    ``_MMA_IN_FLIGHT`` and each still takes 2 or more of the inputs' 64-wide steps. With 4, the 7B's
    down product (224 blocks) read its weights at 0.7 TB/s against 1.7-2.5 for the wide products:
    a warp or two a multiprocessor, each waiting on memory. With this rule, 1.6 TB/s; the 7B's q/k/v
    and o products (288 and 224 blocks) take 16 too, its gate/up 8, its output layer 4 (the fastest
    of 4, 8 and 16 for each on an H100, 2026-12-05)."""
    warps = _WARPS
    while warps < 16 and blocks * warps < _MMA_IN_FLIGHT and k // 64 >= 4 * warps:
        warps *= 2
    return warps


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
        warps: int | None = None) -> mx.array:
    """``x @ dequantize(w).T`` on tensor cores for 4-bit weights ``w`` (n, k / 8), 1-16 rows of a
    float16 or bfloat16 ``x`` (..., k), k a multiple of 64; returns (..., n) in ``x``'s dtype.
    ``warps`` (a block's) overrides :func:`mma_warps`, for comparing them."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    tiles = 2 if n >= 16 * 2 * 256 else 1  # 256 blocks or more either way
    blocks = -(-n // (16 * tiles))
    warps = warps or mma_warps(blocks, k)
    shape = ("mma", x.dtype, -(-rows // 8), tiles, group_size, warps)  # one binary for 1-8 rows, one for 9-16
    if shape not in _binaries:
        dtype = str(x.dtype).rsplit(".", 1)[-1]
        name = f"mesh_llm_qmm4_{dtype}_n{shape[2]}_t{tiles}_g{group_size}_w{warps}"
        _binaries[shape] = name, nvrtc.cubin(name, mma_source(name, dtype, *shape[2:]))
    return _launch(_binaries[shape], x, (w, scales, biases), [n, k, rows], blocks, warps)


def fits(layer: nn.QuantizedLinear | nn.QuantizedEmbedding) -> bool:
    """A layer :func:`qmv` can serve: 4- or 8-bit affine weights in groups it reads whole."""
    k = layer.weight.shape[-1] * 32 // layer.bits
    return (layer.bits in (4, 8) and getattr(layer, "mode", "affine") == "affine" and layer.get("biases") is not None
            and layer.group_size in _GROUP_SIZES and k % _LANE == 0 and layer.weight.ndim == 2
            and layer.scales.dtype in (mx.float16, mx.bfloat16, mx.float32))


def fits_mma(layer: nn.QuantizedLinear | nn.QuantizedEmbedding) -> bool:
    """A layer :func:`qmm` can serve: 4-bit affine weights of half types, inputs a multiple of 64."""
    return fits(layer) and layer.bits == 4 and layer.scales.dtype in (mx.float16, mx.bfloat16) and (
        layer.weight.shape[-1] * 8 % 64 == 0)


@functools.cache
def tensor_cores() -> bool:
    """This GPU runs :func:`qmm`: ``mma.sync`` m16n8k16 on half types, from compute capability 8.0."""
    return mx.device_info().get("compute_capability_major", 0) >= 8


_TILED_ROWS = 8  # from this many rows MLX uses its tiled kernel (qmm_sm80), which reads the weights once
MMA_ROWS = range(1, 17)  # rows routed to :func:`qmm` where the layer fits it (two tiles of 8)
# A call of our kernels costs the host more than one of MLX's, and where a step waits on the host that
# outweighs their faster products: on an H100 (2026-12-05), routing the 0.5B shape's 8 and 16 rows through qmm
# made its steps 8.98-10.73 ms against 4.86-7.53, though the steps took 2.90-3.48 ms of GPU
# against 4.50-4.71. So they take only weights large enough: 2-7 rows where (rows - 1) x the weights'
# bytes reach KERNEL_BYTES (MLX reads them once per row there), and qmm only weights of MMA_BYTES or
# more, which are the 7B's products (its q/k/v and gate/up fused, o, down, output layer) and of the
# 0.5B's only its output layer.
KERNEL_BYTES = 16 * 2**20
MMA_BYTES = 6 * 2**20
# One row: MLX's vector kernel reads the 7B's weights at ~970 GB/s, and qmm took its step's GPU time
# from 5.6 to 4.6 ms, but added 1.6 ms of the host's on that H100, so one row is MLX's unless a
# weight reaches this size (never, until measured on a quicker host).
ONE_ROW_BYTES = 1 << 62
# A prompt's chunk: MLX's tiled kernel made a 4-bit 7B's 640-token prompt take twice the 16-bit one's
# time (106 against 46 ms to the first token, H100), so from this many rows the weights are
# dequantized and multiplied as 16-bit ones are: a 7B layer's products at 64 / 256 / 640 rows took
# 0.69 / 0.97 / 2.51 ms through MLX's kernels, 0.68 / 0.71 / 0.91 so, and the 4-bit TTFT came to
# 1.3x the 16-bit one. Each
# layer's are made only once its input is ready, so a prompt holds about one layer's at a time
# (tests/engines/test_mlx_quantized.py).
DEQUANTIZED_ROWS = 256


def product(layer, x: mx.array) -> mx.array:
    """``x @ dequantize(layer).T`` as one product of all the rows of ``x``: MLX 0.32 takes a decode
    batch of shape (B, 1, k) as B products of one row, each reading all the weights, so such rows are
    flattened first (one sequence's (1, L, k) is left as it is: no extra nodes in its graph)."""
    k = x.shape[-1]
    rows = x.size // k
    q = (layer["weight"], layer["scales"], layer.get("biases"))
    if rows >= DEQUANTIZED_ROWS:
        w = mx.depends(q[0], x)  # not before x: MLX would dequantize layers ahead, holding them all
        return x @ mx.dequantize(w, *q[1:], group_size=layer.group_size, bits=layer.bits, mode=layer.mode).T
    size = q[0].nbytes
    enough = size >= ONE_ROW_BYTES if rows == 1 else (rows - 1) * size >= KERNEL_BYTES
    ours = enough and x.dtype == layer.scales.dtype
    if ours and rows in MMA_ROWS and size >= MMA_BYTES and layer.takes_mma:
        return qmm(x, *q, layer.group_size)
    if ours and 1 < rows < _TILED_ROWS and layer.takes_qmv:
        return qmv(x, *q, layer.group_size, layer.bits)
    flat = x if x.ndim < 3 or x.shape[-2] == rows else x.reshape(rows, k)
    out = mx.quantized_matmul(flat, *q, transpose=True, group_size=layer.group_size, bits=layer.bits,
                              mode=layer.mode)
    return out if flat is x else out.reshape(*x.shape[:-1], out.shape[-1])


class DecodeQuantizedLinear(nn.QuantizedLinear):
    """A quantized layer whose products go through :func:`product`."""

    def __call__(self, x: mx.array) -> mx.array:
        out = product(self, x)
        return out + self["bias"] if "bias" in self else out


class DecodeQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose product as the output layer (tied weights) goes through :func:`product`."""

    def as_linear(self, x: mx.array) -> mx.array:
        return product(self, x)


_ROUTES = {nn.QuantizedLinear: DecodeQuantizedLinear, nn.QuantizedEmbedding: DecodeQuantizedEmbedding}


def install(model: nn.Module) -> int:
    """Route the products of ``model``'s quantized layers through :func:`product` on CUDA (with an
    NVRTC to build our kernels); returns how many layers."""
    if not on_cuda() or not nvrtc.available():
        return 0
    return route(model, True)


def route(model: nn.Module, on: bool) -> int:
    """Set each quantized layer's class to its routed class (``on``), with which of our kernels fit
    it worked out once (the host's time a product counts), or back; returns how many."""
    routed = 0
    for _, module in model.named_modules():
        for plain, decode in _ROUTES.items():
            if type(module) is (plain if on else decode):
                module.__class__ = decode if on else plain
                if on:
                    module.takes_mma, module.takes_qmv = fits_mma(module) and tensor_cores(), fits(module)
                else:
                    del module.takes_mma, module.takes_qmv
                routed += 1
    return routed
