"""mlx-lm's layer caches as prompt-cache states (:class:`Frozen`, for ``prompt_cache.PromptCache``).

Which layer caches can be cut back to a shorter prefix, how a stored one is handed out without two
live caches sharing an array either would write, and how many bytes it really holds.
"""

from __future__ import annotations

import copy
from typing import Any

from mesh_llm.engines.mlx_blas import ensure_fast_blas

ensure_fast_blas()  # before mlx.core is first imported in the process

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache, trim_prompt_cache

from mesh_llm.engines.prompt_cache import available_memory

_PLAIN_KV = (KVCache, QuantizedKVCache)  # layer caches that can always be trimmed
_KV_LIKE = (*_PLAIN_KV, RotatingKVCache)  # layer caches that own whole buffers


def needs_checkpoints(cache: list[Any]) -> bool:
    """Whether a fresh cache has layers that cannot always be cut back (recurrent state, sliding
    windows): prefill then stores checkpoints."""
    return not all(isinstance(c, _PLAIN_KV) for c in _leaves(cache))


class Frozen:
    """mlx-lm's per-layer caches after exactly ``length`` tokens, stored in a :class:`PromptCache`.

    A layer cache updates its arrays in place (``keys[..., i:j, :] = k`` rebinds the array object),
    so a state handed out while the cache keeps it is a copy: new cache objects whose arrays share
    the stored buffers until written (MLX then copies instead of writing in place, as a buffer with
    another reader cannot be donated). A plain KV cache is copied as a slice of its first ``n``
    positions, so that first write copies only what is reused.
    """

    def __init__(self, cache: list[Any], length: int):
        arrays = _freeze(cache)  # also finishes a decode step still queued on them
        self.cache, self.length = cache, length
        self.nbytes = sum(a.nbytes for a in arrays)
        self.trimmable = all(isinstance(c, _PLAIN_KV) or
                             (isinstance(c, RotatingKVCache) and c.is_trimmable())
                             for c in _leaves(cache))

    def resume(self, n: int, owned: bool) -> list[Any]:
        if owned:
            trim_prompt_cache(self.cache, self.length - n)
            return self.cache
        return [_kv_prefix(c, n) if type(c) is KVCache else _trimmed_copy(c, self.length - n)
                for c in self.cache]


def _kv_prefix(c: KVCache, n: int) -> KVCache:
    prefix = KVCache()
    prefix.keys, prefix.values, prefix.offset = c.keys[..., :n, :], c.values[..., :n, :], n
    return prefix


def _trimmed_copy(c: Any, n: int) -> Any:
    c = copy.deepcopy(c)  # new array objects over the same buffers
    if n:
        c.trim(n)
    return c


def _leaves(cache: list[Any]) -> list[Any]:
    return [leaf for c in cache
            for leaf in (_leaves(c.caches) if isinstance(c, CacheList) else [c])]


def _freeze(cache: list[Any]) -> list[mx.array]:
    """Evaluate every array the layer caches hold, and return them. KV caches hold whole buffers
    they allocated; other layer states (conv and SSM states) are often slices that would keep their
    source buffer (a prefill chunk's activations) alive and uncounted, so those are copied."""
    kept: list[mx.array] = []
    sources: list[mx.array] = []  # held until evaluated, so that no copy can take over its buffer

    def own(x, copy_arrays: bool):
        if isinstance(x, mx.array):
            if copy_arrays:
                sources.append(x)
                x = mx.array(x)
            kept.append(x)
            return x
        if isinstance(x, (list, tuple)):
            return type(x)(own(v, copy_arrays) for v in x)
        if hasattr(x, "__dict__"):
            copy_arrays = copy_arrays and not isinstance(x, _KV_LIKE)
            for name, value in list(vars(x).items()):
                vars(x)[name] = own(value, copy_arrays)
        return x

    own(cache, True)
    mx.eval(kept)
    return kept


def free_memory() -> int:
    """Bytes free for the prompt cache's default size: the GPU's memory (Metal: its recommended
    working set) less what MLX holds, weights included; on CPU, or a GPU that reports no size, the
    system's available RAM."""
    if mx.default_device().type == mx.DeviceType.gpu:
        info = mx.device_info()
        total = (info.get("max_recommended_working_set_size") or info.get("memory_size")
                 or info.get("total_memory"))  # Metal, Metal, CUDA
        if total:
            return int(total) - mx.get_active_memory()
    return available_memory()
