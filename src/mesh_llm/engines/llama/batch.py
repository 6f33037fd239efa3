"""The llama.cpp engine's sequences and the batch one step decodes, as llama-server's slots.

Each sequence the runtime adds becomes a :class:`Slot`: a llama.cpp sequence id with its KV cells (in
the context's one pool, or in a stream of its own), its prompt, the tokens its cells hold, and its own sampler (:class:`Sampler`: its
seed, filters, logprobs and constraint). A step puts every busy slot's work into one
:class:`Batch` (a chunk of prompt, or the one token it sampled last) and decodes it in one pass;
each slot then samples from its own logits row.

Cells are counted here, not asked of llama.cpp: in one pool sequences that share a prefix hold the
same cells (``llama_memory_seq_cp``), so each slot lists the runs of cells it holds (:class:`Run`), and the
pool's use is the union of those runs plus what every slot may still grow by.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp.llama_cpp as ll
import numpy as np

from mesh_llm.engines.base import TYPICAL_SEQUENCE, SamplingParams, Step

log = logging.getLogger(__name__)


class Batch:
    """A ``llama_batch`` over numpy arrays, one sequence id per token, so a chunk is written with
    array assignments instead of a ctypes call per token."""

    def __init__(self, capacity: int):
        self.capacity, self.n = capacity, 0
        self._token = np.zeros(capacity, np.int32)
        self._pos = np.zeros(capacity, np.int32)
        self._n_seq_id = np.ones(capacity, np.int32)
        self._seq = np.zeros(capacity, np.int32)
        self._logits = np.zeros(capacity, np.int8)
        seq_pointer = ctypes.POINTER(ll.llama_seq_id)
        base = self._seq.ctypes.data
        self._seq_ptrs = (seq_pointer * capacity)(
            *(ctypes.cast(base + 4 * i, seq_pointer) for i in range(capacity)))
        self.struct = ll.llama_batch(
            n_tokens=0,
            token=self._token.ctypes.data_as(ctypes.POINTER(ll.llama_token)),
            embd=None,
            pos=self._pos.ctypes.data_as(ctypes.POINTER(ll.llama_pos)),
            n_seq_id=self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_ptrs,
            logits=self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def clear(self) -> None:
        self.n = 0

    def add(self, seq_id: int, tokens, start: int, logits: bool) -> int:
        """Append ``tokens`` of sequence ``seq_id`` at positions ``start``...; the batch index of the
        last one (whose logits are kept when ``logits``)."""
        i, k = self.n, len(tokens)
        if k < 1 or i + k > self.capacity:
            raise ValueError(f"a chunk of {k} tokens does not fit a batch of {self.capacity} holding {i}")
        self._token[i : i + k] = tokens
        self._pos[i : i + k] = np.arange(start, start + k)
        self._seq[i : i + k] = seq_id
        self._logits[i : i + k] = 0
        self._logits[i + k - 1] = 1 if logits else 0
        self.n = i + k
        return i + k - 1

    def all_logits(self) -> None:
        self._logits[: self.n] = 1

    def ready(self) -> ll.llama_batch:
        self.struct.n_tokens = self.n
        return self.struct


class Sampler:
    """One sequence's sampler chain, so its seed alone decides its draws, in a batch or alone.
    Filters act on the untempered distribution and temperature comes last, as in llama.cpp's and
    mlx-lm's samplers. Logprobs are of the raw logits row; a constraint's mask is written into the
    row as -inf before the chain samples from it (a mask allowing nothing ends the sequence with
    ``fallback``, an end-of-generation token)."""

    def __init__(self, params: SamplingParams, n_vocab: int, fallback: int):
        self.params, self._n_vocab, self._fallback = params, n_vocab, fallback
        self.chain = None  # greedy: numpy's argmax, the first maximum as llama.cpp's greedy sampler
        # takes it, without copying the whole row into llama.cpp's candidates (0.25 ms a row at a
        # 152k vocabulary, every sequence of every step)
        if not params.greedy:
            self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            for sampler in _samplers(params):
                ll.llama_sampler_chain_add(self.chain, sampler)  # the chain owns and frees them

    def sample(self, ctx: ll.llama_context_p, index: int) -> Step:
        pointer = ll.llama_get_logits_ith(ctx, index)
        if not pointer:
            raise RuntimeError(f"llama.cpp kept no logits for batch row {index}")
        row = np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))
        logprobs, top = _logprobs(row, self.params.logprobs)
        constraint = self.params.constraint
        allowed = self._allowed(constraint) if constraint is not None else None
        if allowed is not None:
            row[len(allowed):] = -np.inf
            row[: len(allowed)][~allowed] = -np.inf
        if allowed is not None and not allowed.any():  # nothing allowed: the sequence ends here
            token = self._fallback
        elif self.chain is None:
            token = int(row.argmax())
        else:
            token = ll.llama_sampler_sample(self.chain, ctx, index)
        if constraint is not None:
            try:
                constraint.advance(token)
            except Exception:
                log.exception("a constraint failed on token %d", token)
        return Step(token, None if logprobs is None else float(logprobs[token]), top)

    def _allowed(self, constraint) -> np.ndarray | None:
        """The constraint's mask over this vocabulary; one that fails allows nothing (its own
        sequence ends) rather than failing every sequence of the batch."""
        try:
            mask = constraint.mask()
        except Exception:
            log.exception("a constraint failed to give its mask")
            return np.zeros(0, dtype=bool)
        return None if mask is None else np.asarray(mask, dtype=bool)[: self._n_vocab]

    def free(self) -> None:
        if self.chain:
            ll.llama_sampler_free(self.chain)
            self.chain = None


def _samplers(params: SamplingParams) -> list:
    samplers = []
    if params.top_k > 0:
        samplers.append(ll.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        samplers.append(ll.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        samplers.append(ll.llama_sampler_init_min_p(params.min_p, 1))
    samplers.append(ll.llama_sampler_init_temp(params.temperature))
    # LLAMA_DEFAULT_SEED (2**32 - 1) means "random": keep explicit seeds below it
    seed = ll.LLAMA_DEFAULT_SEED if params.seed is None else params.seed % ll.LLAMA_DEFAULT_SEED
    samplers.append(ll.llama_sampler_init_dist(seed))
    return samplers


def _logprobs(row: np.ndarray, n: int | None) -> tuple[np.ndarray | None, tuple[tuple[int, float], ...]]:
    """log_softmax of the raw logits over the whole vocabulary (before any temperature, filter or
    constraint), and its ``n`` most likely tokens, best first."""
    if n is None:
        return None, ()
    shifted = row.astype(np.float64) - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    if n <= 0:
        return logprobs, ()
    n = min(n, len(row))
    best = np.argpartition(-logprobs, n - 1)[:n]
    best = best[np.lexsort((best, -logprobs[best]))]
    return logprobs, tuple((int(i), float(logprobs[i])) for i in best)


class Run:
    """Cells one sequence computed, from prompt position ``start`` on; a sequence that shares a
    prefix of it holds the run up to where the prefix ends."""

    __slots__ = ("start",)

    def __init__(self, start: int):
        self.start = start


class Slot:
    """One sequence the engine holds: its llama.cpp sequence id ``id``, what its cells hold, where
    its prompt stands, and the token it sampled last (fed by the next step)."""

    def __init__(self, seq: int, slot_id: int, prompt: np.ndarray, max_tokens: int, sampler: Sampler):
        self.seq, self.id, self.prompt, self.max_tokens, self.sampler = seq, slot_id, prompt, max_tokens, sampler
        self.held: list[int] = []  # the tokens its cells hold, position by position
        self.exact = 0  # how many of them were computed in passes of two rows or more (reusable)
        self.started = False  # its reuse is decided and its cells are in place
        self.cached = 0  # prompt tokens reused, reported with its first token
        self.next_token: int | None = None
        self.produced = 0
        self.runs: list[list] = []  # [Run, end] in position order; the last is its own, growing

    @property
    def decoding(self) -> bool:
        """It has a sampled token to feed and may still answer."""
        return self.next_token is not None and self.produced < self.max_tokens

    @property
    def prefilling(self) -> bool:
        return self.started and len(self.held) < len(self.prompt)

    def begin(self, reused: int, source: Slot | None) -> None:
        """Its first ``reused`` prompt tokens are in its cells: shared with ``source``, or restored."""
        self.held = [int(t) for t in self.prompt[:reused]]
        self.exact = self.cached = reused
        self.runs = [[run, min(end, reused)] for run, end in source.runs if run.start < reused] if source else []
        if reused and not source:
            self.runs.append([Run(0), reused])
        self.runs.append([Run(reused), reused])
        self.started = True

    def extend(self, tokens, exact: bool) -> None:
        """Its cells now also hold ``tokens``; ``exact``: computed in a pass of two rows or more."""
        if exact and self.exact == len(self.held):
            self.exact += len(tokens)
        self.held.extend(int(t) for t in tokens)
        self.runs[-1][1] = len(self.held)

    def reset(self) -> None:
        """Its cells were taken back (preempted): it holds nothing until it begins again, with the
        prompt the scheduler gives it (``LlamaEngine.readmit``); ``produced`` counts from then."""
        self.held, self.runs, self.exact, self.produced = [], [], 0, 0
        self.started, self.next_token = False, None

    def free(self) -> None:
        self.sampler.free()


def cells_in_use(slots) -> int:
    """Cells the slots hold, shared ones once."""
    ends: dict[Run, int] = {}
    for slot in slots:
        for run, end in slot.runs:
            ends[run] = max(ends.get(run, run.start), end)
    return sum(end - run.start for run, end in ends.items())


# Sequences decoded together when not asked for: past these, decode steps stop gaining on our CPUs
# (2 cores) and the H200's (llama-server's 32 streams: 1,392 tok/s against 1,233 for 8).
MAX_BATCH_CPU, MAX_BATCH_GPU = 8, 32


def plan_pool(n_ctx_seq: int, cell_bytes: int, kv_bytes: int, gpu: bool,
              requested: int | None, overcommit: bool = False) -> tuple[int, int]:
    """``(max_batch, pool cells)``: the KV pool holds ``max_batch`` full contexts when ``kv_bytes``
    (the memory the KV may take) allows, else what those bytes hold, and never less than one context; with
    ``overcommit`` (sequences may be preempted when the pool fills, see ``LlamaEngine``)
    ``max_batch`` times :data:`TYPICAL_SEQUENCE` cells instead of full contexts. Without a request,
    max_batch is the device's cap, or fewer when the pool cannot give each sequence
    :data:`TYPICAL_SEQUENCE` cells (or its whole context if shorter)."""
    budget = kv_bytes // max(1, cell_bytes)
    typical = min(n_ctx_seq, TYPICAL_SEQUENCE)
    if requested:
        max_batch = requested
    else:
        cap = MAX_BATCH_GPU if gpu else MAX_BATCH_CPU
        max_batch = max(1, min(cap, budget // typical))
    return max_batch, max(n_ctx_seq, min(max_batch * (typical if overcommit else n_ctx_seq), budget))
