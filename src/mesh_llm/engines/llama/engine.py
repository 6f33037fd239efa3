"""llama.cpp engine: GGUF models through llama-cpp-python's low-level bindings, many sequences at once.

A runner for ``runtime.scheduler``, which decides who is admitted, which prompt chunks each step
reads, who waits and who is preempted. As llama-server's slots do, every sequence is a llama.cpp
sequence id with its KV cells (in one pool on a CPU, in a stream of its own on a GPU:
:meth:`LlamaEngine._compact`), and each step decodes one ``llama_batch`` holding the planned prompt
chunks and one token for each decoding sequence; each sequence samples from its own logits row with
its own sampler (``batch.py``). The engine tells the scheduler whether the sequences' claims fit the
pool (:meth:`LlamaEngine.fits`). A sequence that starts with a prefix another running sequence holds
shares its cells (``llama_memory_seq_cp``: in one pool no copy, no memory; across streams a copy on
the device), and one that ends leaves its state to the prompt cache (``cache.SequenceState`` in a
``PromptCache``). ``cache.py`` says which KV is reused and why flash attention is off on CPU.

``llama_cpp.Llama`` is not used: it keeps logits for every position only with ``logits_all``,
silences logs by redirecting the process's stdout/stderr (other threads lose their output), and
carries a chat layer we never want.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from mesh_llm.system import native

if problem := native.llama_load_problem():  # a build that would crash here: say why instead
    raise ImportError(problem)

import llama_cpp.llama_cpp as ll  # noqa: E402
import numpy as np  # noqa: E402

from mesh_llm.engines.base import (
    GPU_PREFILL_CHUNKS,
    PREFILL_STEP,
    Engine,
    EngineError,
    EngineInfo,
    EngineOptions,
    Plan,
    SamplingParams,
    Step,
    fit_context,
    warm_up_before_ready,
)
from mesh_llm.engines.llama import cache as llama_cache
from mesh_llm.engines.llama.batch import Batch, Sampler, Slot, cells_in_use, plan_pool
from mesh_llm.engines.llama.cache import RECOMPUTE, SequenceState, batch_ends, next_chunk
from mesh_llm.engines.llama.gguf import check_gguf, resolve
from mesh_llm.engines.llama.tokenizer import LlamaTokenizer
from mesh_llm.engines.prompt_cache import PromptCache, available_memory, default_cache_bytes
from mesh_llm.runtime.scheduler import common_prefix
from mesh_llm.system.llama_lib import (
    NATIVE_LOG,
    amx_in_use,
    backend_name,
    gpu_free_memory,
    kv_cell_bytes,
)
from mesh_llm.system.machine import physical_cores

log = logging.getLogger(__name__)

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: a larger sequence id aborts the process
# Overcommit: a sequence holds cells for what it has read and answered, not for all it may answer;
# it starts (or resumes after preemption) only where there is room for this many answer tokens for
# each row decoding beside it, and its own, so that it is not preempted again a few tokens later.
HEADROOM_PER_ROW = 32


def _free_native(tokenizer: LlamaTokenizer, ctx, model) -> None:
    def free():
        ll.llama_free(ctx)
        ll.llama_model_free(model)
    tokenizer.retire(free)


def _check_params(params: SamplingParams, n_vocab: int) -> None:
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, not {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], not {params.min_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, not {params.top_k}")
    if params.logprobs is not None and not 0 <= params.logprobs <= n_vocab:
        raise ValueError(f"logprobs must be in [0, {n_vocab}], not {params.logprobs}")


class LlamaEngine(Engine):
    """A GGUF model in one llama.cpp context: up to ``max_batch`` sequences in one pool of KV cells,
    and a prompt cache of the states they leave."""

    name = "llama"
    formats = frozenset({"gguf"})

    def __init__(self, path: Path, meta: dict, model, ctx, *, threads: int, gpu_layers: int,
                 max_batch: int, n_ctx_seq: int, prefill_step: int, cell_bytes: int, options: EngineOptions,
                 cells: str, streams: bool, overcommit: bool):
        self._path, self._meta, self._model, self._ctx = path, meta, model, ctx
        self._threads, self._gpu_layers, self._max_batch = threads, gpu_layers, max_batch
        self._cell_bytes, self._cells = cell_bytes, cells
        self._pool = ll.llama_n_ctx(ctx)  # KV cells shared by every sequence
        self._n_ctx_seq = min(n_ctx_seq, self._pool)  # the most one sequence may hold
        capacity = min(ll.llama_n_batch(ctx), ll.llama_n_ubatch(ctx))  # one pass, never split
        self._step = max(3, min(prefill_step, capacity - max_batch))  # prompt tokens a chunk holds at most
        self._memory = ll.llama_get_memory(ctx)
        self._tokenizer = LlamaTokenizer(model)
        self._n_vocab = self._tokenizer.vocab_size
        eos = ll.llama_vocab_eos(ll.llama_model_get_vocab(model))
        self._fallback = eos if eos != ll.LLAMA_TOKEN_NULL else min(self._tokenizer.eos_token_ids, default=0)
        self._checkpoints = llama_cache.needs_checkpoints(model)
        self._warming = False  # the warm-up's sequences neither reuse nor store prompts
        size = default_cache_bytes(available_memory()) if options.cache_bytes is None else options.cache_bytes
        self._prompts = PromptCache(size, options.cache_entries, recompute=RECOMPUTE)
        self._sharing = self._prompts.enabled and not self._checkpoints
        self._slots: dict[int, Slot] = {}  # running, by the runtime's sequence id, in the order added
        self._retired: deque[Slot] = deque()  # ended while others ran: their cells stay until released
        self._free_ids = deque(range(ll.llama_n_seq_max(ctx)))
        self._streams = streams  # a stream of cells per sequence id, not one pool
        self._overcommit = overcommit  # claims hold headroom, not whole answers: the newest may be preempted
        self._claims: dict[int, int] = {}  # the running sequences' claims, as the scheduler last gave them
        self._pending: set[int] = set()  # streams in a copy llama.cpp makes at the next decode
        self._stream_copies = 0
        self._cells_used = 0  # a snapshot for cache_stats(), which any thread may call
        self._batch = Batch(capacity)
        self._close = weakref.finalize(self, _free_native, self._tokenizer, ctx, model)

    @classmethod
    def load(cls, path: Path, options: EngineOptions, progress=None, *, kv_cells: int | None = None,
             streams: bool | None = None) -> LlamaEngine:
        """``kv_cells``: the pool's size (default: from memory, ``llama_batch.plan_pool``); a pool
        smaller than the context also shortens the context to it. ``streams``: a stream of cells per
        sequence instead of one pool (default: on a GPU, where every sequence's whole context fits
        the memory plan); see :meth:`_compact`."""
        path = resolve(path)
        meta = check_gguf(path)
        if options.max_batch is not None and not 1 <= options.max_batch <= MAX_SEQUENCES:
            raise EngineError(f"{path}: max_batch must be 1 to {MAX_SEQUENCES}, not {options.max_batch}")
        params = ll.llama_model_default_params()
        params.n_gpu_layers = -1 if ll.llama_supports_gpu_offload() else 0  # -1: every layer
        params.use_extra_bufts = not amx_in_use()
        if progress is not None:
            total = path.stat().st_size

            def on_progress(fraction: float, _user) -> bool:
                try:
                    progress(int(fraction * total), total)
                except Exception:  # an exception cannot cross back into C
                    log.exception("load progress callback failed")
                return True

            params.progress_callback = ll.llama_progress_callback(on_progress)  # params keeps it alive
        NATIVE_LOG.errors.clear()
        model = ll.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            reason = NATIVE_LOG.errors[0] if NATIVE_LOG.errors else "no reason given"
            if "unknown model architecture" in reason:
                arch = meta.get("general.architecture")
                raise EngineError(f"{path}: unsupported architecture {arch!r} for this llama.cpp build")
            raise EngineError(f"{path}: llama.cpp cannot load it: {reason}")
        gpu = bool(params.n_gpu_layers)
        threads = options.threads or physical_cores()
        cell_bytes = kv_cell_bytes(model, meta)
        free = (gpu_free_memory() if gpu else None)
        if free is None:
            free = max(0, available_memory() - ll.llama_model_size(model))
        kv_bytes = options.kv_bytes or free // 2  # by default half the memory free beyond the weights
        trained = ll.llama_model_n_ctx_train(model)
        n_ctx_seq = options.ctx_size or fit_context(trained, lambda n: n * cell_bytes, kv_bytes)
        if n_ctx_seq < trained and not options.ctx_size:
            held = "--kv-memory" if options.kv_bytes else "half the free memory"
            log.warning("%s: context %d tokens of the model's %d, as much as %s holds (--ctx-size sets "
                        "another)", path.name, n_ctx_seq, trained, held)
        step = max(3, min(options.prefill_step or PREFILL_STEP, n_ctx_seq))
        whole = llama_cache.needs_checkpoints(model)  # their states resume whole: one pool
        # preempting a sequence moves where the others' next cells land, and with them the order
        # attention sums in: not where results must be bit for bit, nor for states resumed whole
        overcommit = not (options.deterministic or whole)
        max_batch, pool = plan_pool(n_ctx_seq, cell_bytes, kv_bytes, gpu, options.max_batch, overcommit)
        pool = kv_cells or pool
        n_seq_max = min(MAX_SEQUENCES, 2 * max_batch)  # running ones, and as many retired
        if streams is None:
            streams = gpu
            # every stream holds a whole context: retired ones only as far as the KV's share allows
            fit = kv_bytes // max(1, cell_bytes) // n_ctx_seq - max_batch
            streams = streams and not kv_cells and fit >= 0 and not whole
            n_seq_max = min(n_seq_max, max_batch + max(0, fit)) if streams else n_seq_max
        streams = streams and not whole
        if streams:
            pool = n_seq_max * n_ctx_seq
        # one pass holds every decoding row and a step's prompt chunks: one chunk on a CPU, several
        # on a GPU, where the worker's budget is GPU_PREFILL_CHUNKS of them (32 newcomers' 640-token
        # prompts then take about a quarter of the passes); llama.cpp asserts n_batch >= n_seq_max
        chunks = GPU_PREFILL_CHUNKS if gpu else 1
        capacity = max(chunks * step + max_batch, n_seq_max)
        cparams = ll.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max = max(pool, capacity), n_seq_max
        cparams.n_batch = cparams.n_ubatch = capacity
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        cells = llama_cache.set_cache_params(cparams, gpu, options.deterministic, streams)
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            ll.llama_model_free(model)
            reason = NATIVE_LOG.errors[0] if NATIVE_LOG.errors else "no reason given"
            raise EngineError(f"{path}: llama.cpp cannot create a context of {pool} cells: {reason}")
        gpu_layers = ll.llama_model_n_layer(model) if gpu else 0
        engine = cls(path, meta, model, ctx, threads=threads, gpu_layers=gpu_layers, max_batch=max_batch,
                     n_ctx_seq=n_ctx_seq, prefill_step=step, cell_bytes=cell_bytes, options=options,
                     cells=cells, streams=streams, overcommit=overcommit and not streams)
        warm_up_before_ready(engine, options, gpu)
        return engine

    def warm_up(self) -> float:
        """Run once, before ready, the passes serving makes, as llama-server does at its start: on an
        H100 (2026-12-06) a fresh process's first
        request took 69-228 ms for a 19-token prompt, where a later 128-token one took 7-17 ms, and
        its first pass of each size (about 125 prompt tokens, then about 500) 34-120 ms. Two short
        prompts read and decoded together, then one each of 128 tokens, a chunk and a whole pass,
        each decoding four tokens. Nothing reaches the prompt cache. Returns seconds."""
        started = time.perf_counter()
        greedy, budget = SamplingParams(temperature=0.0), self._batch.capacity
        room = self._n_ctx_seq - 8
        sizes = sorted({n for n in (min(n, room) for n in (16, 128, self._step, budget - self._max_batch))
                        if n > 0})
        rows = min(self._max_batch, 2)
        self._warming = True
        try:
            for size in sizes:
                for row in range(rows if size == sizes[0] else 1):
                    self.add(-1 - row, [(5 * i + 7 * row + size) % self._n_vocab for i in range(size)], greedy, 4)
                produced = dict.fromkeys(self._slots, 0)
                for _ in range(64):  # bounded: a pass that finds no room returns nothing
                    for seq, _step in self.step(budget):
                        produced[seq] += 1
                    if min(produced.values()) >= 4:
                        break
                for seq in list(self._slots):
                    self.remove(seq)
        finally:
            for seq in list(self._slots):
                self.remove(seq)
            self._warming = False
        return time.perf_counter() - started

    @property
    def _caching(self) -> bool:
        return self._prompts.enabled and not self._warming

    @property
    def tokenizer(self) -> LlamaTokenizer:
        return self._tokenizer

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def info(self) -> EngineInfo:
        self._check_open()
        quant = ll.llama_ftype_name(ll.llama_model_ftype(self._model)) or b"unknown"
        cache = self._prompts
        details = {"prompt_cache": f"{cache.max_bytes / 1e6:.0f} MB, {cache.max_entries} entries"
                   + (", checkpoints" if self._checkpoints else "")} if cache.enabled else {}
        kv_bytes = self._pool * self._cell_bytes
        return EngineInfo(
            engine=self.name,
            device="gpu" if self._gpu_layers else "cpu",
            backend=backend_name(),
            model_format="gguf",
            context_length=self._n_ctx_seq,
            memory_bytes=ll.llama_model_size(self._model) + kv_bytes,
            prefill_step=self._step,
            details={
                "architecture": str(self._meta.get("general.architecture")),
                "quantization": quant.decode(),
                "threads": str(self._threads),
                "n_gpu_layers": str(self._gpu_layers),
                "max_batch": str(self._max_batch),
                "kv_cells": f"{self._pool} {self._cells} ({kv_bytes / 1e6:.0f} MB), "
                            + (f"a stream for each of {ll.llama_n_seq_max(self._ctx)} sequences"
                               if self._streams else "one pool"
                               + (", the newest sequences preempted when it fills" if self._overcommit else "")),
                "n_batch": str(self._batch.capacity),
                "file": str(self._path),
                **details,
            },
        )

    # -- the runner ------------------------------------------------------------------------------

    @property
    def pass_tokens(self) -> int:
        return self._batch.capacity  # one llama_batch, never split

    @property
    def shares_prefixes(self) -> bool:
        return self._sharing

    @property
    def reserves_answers(self) -> bool:
        """Without overcommit (bit-for-bit cells, checkpointed states, a stream per sequence) a
        sequence is never preempted: its whole answer is promised cells at admission."""
        return not self._overcommit

    def check(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        self._check_open()
        ids = np.asarray([int(t) for t in prompt], dtype=np.int32)
        n, room = len(ids), self._n_ctx_seq
        if not n:
            raise EngineError("empty prompt: give at least one token")
        if ids.min() < 0 or ids.max() >= self._n_vocab:
            raise EngineError(f"prompt has a token id outside the vocabulary of {self._n_vocab}")
        if n >= room:
            raise EngineError(f"prompt of {n} tokens leaves no room in a {room}-token context")
        if max_tokens < 1 or n + max_tokens > room:
            raise EngineError(f"prompt of {n} tokens and max_tokens {max_tokens} do not fit a {room}-token context")
        _check_params(params, self._n_vocab)

    def accept(self, seq: int, prompt: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        if not self._free_ids:
            self._release(self._retired.popleft())
        ids = np.asarray([int(t) for t in prompt], dtype=np.int32)
        self._slots[seq] = Slot(seq, self._take_id(), ids, max_tokens, Sampler(params, self._n_vocab, self._fallback))

    def fits(self, claims, new=None) -> bool:
        """Cells: what every held sequence may still add up to its claim (one not started yet: less
        what it shares with a live one), and a starting one's headroom (``HEADROOM_PER_ROW``),
        against the cells no sequence holds; ended sequences give theirs back, oldest first, while
        that is short. With a stream per sequence, a free stream."""
        if new is not None and self._overcommit and any(s.started for s in self._holders()):
            decoding = sum(slot.decoding for slot in self._slots.values())
            prompt, claim, max_tokens = new
            new = prompt, claim + min(max_tokens, HEADROOM_PER_ROW * (1 + decoding)), max_tokens
        if not self._streams:
            while self._growth(claims, new) > self._free_now() and self._retired:
                self._release(self._retired.popleft())
            if self._growth(claims, new) > self._free_now():
                return False
        if new is not None and not self._free_ids:
            if not self._retired:
                return False
            self._release(self._retired.popleft())
        return True

    def claimed(self, claims) -> None:
        self._claims = dict(claims)

    def reusable(self, seq: int) -> int:
        slot = self._slots[seq]
        stored = self._prompts.peek(slot.prompt) if self._caching else 0
        return max(self._best_share(slot.prompt)[1], stored)

    def start_step(self) -> None:
        if self._streams:
            self._compact()

    def begin(self, seq: int) -> int:
        """Put the longest reusable prefix of the slot's prompt into its cells: shared with a running
        sequence, or restored from the prompt cache where that holds more and its cells fit."""
        slot = self._slots[seq]
        source, share = self._best_share(slot.prompt)
        stored = self._prompts.peek(slot.prompt) if self._caching else 0
        claim = self._claims.get(seq, len(slot.prompt))
        while claim - share > self._room_for(slot) and self._retired:
            self._release(self._retired.popleft())
            source, share = self._best_share(slot.prompt)
        # a restore takes new cells for all of it, written at once: not into a stream still to be copied
        restore = stored > share and claim <= self._room_for(slot) and slot.id not in self._pending
        ll.llama_memory_seq_rm(self._memory, slot.id, -1, -1)
        if restore:
            blob, reused = self._prompts.lookup(slot.prompt, share)
            try:
                llama_cache.restore(self._ctx, slot.id, blob, reused)
            except EngineError as e:
                log.warning("%s: %s; computing the prompt instead", self._path.name, e)
                reused = 0
            slot.begin(reused, None)
            return reused
        if self._caching:
            self._prompts.record(share)
        if share and self._streams:
            self._copy(source.id, slot.id, share)
        elif share:
            ll.llama_memory_seq_cp(self._memory, source.id, slot.id, 0, share)
        slot.begin(share, source if share and not self._streams else None)
        return share

    def chunk_end(self, start: int, stop: int, budget: int | None) -> int | None:
        return next_chunk(start, stop, self._step, self._checkpoints, stop - start if budget is None else budget)

    def preempt(self, seq: int) -> list[tuple[int, Step]]:
        """Take the sequence's cells: its state is offered to the prompt cache (reading it again is
        then mostly a restore) and it waits to read what it held."""
        slot = self._slots[seq]
        log.info("%s: the KV pool (%d cells) is full: sequence %d preempted after %d tokens, to be read "
                 "again", self._path.name, self._pool, seq, len(slot.held))
        if slot.started:
            self._release(slot)
        else:
            self._free_ids.append(slot.id)
        slot.reset()
        slot.id = self._take_id()
        return []

    def readmit(self, seq: int, prompt: Sequence[int], max_tokens: int) -> None:
        slot = self._slots[seq]
        slot.prompt, slot.max_tokens = np.asarray(prompt, dtype=np.int32), max_tokens

    def release(self, seq: int) -> None:
        """A sequence that ends while others run keeps its cells (retired): freeing them would let
        the others' next cells land below their earlier ones, and attention, which reads a
        sequence's cells in the pool's order, would round differently. Retired cells are released,
        their state going to the prompt cache, once nothing runs, or when a newcomer needs them."""
        slot = self._slots.pop(seq, None)
        if slot is None:
            return
        slot.free()
        if not self._close.alive:
            return
        if not slot.started:  # it holds no cells
            self._free_ids.append(slot.id)
        elif any(other.started for other in self._slots.values()):
            self._retired.append(slot)
        else:
            while self._retired:
                self._release(self._retired.popleft())
            self._release(slot)

    def _release(self, slot: Slot) -> None:
        """Offer the slot's state to the prompt cache and free its cells and sequence id."""
        try:
            if slot.started and self._caching and slot.id not in self._pending:
                self._store(slot)
        finally:
            ll.llama_memory_seq_rm(self._memory, slot.id, -1, -1)
            slot.runs = []
            self._free_ids.append(slot.id)
            self._cells_used = cells_in_use(self._holders())

    def _holders(self):
        """Every slot whose cells are in the pool: running ones, then retired ones."""
        return itertools.chain(self._slots.values(), self._retired)

    def run(self, plan: Plan) -> list[tuple[int, Step]]:
        """One ``llama_batch``: a token for each decoding sequence (first), then the planned prompt
        chunks; each sequence samples from its own logits row. Where llama.cpp finds no room for the
        chunks, the decode rows go alone and the chunks wait a step."""
        self._check_open()
        batch, work = self._batch, []
        batch.clear()
        if self._streams:
            self._compact()
        decode = [self._slots[seq] for seq in plan.decode]
        for slot in sorted(decode, key=lambda s: s.id) if self._streams else decode:
            if slot.decoding:
                work.append((slot, [slot.next_token], batch.add(slot.id, [slot.next_token], len(slot.held), True)))
        decoding = len(work)
        for chunk in plan.chunks:
            slot = self._slots[chunk.seq]
            tokens, last = slot.prompt[chunk.start:chunk.end], chunk.end == len(slot.prompt)
            row = batch.add(slot.id, tokens, chunk.start, last)
            work.append((slot, tokens, row if last else None))
        if batch.n == 0:
            return []
        rc = ll.llama_decode(self._ctx, batch.ready())
        if rc == 1 and 0 < decoding < batch.n:  # no room for the prompt chunks: they wait a step
            log.warning("%s: llama.cpp found no KV slot for %d tokens (%d cells free by our count)",
                        self._path.name, batch.n, self._free_now())
            plan.deferred.update(slot.seq for slot, _, _ in work[decoding:])
            del work[decoding:]
            batch.n = decoding
            rc = ll.llama_decode(self._ctx, batch.ready())
        if rc != 0:
            self._fail(f"llama_decode failed (code {rc}) on a batch of {batch.n} tokens")
        self._pending.clear()
        exact = batch.n >= 2
        for slot, tokens, _ in work:
            slot.extend(tokens, exact)
            self._checkpoint(slot)
        self._cells_used = cells_in_use(self._holders())
        out = []
        for slot, _, row in work:
            if row is None:
                continue
            try:
                step = slot.sampler.sample(self._ctx, row)
            except RuntimeError as e:  # llama.cpp kept no logits for the row
                self._fail(f"sampling failed: {e}")
            if not slot.produced:
                step = Step(step.token, step.logprob, step.top_logprobs, slot.cached)
            slot.produced += 1
            slot.next_token = step.token
            out.append((slot.seq, step))
        return out

    def _take_id(self, avoid: set[int] = frozenset()) -> int:
        """A free sequence id: with streams the lowest (not in ``avoid`` where one is), so running
        sequences stay on consecutive ids."""
        if not self._streams:
            return self._free_ids.popleft()
        chosen = min((i for i in self._free_ids if i not in avoid), default=None)
        chosen = min(self._free_ids) if chosen is None else chosen
        self._free_ids.remove(chosen)
        return chosen

    def _compact(self) -> None:
        """With a stream per sequence llama.cpp computes a pass in one graph only over consecutive
        sequence ids (``split_equal``: each gap costs another graph, about a whole step's overhead),
        so the running sequences that hold cells are kept on ids 0..m-1. One that ends leaves a gap
        (it stays there, retired, until this runs): the highest running sequence moves into it, and
        the retired one moves out to a free id at the top, or gives its state to the prompt cache
        when none is free. A move is a copy of the stream on the device, which llama.cpp makes at the
        next decode, before that pass's own writes (:meth:`_copy`)."""
        running = [s for s in self._slots.values() if s.started]
        m = len(running)
        holes = sorted(set(range(m)) - {s.id for s in running})
        misplaced = sorted((s for s in running if s.id >= m), key=lambda s: -s.id)
        for hole, slot in zip(holes, misplaced):
            waiting = next((s for s in self._slots.values() if s.id == hole and not s.started), None)
            retired = next((s for s in self._retired if s.id == hole), None)
            if retired is not None:
                top = max((i for i in self._free_ids if i >= m), default=None)
                if top is None:
                    self._retired.remove(retired)
                    self._release(retired)
                else:
                    self._free_ids.remove(top)
                    self._move(retired, top)
            if hole in self._free_ids:
                self._free_ids.remove(hole)
            self._move(slot, hole)
            if waiting is not None:  # it holds no cells yet: another id will do
                waiting.id = self._take_id(avoid=self._pending)

    def _move(self, slot: Slot, to: int) -> None:
        self._copy(slot.id, to, -1)
        ll.llama_memory_seq_rm(self._memory, slot.id, -1, -1)
        self._free_ids.append(slot.id)
        slot.id = to

    def _copy(self, source: int, to: int, keep: int) -> None:
        """Sequence ``to`` holds ``source``'s first ``keep`` cells (-1: all) once the next decode has
        copied the stream: llama.cpp copies across streams only whole streams."""
        ll.llama_memory_seq_cp(self._memory, source, to, -1, -1)
        if keep >= 0:
            ll.llama_memory_seq_rm(self._memory, to, keep, -1)
        self._pending |= {source, to}
        self._stream_copies += 1

    def _best_share(self, prompt: np.ndarray) -> tuple[Slot | None, int]:
        """The running or retired sequence whose computed cells hold the longest prefix of ``prompt``
        (leaving RECOMPUTE tokens to compute), and that prefix's length."""
        best, length = None, 0
        if not self._sharing:
            return best, length
        for slot in self._holders():
            if slot.started:
                k = min(common_prefix(slot.prompt, prompt), slot.exact, len(prompt) - RECOMPUTE)
                if k > length:
                    best, length = slot, k
        return best, length

    def _growth(self, claims, new) -> int:
        """Cells the held sequences (and ``new``) may still add up to their claims."""
        total = 0
        for seq, claim in claims.items():
            slot = self._slots.get(seq)
            if slot is not None:
                held = len(slot.held) if slot.started else self._best_share(slot.prompt)[1]
                total += max(0, claim - held)
        if new is not None:
            total += max(0, new[1] - self._best_share(np.asarray(new[0], dtype=np.int32))[1])
        return total

    def _room_for(self, slot: Slot) -> int:
        """Cells ``slot`` may take now: those no sequence holds, less what the other started
        sequences may still add up to their claims."""
        others = sum(max(0, self._claims.get(s.seq, len(s.held)) - len(s.held))
                     for s in self._slots.values() if s is not slot and s.started)
        return self._free_now() - others

    def _free_now(self) -> int:
        """Cells no sequence holds now (promised ones included)."""
        return self._pool - cells_in_use(self._holders())

    def _checkpoint(self, slot: Slot) -> None:
        """Store a recurrent or sliding-window sequence's state at the prefill marks (see cache.py)."""
        end, stop = len(slot.held), len(slot.prompt)
        if (self._checkpoints and self._caching and slot.exact == end <= stop
                and (end % self._step == 0 or end == stop - RECOMPUTE)):
            self._prompts.insert(slot.held, SequenceState(self._ctx, slot.id, trimmable=False))

    def _store(self, slot: Slot) -> None:
        """Offer an ending sequence's state to the prompt cache: the tokens computed in passes of two
        rows or more (a state that cannot be cut back: only when that is all of it). On a GPU only
        its prompt: llama.cpp copies a state out one run of cells per layer at a time, and a sequence
        decoded beside others holds its generated tokens one cell apart (a copy from the device each),
        so 256 generated tokens made ~12,000 copies; an answer is recomputed in milliseconds there."""
        keep = slot.exact if not self._gpu_layers else min(slot.exact, len(slot.prompt))
        if not keep or (self._checkpoints and keep < len(slot.held)):
            return
        if keep < len(slot.held):
            ll.llama_memory_seq_rm(self._memory, slot.id, keep, -1)
        self._prompts.insert(slot.held[:keep], SequenceState(self._ctx, slot.id, trimmable=not self._checkpoints))

    def _fail(self, message: str) -> None:
        """Drop every sequence (their cells may hold part of the failed pass) and raise."""
        for slot in self._slots.values():
            slot.free()
        self._free_ids = deque(range(ll.llama_n_seq_max(self._ctx)))
        self._slots.clear()
        self._retired.clear()
        self._pending.clear()
        self._cells_used = 0
        ll.llama_memory_clear(self._memory, True)
        raise EngineError(f"{self._path}: {message}; every running sequence was dropped")

    # -- the rest ------------------------------------------------------------------------------

    def score(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits of every position, computed in chunks of two or more tokens, with no sequence held
        (a :meth:`generate` still open is closed)."""
        self._check_open()
        self._end_solo()
        if self._slots:
            raise EngineError(f"score needs an idle engine; {len(self._slots)} sequences are running")
        ids = [int(t) for t in tokens]
        if not ids or len(ids) > self._n_ctx_seq or min(ids) < 0 or max(ids) >= self._n_vocab:
            raise EngineError(f"score needs 1 to {self._n_ctx_seq} token ids in [0, {self._n_vocab})")
        if not self._free_ids:
            self._release(self._retired.popleft())
        batch, rows, pos, seq = self._batch, [], 0, self._free_ids[0]
        try:
            for end in batch_ends(0, len(ids), self._step, checkpoints=False):
                batch.clear()
                batch.add(seq, ids[pos:end], pos, True)
                batch.all_logits()
                rc = ll.llama_decode(self._ctx, batch.ready())
                if rc != 0:
                    raise EngineError(f"{self._path}: llama_decode failed (code {rc}) at position {pos}")
                rows.extend(np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(self._n_vocab,))
                            .copy() for i in range(end - pos))
                pos = end
        finally:
            ll.llama_memory_seq_rm(self._memory, seq, -1, -1)
        return np.stack(rows).astype(np.float32)

    def _check_open(self) -> None:
        if not self._close.alive:
            raise EngineError(f"{self._path}: the llama engine is closed")

    def kv_state_bytes(self) -> int:
        """Bytes llama.cpp writes for the whole context (every cell in use once, plus the last pass's
        logits): its own measure of what the running sequences hold. On the engine's thread only."""
        self._check_open()
        return ll.llama_state_get_size(self._ctx)

    def cache_stats(self) -> dict:
        stats = {**self._prompts.stats(), **super().cache_stats(), "kv_cells": self._pool,
                 "kv_cells_used": self._cells_used}
        return {**stats, "kv_stream_copies": self._stream_copies} if self._streams else stats

    def close(self) -> None:
        for slot in self._slots.values():
            slot.free()
        self._slots.clear()
        self._retired.clear()
        self._prompts.clear()
        self._close()
