"""llama.cpp sequence states as prompt-cache states (:class:`SequenceState`, for
``prompt_cache.PromptCache``), the context settings that make a sequence's numbers independent of
the batch it runs in, and the prefill chunks that keep reuse exact.

What rounds how on a CPU (measured on SmolLM2 Q4_1 and random F16 GGUFs, llama-cpp-python 0.3.36):

- Attention. Without flash attention, llama.cpp multiplies each query by every cell of the pool,
  masked cells included, and sums in 16-float lanes: a sequence's results then depend on where its
  cells sit (shifted by 5 cells: other bits; by 16: the same), and sequences decoding side by side
  interleave their cells. With flash attention and float16 cells, passes of 64 query rows or more
  take a tiled kernel and one-row passes over 512 cells or more a split one, each rounding its own
  way. With flash attention and bfloat16 cells neither applies: every query row walks its own
  sequence's cells in position order and skips the rest, so attention is the same bits whatever
  else the pool or the pass holds. bfloat16 cells take as much memory as float16 ones, with 8
  significant bits instead of 11, and are slow: SmolLM2 on 2 cores of this CPU (which has
  AVX512-BF16) decodes at 57 tok/s after a 600-token prompt against 93 with float16 cells, and reads
  a 2,048-token prompt in 19.4 s against 9.9. So float16 cells are the CPU default (llama-server's
  setting too), and bfloat16 ones the ``deterministic`` option (:func:`set_cache_params`).
- Weights. In a pass of two or more rows a row's product does not depend on the other rows. A
  one-row pass takes other kernels for types llamafile's sgemm or ggml's repacking handle (F16,
  BF16, Q8_0, Q4_0, IQ4_NL, Q4_K repacked...), which round differently; types without them (Q4_1,
  the embedded SmolLM2) compute a row the same way in any pass.

So on a CPU, deterministic, a sequence's tokens and logprobs do not depend on the other sequences
of its batch (their number, contents, sampling, or where their cells are), and for types without
separate one-row kernels they are bitwise what the sequence gets alone; with float16 cells they agree
within rounding (``tests/engines/test_llama_batch.py`` measures how far). Deterministic, reuse stays
exact by reusing only KV computed in passes of two or more rows (prefill chunks, and decode steps
shared with other sequences) and leaving at least two prompt tokens to compute, as one chunk. On a
GPU flash attention and cell type are llama.cpp's defaults, and none of this is measured.

A one-sequence state (``llama_state_seq_*``) holds every cell of its sequence; restoring one puts its
cells in free cells anywhere, which attention no longer notices. Recurrent state (alone or in a
hybrid) cannot be cut back to a shorter prefix, and neither can a sliding window's, whose passed
cells are not in the state (and may already be reused by other sequences): those are stored as
checkpoints during prefill (every ``prefill_step`` tokens and two tokens before the end of the
prompt) and resumed only whole.
"""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as ll
import numpy as np

from mesh_llm.engines.base import EngineError

RECOMPUTE = 2  # prompt tokens a request always computes, as one chunk of two
GGML_TYPE_F16, GGML_TYPE_BF16 = 1, 30  # ggml.h (the bindings do not name them)


def set_cache_params(cparams: ll.llama_context_params, gpu: bool, deterministic: bool,
                     streams: bool = False) -> str:
    """One pool of KV cells for every sequence (``kv_unified``: any sequence may grow to the whole
    context, and sequences share a prefix's cells), or with ``streams`` a stream of cells per
    sequence id (each row's attention then reads only its own). On a CPU, flash attention over
    float16 cells, as llama-server has them, or over bfloat16 cells when ``deterministic`` (see
    above). Sliding windows keep only their window (``swa_full`` off): their states are resumed
    whole. Returns the cell type."""
    cparams.kv_unified = not streams
    cparams.swa_full = False
    if gpu:
        return "f16"
    cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    if deterministic:
        cparams.type_k = cparams.type_v = GGML_TYPE_BF16
        return "bf16 (deterministic)"
    cparams.type_k = cparams.type_v = GGML_TYPE_F16
    return "f16"


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
