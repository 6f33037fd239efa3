"""mlx-lm's layer caches as prompt-cache states (:class:`Frozen`, for ``prompt_cache.PromptCache``), and
what they cost in memory (:class:`Footprint`).

Which layer caches can be cut back to a shorter prefix, which can be batched, how a stored one is
handed out without two live caches sharing an array either would write, how many bytes it really
holds, and how many one sequence of n tokens will hold.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from mesh_llm.system.blas import prepare_mlx

prepare_mlx()  # before mlx and mlx-lm are first imported in the process

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)

from mesh_llm.engines.prompt_cache import available_memory

_PLAIN_KV = (KVCache, QuantizedKVCache)  # layer caches that can always be trimmed
_KV_LIKE = (*_PLAIN_KV, RotatingKVCache)  # layer caches that own whole buffers


def needs_checkpoints(cache: list[Any]) -> bool:
    """Whether a fresh cache has layers that cannot always be cut back (recurrent state, sliding
    windows): prefill then stores checkpoints."""
    return not all(isinstance(c, _PLAIN_KV) for c in leaves(cache))


def unbatchable(cache: list[Any]) -> list[str]:
    """The kinds of layer cache in a fresh cache that mlx-lm cannot batch (no ``merge``: chunked,
    quantized or concatenating KV caches); [] when sequences of this model can share a forward pass."""
    return sorted({type(c).__name__ for c in leaves(cache) if not hasattr(c, "merge")})


@dataclass(frozen=True)
class Footprint:
    """The bytes one sequence's layer caches hold after n tokens: so many a token for KV layers (up
    to their window, if they slide), a fixed size for recurrent state. Measured once per model."""

    per_token: tuple[tuple[int, int | None], ...]  # (bytes a token, window or None) per KV layer
    fixed: int  # recurrent/conv state, whatever the length
    step: int = 256  # KV caches grow by this many tokens at a time

    def bytes(self, tokens: int) -> int:
        grown = -(-max(tokens, 1) // self.step) * self.step
        return self.fixed + sum(b * (grown if w is None else min(grown, w)) for b, w in self.per_token)

    @classmethod
    def measure(cls, model) -> Footprint:
        """From a one-token forward pass through a fresh cache."""
        cache = make_prompt_cache(model)
        model(mx.array([[0]]), cache=cache)
        arrays = [a for c in leaves(cache) for a in _arrays(c)]
        mx.eval(arrays)
        per_token, fixed = [], 0
        for c in leaves(cache):
            keys = getattr(c, "keys", None)
            if isinstance(keys, (tuple, list)):  # quantized: (packed, scales, biases)
                keys = keys[0]
            if isinstance(keys, mx.array):
                window = getattr(c, "max_size", None) or getattr(c, "chunk_size", None)
                per_token.append((c.nbytes // keys.shape[-2], window))
            else:
                fixed += sum(a.nbytes for a in _arrays(c))
        del cache, arrays
        mx.clear_cache()
        return cls(tuple(per_token), fixed)


def _arrays(x: Any) -> list[mx.array]:
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for v in x for a in _arrays(v)]
    if hasattr(x, "__dict__"):
        return [a for v in vars(x).values() for a in _arrays(v)]
    return []


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
                             for c in leaves(cache))

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


def leaves(cache: list[Any]) -> list[Any]:
    """The layer caches of a model's cache list, CacheList hybrids opened up."""
    return [leaf for c in cache
            for leaf in (leaves(c.caches) if isinstance(c, CacheList) else [c])]


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
