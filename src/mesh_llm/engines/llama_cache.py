"""llama.cpp context states as prompt-cache states (:class:`ContextState`, for
``prompt_cache.PromptCache``), and the prefill batches that keep their reuse bit-exact.

Why batches matter: llama.cpp's CPU kernels sum in another order for a batch of one token (a decode
step) than for a batch of two or more (llamafile's sgemm runs only for n >= 2; with flash attention
on, its tiled kernel only for 64 query rows or more). KV computed one way is not bitwise the KV the
other way computes, and a greedy answer can change on it. With flash attention off and every prompt
token computed in a batch of at least two, the KV of a position is the same for any split of the
prompt into batches (SmolLM2 Q4_1, and random F16 llama, gemma2, mamba and lfm2 GGUFs in the tests).
So the engine reuses only KV computed by prefill, never by decode steps, and leaves at least two
prompt tokens to compute.

Where a cell sits matters too: attention sums over the cache's cells in slot order, so a restored
state must put every cell back in the slot it had, and new cells must follow them as they would
have. A one-sequence state (``llama_state_seq_*``) does both, and restoring it touches only its own
cells; but it leaves out the cells a sliding window has passed, which shifts the rest. So with a
sliding window states are whole-context ones (every cell, back from slot 0 in order; restoring one
first zeroes the whole cache), and :func:`restore` keeps new cells after the restored ones.
"""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as ll
import numpy as np

from mesh_llm.engines.base import EngineError

RECOMPUTE = 2  # prompt tokens a request always computes, as one batch of two


def set_cache_params(cparams: ll.llama_context_params, model: ll.llama_model_p) -> None:
    """Context settings that keep reuse exact. On CPU, flash attention off: its kernel rounds by
    batch size; without it prefill is 10-30% slower at 512-4,096 tokens and decode no slower
    (SmolLM2, 2-core Xeon). Sliding-window caches full-size (every cell stays, so states can be cut
    back), with a second sequence in the same cells to pin cells with (see :func:`restore`)."""
    cparams.swa_full = True
    if ll.llama_model_n_swa(model) > 0:
        cparams.n_seq_max, cparams.kv_unified = 2, True
    if not ll.llama_supports_gpu_offload():
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED


def needs_checkpoints(model: ll.llama_model_p) -> bool:
    """Whether states cannot be cut back to a shorter prefix: recurrent state (alone or in a hybrid).
    Sliding-window caches can, as the engine keeps them full-size (``swa_full``)."""
    return bool(ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))


class ContextState:
    """A copy of sequence 0's memory (KV cells, recurrent state), or with a sliding window of the
    whole context's. The blob is never written, so a resumed one is handed out as it is, owned or
    not; :func:`restore` loads it back."""

    def __init__(self, ctx: ll.llama_context_p, trimmable: bool):
        if _sliding(ctx):
            size = ll.llama_state_get_size(ctx)
            blob = np.empty(size, np.uint8)
            got = ll.llama_state_get_data(ctx, _pointer(blob), size)
        else:
            size = ll.llama_state_seq_get_size(ctx, 0)
            blob = np.empty(size, np.uint8)
            got = ll.llama_state_seq_get_data(ctx, _pointer(blob), size, 0)
        self.blob, self.nbytes, self.trimmable = blob[:got], blob.nbytes, trimmable

    def resume(self, n: int, owned: bool) -> np.ndarray:
        return self.blob


def restore(ctx: ll.llama_context_p, blob: np.ndarray, n: int) -> bool:
    """Replace sequence 0 with a stored state cut back to its first ``n`` tokens; True when cells
    were pinned, to :func:`unpin` once the next batch is in.

    After a whole-context restore llama.cpp looks for free cells from slot 0, and in a sliding-window
    cache it takes the cells of one sequence that the window has passed, where a context that was
    never restored puts new cells after the last one. So the kept cells are also put in sequence 1
    for the next batch: cells of two sequences are never taken."""
    sliding = _sliding(ctx)
    if sliding:
        got = ll.llama_state_set_data(ctx, _pointer(blob), blob.nbytes)
    else:
        got = ll.llama_state_seq_set_data(ctx, _pointer(blob), blob.nbytes, 0)
    memory = ll.llama_get_memory(ctx)
    if got != blob.nbytes:
        ll.llama_memory_clear(memory, True)
        raise EngineError("llama.cpp could not restore a cached prompt state")
    ll.llama_memory_seq_rm(memory, 0, n, -1)
    if sliding:
        ll.llama_memory_seq_cp(memory, 0, 1, 0, n)
    return sliding


def unpin(memory: ll.llama_memory_t) -> None:
    """Drop the pin of :func:`restore` once new cells are placed after the kept ones."""
    ll.llama_memory_seq_rm(memory, 1, -1, -1)


def live_prefix(tokens: list[int], exact: int, prompt: list[int], checkpoints: bool) -> int:
    """How many leading prompt tokens a context holding ``tokens`` (the first ``exact`` computed by
    prefill) may keep, leaving RECOMPUTE to compute; a state that cannot be cut back, all or none."""
    n = min(exact, len(prompt) - RECOMPUTE)
    keep = 0
    while keep < n and tokens[keep] == prompt[keep]:
        keep += 1
    return 0 if checkpoints and keep < len(tokens) else keep


def _sliding(ctx: ll.llama_context_p) -> bool:
    return ll.llama_model_n_swa(ll.llama_get_model(ctx)) > 0


def _pointer(blob: np.ndarray):
    return blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def batch_ends(start: int, stop: int, n_batch: int, checkpoints: bool) -> list[int]:
    """Where the prefill batches of prompt positions [start, stop) end: at absolute multiples of
    ``n_batch`` and at ``stop``, and with ``checkpoints`` also two tokens before the end (the state
    an exact repeat or the next turn resumes from). No batch holds a lone token, which llama.cpp
    computes with its decode kernels (one-token prompts excepted). ``n_batch`` must be at least 3."""
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
