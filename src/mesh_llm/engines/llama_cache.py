"""llama.cpp sequence states as prompt-cache states (:class:`SequenceState`, for
``prompt_cache.PromptCache``), and the prefill chunks that keep their reuse exact.

What rounds how, on a CPU (measured on SmolLM2 Q4_1 and random F16 llama GGUFs, flash attention off):

- a forward pass of one token (a lone decode step) runs other matmul kernels than a pass of two or
  more rows (llamafile's sgemm runs only for n >= 2; with flash attention on, its tiled kernel only
  for 64 query rows or more), and the two differ in the last bits, by up to 0.6 in SmolLM2's logits;
- in a pass of two or more rows, a row's result does not depend on the other rows, their number or
  their sequences: a prompt's logits are bitwise the same read alone or beside another sequence's;
- attention sums over the cache's cells in 16-float lanes, so a sequence's results depend on where
  its cells sit (shifted by 16 or 64 cells: the same bits; by 5: not). Sequences that decode side by
  side interleave their cells, so a sequence in a batch rounds differently from the same one alone.

So KV is reused only where it was computed in a pass of two or more rows (prefill chunks, and decode
steps shared with other sequences), and a request leaves at least two prompt tokens to compute, as
one chunk. A sequence alone then gets bitwise the tokens it gets without the cache. In a batch its
cells are interleaved with its neighbours' and nothing is bitwise any more, with or without reuse.

A one-sequence state (``llama_state_seq_*``) holds every cell of its sequence; restoring one puts the
cells in the first free slots. Recurrent state (alone or in a hybrid) cannot be cut back to a shorter
prefix, and neither can a sliding window's, whose passed cells are not in the state (and may already
be reused by other sequences): those are stored as checkpoints during prefill (every ``prefill_step``
tokens and two tokens before the end of the prompt) and resumed only whole.
"""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as ll
import numpy as np

from mesh_llm.engines.base import EngineError

RECOMPUTE = 2  # prompt tokens a request always computes, as one chunk of two


def set_cache_params(cparams: ll.llama_context_params, model: ll.llama_model_p) -> None:
    """One pool of KV cells for every sequence (``kv_unified``: any sequence may grow to the whole
    context, and sequences share a prefix's cells). On CPU, flash attention off: its kernel rounds
    by batch size; without it prefill is 10-30% slower at 512-4,096 tokens and decode no slower
    (SmolLM2, 2-core Xeon). Sliding windows keep only their window (``swa_full`` off), as their
    states are resumed whole."""
    cparams.kv_unified = True
    cparams.swa_full = False
    if not ll.llama_supports_gpu_offload():
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED


def needs_checkpoints(model: ll.llama_model_p) -> bool:
    """Whether states cannot be cut back to a shorter prefix: recurrent state (alone or in a
    hybrid), or a sliding window. Such sequences also never share cells with another."""
    return bool(ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model)
                or ll.llama_model_n_swa(model) > 0)


class SequenceState:
    """A copy of one sequence's memory (KV cells, recurrent state). The blob is never written, so a
    resumed one is handed out as it is, owned or not; :func:`restore` loads it into a sequence."""

    def __init__(self, ctx: ll.llama_context_p, seq: int, trimmable: bool):
        size = ll.llama_state_seq_get_size(ctx, seq)
        blob = np.empty(size, np.uint8)
        got = ll.llama_state_seq_get_data(ctx, _pointer(blob), size, seq)
        self.blob, self.nbytes, self.trimmable = blob[:got], blob.nbytes, trimmable

    def resume(self, n: int, owned: bool) -> np.ndarray:
        return self.blob


def restore(ctx: ll.llama_context_p, seq: int, blob: np.ndarray, n: int) -> None:
    """Load a stored state into the empty sequence ``seq``, cut back to its first ``n`` tokens."""
    memory = ll.llama_get_memory(ctx)
    if ll.llama_state_seq_set_data(ctx, _pointer(blob), blob.nbytes, seq) != blob.nbytes:
        ll.llama_memory_seq_rm(memory, seq, -1, -1)
        raise EngineError("llama.cpp could not restore a cached prompt state")
    if not ll.llama_memory_seq_rm(memory, seq, n, -1):
        ll.llama_memory_seq_rm(memory, seq, -1, -1)
        raise EngineError(f"llama.cpp cannot cut a cached prompt state back to {n} tokens")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two int32 arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _pointer(blob: np.ndarray):
    return blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def batch_ends(start: int, stop: int, n_batch: int, checkpoints: bool) -> list[int]:
    """Where the prefill chunks of prompt positions [start, stop) end: at absolute multiples of
    ``n_batch`` and at ``stop``, and with ``checkpoints`` also two tokens before the end (the state
    an exact repeat or the next turn resumes from). No chunk holds a lone token, which llama.cpp
    would compute with its decode kernels when the chunk is alone in its pass (one-token prompts
    excepted). ``n_batch`` must be at least 3."""
    ends, pos = [], start
    while pos < stop:
        end = min((pos // n_batch + 1) * n_batch, stop)
        if checkpoints and pos < stop - RECOMPUTE < end:
            end = stop - RECOMPUTE
        if end - pos == 1:
            end = min(pos + 2, stop)
        if stop - end == 1:
            end = stop if stop - pos <= n_batch else end - 1
        ends.append(end)
        pos = end
    return ends


def next_chunk(pos: int, stop: int, n_batch: int, checkpoints: bool, budget: int) -> int | None:
    """The end of the next prefill chunk from ``pos`` holding at most ``budget`` tokens: the next
    of :func:`batch_ends`, or short of it, never leaving it one token to compute; None when the
    budget allows no such chunk."""
    end = batch_ends(pos, stop, n_batch, checkpoints)[0]
    if end - pos <= budget:
        return end
    cut = pos + budget
    if end - cut == 1:
        cut -= 1
    return cut if cut - pos >= 2 else None
