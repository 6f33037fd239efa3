"""Decode attention for a batch of left-padded rows on CUDA, in one kernel.

A decode step of several sequences keeps their KV in mlx-lm's ``BatchKVCache``: rows of different
lengths are right-aligned and each row's first ``left_padding`` positions masked. MLX 0.32's CUDA
backend has a fused attention kernel for one query per row (``sdpa_vector``) but it takes no mask
array, so a masked step falls back to separate kernels per layer (scores, mask, softmax, product) and
a batch of 2 steps at 7.2 ms against 4.2 ms for one row (Qwen2.5-0.5B shape, H200, 2026-12-03). :func:`decode_attention` is that fused kernel with each row's start
as an input: one thread block per (row, query head), 8 or 32 warps walking the row's keys with an
online softmax, merged at the end; compiled once per shape and GPU architecture and kept on disk
(:mod:`mesh_llm.engines.mlx.kernels.nvrtc`). :func:`install` routes mlx-lm's attention to it for exactly that
case (one query per row, a ``BatchKVCache``, head size 64/96/128/256, no attention sinks, on CUDA,
on an architecture whose decode masks are known to be left padding alone: ``_VETTED``), and a prompt
chunk read under :func:`keys_in_steps` to :func:`prefill_in_steps`; every other call stays mlx-lm's.
"""

from __future__ import annotations

import contextvars
import struct
import sys
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mesh_llm.engines.mlx.kernels import nvrtc

# Warps a (row, head) block walks its keys with: 32 where the blocks are too few to fill an H200's 132
# multiprocessors (one row: 14 blocks on Qwen2.5-0.5B, 28 on 7B, where 8 warps took 72 and 78 us a
# layer against 20 and 22 for MLX's own one-row kernel, H200, 2026-12-03), else 8.
# The count is the launch's, not the code's: one binary serves every batch size.
_WARPS_FEW, _WARPS_MANY, _FEW_BLOCKS = 32, 8, 128
_HEAD_SIZES = (64, 96, 128, 256)
# mlx-lm architectures read: each layer holding a plain KV cache masks only its rows' left padding in
# a decode step (sliding-window layers hold rotating caches, which this never takes). Elsewhere a mask
# might carry more (a window over a plain cache), so other architectures keep mlx-lm's attention.
_VETTED = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma", "granite",
                     "olmo2", "smollm3"})

# Written against no header (16-bit floats converted by hand: ``nvrtc.TYPES``) so that NVRTC compiles
# it in a moment, once per architecture, and the binary is kept on disk (engines/mlx/kernels/nvrtc.py). Rows are
# contiguous (B, heads, capacity, D) buffers; row b reads positions starts[b] .. LENGTH - 1.
_SOURCE = """
extern "C" __global__ void NAME(const T* q, const T* k, const T* v, const int* starts, T* out,
                                int capacity, float scale, int length_given) {
    const int row_head = blockIdx.x;
    const int b = row_head / HQ;
    const int h = row_head % HQ;
    const int kv_head = h / (HQ / HKV);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int PER_LANE = D / 32;
    const int length = length_given;
    const int first = starts[b];
    const float inf = __int_as_float(0x7f800000);

    const T* qp = q + (long long)(b * HQ + h) * D + lane * PER_LANE;
    float qv[D / 32];
    for (int i = 0; i < PER_LANE; ++i) qv[i] = load(qp[i]) * scale;

    const long long row = (long long)(b * HKV + kv_head) * capacity * D + lane * PER_LANE;
    float m = -inf, l = 0.0f, acc[D / 32];
    for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.0f;
    for (int j = first + warp; j < length; j += warps) {
        const T* kj = k + row + (long long)j * D;
        float s = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) s += qv[i] * load(kj[i]);
        for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);
        const float p = expf(s - m_new);
        l = l * correction + p;
        const T* vj = v + row + (long long)j * D;
        for (int i = 0; i < PER_LANE; ++i) acc[i] = acc[i] * correction + p * load(vj[i]);
        m = m_new;
    }

    __shared__ float warp_max[32];
    __shared__ float warp_sum[32];
    __shared__ float warp_out[32][D];
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
    for (int i = 0; i < PER_LANE; ++i) warp_out[warp][lane * PER_LANE + i] = acc[i];
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float top = -inf;
        for (int w = 0; w < warps; ++w) top = fmaxf(top, warp_max[w]);
        float total = 0.0f, value = 0.0f;
        for (int w = 0; w < warps; ++w) {
            const float c = warp_max[w] == -inf ? 0.0f : expf(warp_max[w] - top);
            total += warp_sum[w] * c;
            value += warp_out[w][d] * c;
        }
        out[(long long)(b * HQ + h) * D + d] = store(value / total);
    }
}
"""

_binaries: dict[tuple, tuple[str, bytes]] = {}  # per shape: the kernel's name and cubin
KEY_STEP = 256  # positions a prompt chunk's keys are read in (mlx-lm's KVCache grows by as many)
_in_steps = contextvars.ContextVar("mesh_llm_keys_in_steps", default=False)



def kernel_source(name: str, dtype: mx.Dtype, heads: int, kv_heads: int, size: int) -> str:
    """The decode attention's CUDA source for one shape (rows read to the ``length`` given at launch)."""
    return (f"#define HQ {heads}\n#define HKV {kv_heads}\n#define D {size}\n"
            + nvrtc.TYPES[str(dtype).rsplit(".", 1)[-1]]
            + _SOURCE.replace("NAME", name))


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     starts: mx.array, length: int | None = None) -> mx.array:
    """Attention of one query per row, (B, Hq, 1, D), over the whole key and value buffers
    (B, Hkv, capacity, D): row ``b`` reads positions ``starts[b]`` to ``length - 1`` (default: the
    capacity). Returns (B, Hq, 1, D) in the queries' dtype."""
    batch, heads, _, size = queries.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    shape = (queries.dtype, heads, kv_heads, size)
    if shape not in _binaries:  # a dictionary look-up a call: this runs for every layer of every step
        name = f"mesh_llm_decode_attention_{str(queries.dtype).rsplit('.', 1)[-1]}_{heads}_{kv_heads}_{size}"
        _binaries[shape] = name, nvrtc.cubin(name, kernel_source(name, *shape))
    name, binary = _binaries[shape]
    warps = _WARPS_FEW if batch * heads <= _FEW_BLOCKS else _WARPS_MANY
    inputs = [queries, keys, values, starts.astype(mx.int32)]
    # MLX takes a float scalar only when float32 holds it exactly
    scale = struct.unpack("f", struct.pack("f", scale))[0]
    scalars = [capacity, scale, capacity if length is None else int(length)]
    (out,) = mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=binary, inputs=inputs, scalars=scalars,
        grid=(batch * heads * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype],
        ensure_row_contiguous=True,  # the kernel reads rows as contiguous; a cache's buffer is already
    )
    return out



@contextmanager
def keys_in_steps(on: bool = True):
    """Prompt chunks read in this block attend over their cache's keys in whole :data:`KEY_STEP`
    steps (:func:`prefill_in_steps`)."""
    token = _in_steps.set(on)
    try:
        yield
    finally:
        _in_steps.reset(token)


def prefill_in_steps(queries: mx.array, cache: KVCache, scale: float) -> mx.array:
    """A prompt chunk's causal attention over its cache's keys read up to the next multiple of
    :data:`KEY_STEP` positions, the rest masked. On CUDA MLX rebuilds its graphs for every new pair
    of chunk width and key count (cuBLAS picks other kernels for the scores' product); with chunks
    padded to a bucket and keys read in steps, prompts of any length make a few pairs, each built
    once."""
    width, end = queries.shape[2], cache.offset
    length = min(cache.keys.shape[2], -(-end // KEY_STEP) * KEY_STEP)
    mask = mx.arange(length)[None] <= mx.arange(end - width, end)[:, None]  # stale positions too
    return mx.fast.scaled_dot_product_attention(queries, cache.keys[..., :length, :],
                                                cache.values[..., :length, :], scale=scale, mask=mask)


def fused_here() -> bool:
    """Whether a batched decode step's attention is :func:`decode_attention` here: on CUDA with an
    NVRTC to build it."""
    return on_cuda() and nvrtc.available()


def on_cuda() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def _fits(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    return (queries.shape[2] == 1 and queries.shape[-1] in _HEAD_SIZES
            and keys.shape[-1] == queries.shape[-1] and queries.shape[1] % keys.shape[1] == 0
            and keys.dtype == values.dtype == queries.dtype
            and queries.dtype in (mx.float16, mx.bfloat16, mx.float32))


def applies(queries: mx.array, keys: mx.array, values: mx.array, cache, sinks) -> bool:
    """Whether :func:`decode_attention` stands in for mlx-lm's attention on this call: keys and values
    must be the first positions of the batch cache's buffers, which the kernel reads."""
    if type(cache) is not BatchKVCache or sinks is not None or not _fits(queries, keys, values):
        return False
    buffers = cache.keys, cache.values
    return all(b is not None and b.dtype == a.dtype and b.ndim == 4 and b.shape[:2] == a.shape[:2]
               and b.shape[3] == a.shape[3] and b.shape[2] >= a.shape[2] for a, b in zip((keys, values), buffers))


def install(model, in_steps: bool = False) -> bool:
    """Route the attention of ``model``'s architecture (its mlx-lm module's
    ``scaled_dot_product_attention``): a prompt chunk over a plain ``KVCache`` under
    :func:`keys_in_steps` (``in_steps``, any device) to :func:`prefill_in_steps`; and on CUDA a decode
    step over a ``BatchKVCache`` to :func:`decode_attention`. Every other call stays mlx-lm's.
    Returns whether the architecture's attention is routed."""
    fused = fused_here()
    if not (fused or in_steps):
        return False
    name = type(model).__module__
    module = sys.modules.get(name)
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None or name.rsplit(".", 1)[-1] not in _VETTED:
        return False
    original = getattr(original, "mesh_llm_original", original)

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if (_in_steps.get() and type(cache) is KVCache and isinstance(mask, str) and mask == "causal"
                and sinks is None and queries.shape[2] > 1):
            return prefill_in_steps(queries, cache, scale)
        if fused and applies(queries, keys, values, cache, sinks):
            # the cache's whole buffers, of which keys and values are the first positions
            return decode_attention(queries, cache.keys, cache.values, scale, cache.left_padding,
                                    length=keys.shape[2])
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    attention.mesh_llm_original = original
    module.scaled_dot_product_attention = attention
    return True


def routed(model) -> bool:
    """Whether :func:`install` has routed the attention of ``model``'s architecture."""
    module = sys.modules.get(type(model).__module__)
    return hasattr(getattr(module, "scaled_dot_product_attention", None), "mesh_llm_original")
