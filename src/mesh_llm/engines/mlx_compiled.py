"""A decode step traced once per shape (``mx.compile``) and replayed, so a token costs less Python.

An opt-in on a GPU (``MESH_LLM_COMPILED_DECODE=1``). On the H200 one MLX stream of a small model is
bound by the host: the GPU ran the 0.5B shape's 412 kernels a token in 1.9 ms while building the step's graph
took 1.1-2.2 ms and handing it to MLX 2.6-5.5 ms. A replayed trace halves the building, but writing
at a position held in an array adds two kernels per KV write, and attention over the whole buffer
runs our kernel instead of MLX's faster one-row kernel. So it gained where the host was the bound
(one 0.5B stream through the server: 1.15x and 1.31x) and lost where the GPU was (7B: 0.84-1.06x).
Figures: ``benchmarks/results/h200-host-20261203/``.

It needs shapes that stay put. mlx-lm's layer caches hand attention their buffers cut to the tokens
written so far, a new shape every token. Here the step writes its keys and values at a position
held in an array, and attention reads the whole buffer, each row from its first own position (after
its left padding) to the one just written. Shapes change when a buffer grows (``STEP`` positions at
a time) or rows join or leave; each shape is traced once per process.

It applies to a decode group whose layers all hold plain KV caches (one row's ``KVCache`` or a
``BatchKVCache``), on an architecture whose attention ``mlx_attention`` routes (``_VETTED``). The
caches stay mlx-lm's objects, kept as mlx-lm would leave them, so rows join, leave and go to the
prompt cache as before.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mesh_llm.engines.mlx_attention import StepKV, routed

STEP = 256  # positions a buffer grows by, as mlx-lm's caches do


def traceable(caches: list[Any]) -> bool:
    """Whether a group's caches can take the compiled step."""
    kinds = {type(c) for c in caches}
    return (kinds == {KVCache} or kinds == {BatchKVCache}) and caches[0].keys is not None


class CompiledDecode:
    """One model's decode step, compiled: ``step(inputs, caches)`` gives the logits of one token a
    row and leaves ``caches`` one position longer."""

    def __init__(self, model):
        if not routed(model):
            raise ValueError("a traced step needs the model's attention routed first "
                             "(mlx_attention.install(model, traced=True))")
        self._model = model
        self._traced = mx.compile(self._forward)
        self.steps = 0  # taken so far (tests check that the traced path ran)

    def _forward(self, inputs: mx.array, positions: mx.array, write: mx.array, starts: mx.array,
                 *buffers: mx.array) -> tuple[mx.array, ...]:
        caches = [StepKV(buffers[i], buffers[i + 1], positions, write, starts)
                  for i in range(0, len(buffers), 2)]
        logits = self._model(inputs[:, None], cache=caches)[:, -1, :]
        return (logits, *(a for c in caches for a in (c.keys, c.values)))

    def step(self, inputs: mx.array, caches: list[Any]) -> mx.array:
        self.steps += 1
        first = caches[0]
        batched = isinstance(first, BatchKVCache)  # else one row's KVCache
        if batched:
            written, positions, starts = first._idx, first.offset, first.left_padding
        else:
            written = first.offset
            positions, starts = mx.array([written], dtype=mx.int32), mx.zeros((1,), dtype=mx.int32)
        for c in caches:
            _reserve(c, written)
        out = self._traced(inputs, positions.astype(mx.int32), mx.array([written], dtype=mx.int32),
                           starts.astype(mx.int32), *(a for c in caches for a in (c.keys, c.values)))
        offset = positions + 1 if batched else written + 1  # one array for every layer's batch cache
        for i, c in enumerate(caches):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset = offset
            if batched:
                c._idx += 1
        return out[0]


def _reserve(cache: Any, written: int) -> None:
    """Room in ``cache``'s buffers for position ``written``, its capacity a multiple of ``STEP`` (a
    buffer cut by a leaving row or copied from the prompt cache is padded), so few shapes occur."""
    size = cache.keys.shape[2]
    if written < size and size % STEP == 0:
        return
    grown = (written // STEP + 1) * STEP
    keep = slice(None), slice(None), slice(0, written)

    def pad(a: mx.array) -> mx.array:
        b, h, _, d = a.shape
        return mx.concatenate([a[keep], mx.zeros((b, h, grown - written, d), dtype=a.dtype)], axis=2)

    cache.keys, cache.values = pad(cache.keys), pad(cache.values)
