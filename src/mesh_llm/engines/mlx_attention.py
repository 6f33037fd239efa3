"""Decode attention for a batch of left-padded rows on CUDA, in one kernel.

A decode step of several sequences keeps their KV in mlx-lm's ``BatchKVCache``: rows of different
lengths are right-aligned and each row's first ``left_padding`` positions masked. MLX 0.32's CUDA
backend has a fused attention kernel for one query per row (``sdpa_vector``) but it takes no mask
array, so a masked step falls back to separate kernels per layer (scores, mask, softmax, product) and
a batch of 2 steps at 7.2 ms against 4.2 ms for one row (Qwen2.5-0.5B shape, H200,
``benchmarks/gpu_mlx_step.py``). :func:`decode_attention` is that fused kernel with each row's start
as an input: one thread block per (row, query head), 8 or 32 warps walking the row's keys with an
online softmax, merged at the end. :func:`install` routes mlx-lm's attention to it for exactly that
case (one query per row, a ``BatchKVCache``, head size 64/96/128/256, no attention sinks, on CUDA,
on an architecture whose decode masks are known to be left padding alone: ``_VETTED``), and a traced
decode step's (:class:`StepKV`, ``mlx_compiled``, any device) to :func:`attend`, and a prompt chunk
read under :func:`keys_in_steps` to :func:`prefill_in_steps`; every other call stays mlx-lm's.
"""

from __future__ import annotations

import contextvars
import os
import sys
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

# Warps a (row, head) block walks its keys with: 32 where the blocks are too few to fill an H200's 132
# multiprocessors (one row: 14 blocks on Qwen2.5-0.5B, 28 on 7B, where 8 warps took 72 and 78 us a
# layer against 20 and 22 for MLX's own one-row kernel: benchmarks/results/h200-host-20261203/), else 8.
# The count is the launch's, not a template argument: MLX 0.32 compiles each template instance of a
# custom kernel afresh in every process (2.2-2.4 s with NVRTC; it keeps only its own kernels on disk),
# and a second instance cost a server one more such pause the first time its batch passed 9 rows
# (0.5B) or 4 (7B): benchmarks/results/h200-20261204c/.
_WARPS_FEW, _WARPS_MANY, _FEW_BLOCKS = 32, 8, 128
_HEAD_SIZES = (64, 96, 128, 256)
# mlx-lm architectures read: each layer holding a plain KV cache masks only its rows' left padding in
# a decode step (sliding-window layers hold rotating caches, which this never takes). Elsewhere a mask
# might carry more (a window over a plain cache), so other architectures keep mlx-lm's attention.
_VETTED = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma", "granite",
                     "olmo2", "smollm3"})

_SOURCE = """
    const int row_head = blockIdx.x;
    const int b = row_head / HQ;
    const int h = row_head % HQ;
    const int kv_head = h / (HQ / HKV);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    constexpr int PER_LANE = D / 32;
    const int length = LENGTH;
    const int first = starts[b];
    const float scale = scales[0];
    const float inf = __int_as_float(0x7f800000);

    const T* qp = q + b * q_strides[0] + h * q_strides[1] + lane * PER_LANE;
    float qv[PER_LANE];
    for (int i = 0; i < PER_LANE; ++i) qv[i] = static_cast<float>(qp[i]) * scale;

    const T* kb = k + b * k_strides[0] + kv_head * k_strides[1] + lane * PER_LANE;
    const T* vb = v + b * v_strides[0] + kv_head * v_strides[1] + lane * PER_LANE;
    float m = -inf, l = 0.0f, acc[PER_LANE];
    for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.0f;
    for (int j = first + warp; j < length; j += warps) {
        const T* kj = kb + j * k_strides[2];
        float s = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) s += qv[i] * static_cast<float>(kj[i]);
        for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);
        const float p = expf(s - m_new);
        l = l * correction + p;
        const T* vj = vb + j * v_strides[2];
        for (int i = 0; i < PER_LANE; ++i) acc[i] = acc[i] * correction + p * static_cast<float>(vj[i]);
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
        out[(b * HQ + h) * D + d] = static_cast<T>(value / total);
    }
"""

_kernels: dict[bool, object] = {}
KEY_STEP = 256  # positions a prompt chunk's keys are read in (mlx-lm's KVCache grows by as many)
_in_steps = contextvars.ContextVar("mesh_llm_keys_in_steps", default=False)


class StepKV:
    """A layer cache as a traced step (``mlx_compiled``) sees it: the whole buffer, the new
    position written at ``write``; rows read from ``starts`` to ``write`` (:func:`attend`)."""

    def __init__(self, keys: mx.array, values: mx.array, positions: mx.array, write: mx.array,
                 starts: mx.array):
        self.keys, self.values = keys, values
        self.offset = positions  # each row's position, for the rotary embedding
        self.write, self.starts = write, starts

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.write, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.write, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, **_: Any) -> None:
        return None  # attention masks by starts and write


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     starts: mx.array, write: mx.array | None = None) -> mx.array:
    """Attention of one query per row, (B, Hq, 1, D), over keys and values (B, Hkv, L, D), row ``b``
    reading positions ``starts[b]`` to ``L - 1``, or to ``write[0]`` where given (a traced step's
    whole buffer, ``mlx_compiled``). Returns (B, Hq, 1, D) in the queries' dtype."""
    dynamic = write is not None
    if dynamic not in _kernels:
        _kernels[dynamic] = mx.fast.cuda_kernel(
            name="mesh_llm_decode_attention" + ("_to" if dynamic else ""),
            input_names=["q", "k", "v", "starts", "scales"] + (["ends"] if dynamic else []),
            output_names=["out"],
            source=_SOURCE.replace("LENGTH", "ends[0] + 1" if dynamic else "k_shape[2]"),
            ensure_row_contiguous=False,  # a cache's keys are a view of its buffer: read in place
        )
    batch, heads, _, size = queries.shape
    warps = _WARPS_FEW if batch * heads <= _FEW_BLOCKS else _WARPS_MANY
    inputs = [queries, keys, values, starts.astype(mx.int32), mx.array([scale], dtype=mx.float32)]
    (out,) = _kernels[dynamic](
        inputs=inputs + ([write] if dynamic else []),
        template=[("T", queries.dtype), ("HQ", heads), ("HKV", keys.shape[1]), ("D", size)],
        grid=(batch * heads * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )
    return out


def attend(queries: mx.array, keys: mx.array, values: mx.array, cache: StepKV, scale: float,
           sinks: mx.array | None = None) -> mx.array:
    """A traced decode step's attention: each row over its own positions of the whole buffer."""
    if sinks is None and on_cuda() and _fits(queries, keys, values):
        return decode_attention(queries, keys, values, scale, cache.starts, cache.write)
    positions = mx.arange(keys.shape[2])
    mask = (positions[None] >= cache.starts[:, None]) & (positions[None] <= cache.write)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                mask=mask[:, None, None, :], sinks=sinks)


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
    padded to a bucket (``MESH_LLM_PREFILL_BUCKET``) and keys read in steps, prompts of any length
    make a few pairs, each built once."""
    width, end = queries.shape[2], cache.offset
    length = min(cache.keys.shape[2], -(-end // KEY_STEP) * KEY_STEP)
    mask = mx.arange(length)[None] <= mx.arange(end - width, end)[:, None]  # stale positions too
    return mx.fast.scaled_dot_product_attention(queries, cache.keys[..., :length, :],
                                                cache.values[..., :length, :], scale=scale, mask=mask)


def fused_here() -> bool:
    """Whether a batched decode step's attention is :func:`decode_attention` here: on CUDA, unless
    ``MESH_LLM_FUSED_DECODE=0``."""
    return on_cuda() and os.environ.get("MESH_LLM_FUSED_DECODE", "1") != "0"


def on_cuda() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def _fits(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    return (queries.shape[2] == 1 and queries.shape[-1] in _HEAD_SIZES
            and keys.shape[-1] == queries.shape[-1] and queries.shape[1] % keys.shape[1] == 0
            and keys.dtype == values.dtype == queries.dtype
            and queries.dtype in (mx.float16, mx.bfloat16, mx.float32))


def applies(queries: mx.array, keys: mx.array, values: mx.array, cache, sinks) -> bool:
    """Whether :func:`decode_attention` stands in for mlx-lm's attention on this call."""
    return type(cache) is BatchKVCache and sinks is None and _fits(queries, keys, values)


def install(model, traced: bool = False, in_steps: bool = False) -> bool:
    """Route the attention of ``model``'s architecture (its mlx-lm module's
    ``scaled_dot_product_attention``): a :class:`StepKV` cache's (``traced``, any device) to
    :func:`attend`; a prompt chunk over a plain ``KVCache`` under :func:`keys_in_steps` (``in_steps``,
    any device) to :func:`prefill_in_steps`; and on CUDA, unless ``MESH_LLM_FUSED_DECODE=0``, a decode
    step over a ``BatchKVCache`` to :func:`decode_attention`. Every other call stays mlx-lm's.
    Returns whether the architecture's attention is routed (else a traced step cannot run on it)."""
    fused = fused_here()
    if not (fused or traced or in_steps):
        return False
    name = type(model).__module__
    module = sys.modules.get(name)
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None or name.rsplit(".", 1)[-1] not in _VETTED:
        return False
    original = getattr(original, "mesh_llm_original", original)

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if type(cache) is StepKV:
            return attend(queries, keys, values, cache, scale, sinks)
        if (_in_steps.get() and type(cache) is KVCache and isinstance(mask, str) and mask == "causal"
                and sinks is None and queries.shape[2] > 1):
            return prefill_in_steps(queries, cache, scale)
        if fused and applies(queries, keys, values, cache, sinks):
            return decode_attention(queries, keys, values, scale, cache.left_padding)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    attention.mesh_llm_original = original
    module.scaled_dot_product_attention = attention
    return True


def routed(model) -> bool:
    """Whether :func:`install` has routed the attention of ``model``'s architecture."""
    module = sys.modules.get(type(model).__module__)
    return hasattr(getattr(module, "scaled_dot_product_attention", None), "mesh_llm_original")
