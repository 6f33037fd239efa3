"""The native MLX engine: Hugging Face safetensors folders and llama GGUF files through mlx-lm's models,
decoding many sequences together (continuous batching).

A runner for ``runtime.scheduler``: each step it reads the planned prompt chunks (a sequence's own
layer caches, resumed from the prompt cache or from a live sequence's state when one shares a prefix
with it; chunks that start at the same position read in one pass on a GPU), then a sequence whose
prompt is read joins the decode group (``batch.DecodeGroup``): one forward pass a step for every
decoding row, each sampled by its own settings (``sampling``). Models whose layer caches mlx-lm
cannot batch get one group per sequence, stepped one after the other. The memory the sequences' KV
needs (``cache.Footprint``) is what the scheduler admits and preempts by; the prompt cache
(``prompt_cache.PromptCache`` holding ``cache.Frozen`` states) keeps what they leave of it. On a
GPU, step n+1 is queued before step n is read.

Everything MLX runs on the thread that calls :meth:`MLXEngine.load`; this module starts no threads.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from mesh_llm.system.blas import prepare_mlx, set_blas_threads

_BLAS = prepare_mlx()  # must run before mlx and mlx-lm are first imported in the process

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mesh_llm.engines.base import (
    PREFILL_STEP,
    TYPICAL_SEQUENCE,
    Engine,
    EngineError,
    EngineInfo,
    EngineOptions,
    Plan,
    SamplingParams,
    Step,
    Tokenizer,
    fit_context,
    warm_up_before_ready,
)
from mesh_llm.engines.hf_tokenizer import first_line
from mesh_llm.engines.mlx.batch import DecodeGroup, Row, batch_rows, first_positions, kv_copies, row_index
from mesh_llm.engines.mlx.cache import Footprint, Frozen, free_memory, needs_checkpoints, unbatchable
from mesh_llm.engines.mlx.kernels import attention as mlx_attention
from mesh_llm.engines.mlx.load import cuda_settings, load_any, on_gpu, text_config
from mesh_llm.engines.mlx.sampling import SequenceSampler
from mesh_llm.engines.prompt_cache import PromptCache, default_cache_bytes
from mesh_llm.runtime.scheduler import common_prefix
from mesh_llm.system import native
from mesh_llm.system.machine import physical_cores

log = logging.getLogger(__name__)

# Live sequences' KV may take up to this share of the memory free at load (``--kv-memory`` sets
# another size), counted twice (a join or leave copies the batch's KV once); the prompt cache gets
# what they leave of it, up to its own size. The rest is for activations and the allocator.
MEMORY_SHARE = 0.75
# Answer tokens a sequence is admitted (or resumed after preemption) with room for, beyond its prompt:
# one growth step of mlx-lm's KV buffers. It reserves no more ahead (not max_tokens, nor for a request
# without one the rest of the context); when the rows outgrow the memory, the newest is preempted.
ANSWER_HEADROOM = 256
# Most sequences decoded together by default: a GPU's step time hardly grows with the batch; on a
# CPU it does, and each sequence slows down (SmolLM2 on 2 cores: 16 tok/s alone, 10.8 each at 8, 8
# at 16; docs/performance.md).
MAX_BATCH_GPU, MAX_BATCH_CPU = 32, 8
_CLEAR_EVERY = 256  # steps between returns of the allocator's cached buffers
# Prompt chunks padded to a multiple of this many tokens on CUDA, so
# that a new prompt length reuses MLX's CUDA graphs instead of building them again (with
# mlx_attention.prefill_in_steps). On the H200 (2026-12-04), three runs each: the first 640-token request after
# the warm-up got its first token in 27.9-41.6 ms padded against 44.0-63.8 unpadded, a 641-token one
# after it in 23.6-39.2 against 42.8-65.3.
# Elsewhere padding only adds arithmetic.
CUDA_PREFILL_BUCKET = 64
WIDE_CHUNK = 512  # chunks over this many tokens are padded to four buckets (256 tokens on CUDA)
# A sequence's prompt tokens per pass on a GPU (``--prefill-step`` otherwise): a 640-token prompt is
# read in one pass, not two, and each pass costs the host its kernel count whatever its rows. On the
# H200 (2026-12-05), 640-token prompts alternated with 512: 0.5B at 8 streams TTFT p50 110-182 ms against 183-312,
# at 32 streams 4,172 / 4,351 tok/s against 3,644 / 4,192; the 7B shape even. The warm-up reads ten
# padded widths, not eight (+0.1-0.2 s).
GPU_PREFILL_STEP = 1024
# Reading prompts together, a newcomer starts from a stored or running prefix only if it holds at
# least this many tokens. Chat prompts that share only a template's first few tokens would otherwise
# start at as many positions and be read in as many passes, each newcomer's prefix copied out first;
# recomputing fewer tokens than this costs a GPU nothing.
TOGETHER_MIN_REUSE = 64


class _Sequence(Row):
    """A sequence from add to remove: its prompt, its own caches while it reads the prompt, then its
    row in a decode group."""

    def __init__(self, seq: int, prompt: list[int], sampler: SequenceSampler):
        self.id, self.prompt, self.sampler = seq, prompt, sampler
        self.tokens = list(prompt)
        self.cache: list[Any] | None = None  # its own layer caches while it reads its prompt
        self.read = 0  # prompt tokens those caches hold
        # The layer caches of the forward pass that read its last chunk with other rows', and its row
        # there: ``cache`` then holds views of that row, not copies (``_read_together``).
        self.shared: tuple[list[KVCache], int] | None = None
        self.fed = self.reused = 0
        self.first = self.alive = True
        self.group: DecodeGroup | None = None

    def state_tokens(self) -> int:
        """How many leading tokens its current state holds."""
        return self.read if self.group is None else self.fed


class MLXEngine(Engine):
    """A model loaded into MLX, decoding up to ``max_batch`` sequences together on the loading thread."""

    name = "mlx"
    formats = frozenset({"safetensors", "gguf"})

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, config: dict[str, Any],
                 context_length: int, options: EngineOptions, details: dict[str, str],
                 model_format: str, pipelined: bool | None = None, together: bool | None = None,
                 bucket: int = 0, keep_slots: bool | None = None):
        """``pipelined``: queue step n+1 before reading step n (default: on a GPU only), except a
        step that samples a newcomer's first token, read at once.
        ``together``: prompt chunks that start at the same position are read in one forward pass
        (default: on a GPU only, where a pass costs about the same for one row or eight; a CPU's
        cost grows with the rows, and one pass per sequence keeps its results those of a solo run).
        ``bucket``: prompt chunks padded to a
        multiple of this many tokens, the padding then cut from the KV (plain KV caches only; 0: off),
        and their attention reading keys in whole steps where routed
        (``mlx_attention.install(model, in_steps=True)``). On CUDA a chunk of a new width or key count
        rebuilds MLX's CUDA graphs (8 of them, 19.5 ms, for a 0.5B prompt: H200, 2026-12-04); with
        both bounded, prompts of any length make few shapes.
        ``keep_slots``: a row that leaves the decode batch leaves its slot for newcomers
        (``batch``; default: where pipelined, as on a GPU, whose step costs the same for one row
        more; a CPU's grows with the rows)."""
        self._model = model
        self._tokenizer = tokenizer
        self._vocab = int(text_config(config).get("vocab_size") or tokenizer.vocab_size)
        self._context = context_length
        if options.prefill_step is None:
            options = replace(options, prefill_step=GPU_PREFILL_STEP if on_gpu() else PREFILL_STEP)
        self._options = options
        self._details = details
        self._format = model_format
        self._pipelined = on_gpu() if pipelined is None else pipelined
        self._keep_slots = self._pipelined if keep_slots is None else keep_slots
        self._eos = np.zeros(self._vocab, dtype=bool)
        self._eos[[t for t in tokenizer.eos_token_ids if t < self._vocab]] = True
        self._seqs: dict[int, _Sequence] = {}
        self._groups: list[DecodeGroup] = []
        self._steps = 0
        fresh = make_prompt_cache(model)
        if together is None:
            together = on_gpu()
        plain = all(type(c) is KVCache for c in fresh)
        self._together = together and plain  # stacked, split again
        # Reading together, a newcomer reuses no prefix under TOGETHER_MIN_REUSE tokens (then it
        # starts at position 0 with the others), or under a chunk where chunks are shorter (one that
        # waited for a shared chunk reuses it); a shared prefix shorter than a chunk costs less read
        # again than waited for.
        self._least_reuse = min(TOGETHER_MIN_REUSE, max(1, options.prefill_step)) if self._together else 0
        self.least_shared_wait = max(1, options.prefill_step) if self._together else 1
        self._bucket = bucket if plain and bucket > 0 else 0  # cut back by trimming the caches
        self._checkpoints = needs_checkpoints(fresh)
        self._unbatchable = unbatchable(fresh)
        self._footprint = Footprint.measure(model)
        self._pool = options.kv_bytes or int(free_memory() * MEMORY_SHARE)  # counted twice
        if not options.ctx_size:
            self._context = fit_context(context_length, self._footprint_bytes, self._pool)
            if self._context < context_length:
                log.warning("context %d tokens of the model's %d, as much as the engine's memory holds "
                            "(--ctx-size sets another)", self._context, context_length)
        self._max_batch = options.max_batch or self._default_max_batch()
        cache_bytes = options.cache_bytes
        if cache_bytes is None:
            cache_bytes = default_cache_bytes(free_memory())
        self._cache_bytes = cache_bytes
        self._prompts = PromptCache(cache_bytes, options.cache_entries)
        self._caching = self._prompts.enabled
        self.claimed({})
        if self._caching:
            self._details["prompt_cache"] = (f"{cache_bytes / 1e6:.0f} MB, {options.cache_entries} "
                                             f"entries" + (", checkpoints" if self._checkpoints else ""))
        if self._bucket:
            self._details["prefill_bucket"] = f"prompt chunks padded to a multiple of {self._bucket} tokens"
        self._details["max_batch"] = str(self._max_batch)
        self._details["kv_memory"] = (f"{self._pool / 1e6:.0f} MB, counted twice (a join or leave copies "
                                      f"the batch); the newest sequence preempted past it")
        self._details["batching"] = ("one forward pass for all sequences" if not self._unbatchable else
                                     f"one sequence a pass ({', '.join(self._unbatchable)} cannot batch)")

    @classmethod
    def load(cls, path: Path, options: EngineOptions, progress=None) -> MLXEngine:
        if problem := native.mlx_load_problem():  # MLX would crash here (SIGSEGV): say why instead
            raise EngineError(problem)
        threads = options.threads or physical_cores()
        set_blas_threads(threads)
        kernels = cuda_settings()
        model, config, tokenizer, fmt, details, ctx = load_any(Path(path), options, progress)
        details["blas"] = _BLAS
        bucket = CUDA_PREFILL_BUCKET if mlx_attention.on_cuda() else 0
        routed = mlx_attention.install(model, in_steps=bucket > 0)
        if routed and mlx_attention.fused_here():
            details["decode_attention"] = "one fused kernel for batched rows"
        if not on_gpu():
            details["threads"] = str(threads)
        if kernels:
            details["kernel_cache"] = kernels
        engine = cls(model, tokenizer, config, ctx, options, details, fmt, bucket=bucket)
        if (seconds := warm_up_before_ready(engine, options, on_gpu())) is not None:
            details["warm_up"] = f"{seconds:.1f} s"
        return engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def info(self) -> EngineInfo:
        gpu = on_gpu()
        if gpu:
            backend = "metal" if mx.metal.is_available() else "cuda"
        else:
            backend = "cpu+" + _BLAS.split(" ")[0]
        params = sum(v.nbytes for _, v in tree_flatten(self._model.parameters()))
        return EngineInfo(
            engine=self.name,
            device="gpu" if gpu else "cpu",
            backend=backend,
            model_format=self._format,
            context_length=self._context,
            memory_bytes=max(params, mx.get_active_memory()),
            prefill_step=self._options.prefill_step,
            details=dict(self._details),
        )

    @property
    def answer_headroom(self) -> int:
        return ANSWER_HEADROOM

    @property
    def shares_prefixes(self) -> bool:
        """A newcomer can start from a running sequence's state (plain KV caches, cut back to a
        prefix), so waiting for one that reads a shared prefix pays."""
        return self._caching and not self._checkpoints

    # -- the runner ------------------------------------------------------------------------------

    def check(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        if not len(prompt):
            raise ValueError("the prompt is empty")
        if len(prompt) >= self._context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds {self._context}")
        if min(prompt) < 0 or max(prompt) >= self._vocab:
            raise ValueError(f"prompt token ids must lie in [0, {self._vocab})")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        SequenceSampler.check(params)
        alone = self._footprint_bytes(min(len(prompt) + max_tokens, self._context))
        if alone > self._pool:
            raise EngineError(f"the sequence's KV would need {alone / 1e6:.0f} MB (x2 while rows join "
                              f"or leave) of the {self._pool / 1e6:.0f} MB this engine may use")

    def accept(self, seq: int, prompt: Sequence[int], params: SamplingParams, max_tokens: int) -> None:
        self._seqs[seq] = _Sequence(seq, [int(t) for t in prompt], SequenceSampler(params, self._vocab))

    def fits(self, claims, new=None) -> bool:
        ends = list(claims.values()) + ([new[1]] if new is not None else [])
        if self._reserved(ends) > self._pool and self._compact_groups():  # slots rows left hold memory
            return self._reserved(ends) <= self._pool
        return self._reserved(ends) <= self._pool

    def claimed(self, claims) -> None:
        """The prompt cache keeps what the running sequences leave of the engine's memory."""
        if self._caching:
            room = self._pool - self._reserved(list(claims.values()))
            self._prompts.resize(max(0, min(self._cache_bytes, room)))

    def reusable(self, seq: int) -> int:
        s = self._seqs[seq]
        if not self._caching:
            return 0
        live = self._best_live(s)[1]
        stored = self._prompts.peek(s.prompt)
        return max(n for n in (live, stored, 0) if n >= self._least_reuse or n == 0)

    def begin(self, seq: int) -> int:
        """Give the sequence its caches: the longest stored prefix of its prompt, or a copy of a live
        sequence's state when that shares more (plain KV models only), else fresh ones."""
        s = self._seqs[seq]
        cache, reused = None, 0
        if self._caching:
            source, live = self._best_live(s)
            cache, reused = self._prompts.lookup(s.prompt, live, least=self._least_reuse)
            if cache is None and reused:
                cache = (source.group.prefix(source, reused) if source.group is not None
                         else _kv_prefixes(source.cache, reused))
            if reused:
                log.debug("prompt cache: %d of %d prompt tokens reused", reused, len(s.prompt))
        s.cache = cache if cache is not None else make_prompt_cache(self._model)
        s.read = s.reused = reused
        s.shared = None
        return reused

    def chunk_end(self, start: int, stop: int, budget: int | None) -> int | None:
        """Chunks end at multiples of ``prefill_step`` (unless the budget cannot hold the first
        one's), so that a prompt is split the same way alone, batched or resumed, and rounds the same
        (a model that needs checkpoints leaves one there). The last prompt token is fed by the decode
        step: a chunk that reaches the one before it is the last."""
        step, target = max(1, self._options.prefill_step), stop - 1
        end = min((start // step + 1) * step, target)
        if budget is not None and end - start > budget:
            end = start + max(1, budget)
        return stop if end >= target else end

    def run(self, plan: Plan) -> list[tuple[int, Step]]:
        try:
            self._read(plan)
            out: list[tuple[Row, Step]] = []
            launches = [(g, g.launch()) for g in self._groups]
            if self._pipelined:  # read step n, queued at the last call, after queuing step n+1
                for g, launch in launches:
                    if g.unread is not None:
                        out += g.read(g.unread)
                    if not launch.outputs:
                        g.finish(launch)
                    g.unread = launch
                    if any(r.first and r.alive for r in launch.rows):  # a newcomer's first token:
                        out, g.unread = out + g.read(launch), None  # not held back behind the next build
            else:
                for g, launch in launches:
                    if not launch.outputs:
                        g.finish(launch)
                    out += g.read(launch)
        except Exception as e:
            self._drop_all()
            raise EngineError(f"generation failed: {first_line(e)}") from e
        self._steps += 1
        if self._steps % _CLEAR_EVERY == 0:
            mx.clear_cache()
        return [(row.id, step) for row, step in out]

    def release(self, seq: int) -> None:
        s = self._seqs.pop(seq, None)
        if s is None:
            return
        s.alive = False
        state, held = self._release(s)
        if state is not None and held > 0:
            self._keep(s.tokens[:held], state)

    def _release(self, s: _Sequence, vacate: bool = True) -> tuple[list[Any] | None, int]:
        """Take a sequence out of its decode group (``vacate``: its slot may stay, see
        ``DecodeGroup.leave``) or out of the prompts being read; returns its own layer caches, if
        any, and how many leading tokens they hold."""
        if s.group is None:
            state, held, s.cache = s.cache, s.read, None
            if s.shared is not None and state is not None:  # views would hold the whole batch
                state = _kv_prefixes(state, held)
            return state, held
        group, held = s.group, s.fed
        state = group.leave(s, vacate)
        if not group:
            self._groups.remove(group)
        s.group = None
        return state, held

    def warm_up(self) -> float:
        """Run once, before the first request, the shapes serving uses: MLX's CUDA backend compiles
        each kernel on its first use (then keeps it on disk, MLX_PTX_CACHE_DIR) and plans each new
        matrix product and attention shape once per process, which made a first request 5-17x slower
        than later ones. With chunks padded to a bucket, each padded width at the start and after a
        whole chunk; a prompt of one and a half chunks; then decode steps of one row and of two, whose
        first use builds the batched decode attention (``mlx_attention``: compiled once per GPU and
        kept on disk). Larger batch sizes are left to serving: a size's first join and step cost
        6-45 ms more than later ones, about what warming it cost, but before ready, 1.3 s for 32
        sizes (H200, 2026-12-04). Nothing reaches the prompt cache. Returns seconds."""
        started, caching = time.perf_counter(), self._caching
        self._caching = False
        try:
            chunk = max(1, self._options.prefill_step)
            long = max(2, min(chunk + chunk // 2, self._context - 4))
            short = max(2, min(16, self._context - 4))
            greedy = SamplingParams(temperature=0.0)
            top = min(chunk, self._context - 4)
            widths = sorted({self._padded(0, n) for n in range(1, top + 1)}) if self._bucket else []
            rows = min(self._max_batch, 2)
            for size in widths:  # every padded width, first in a prompt and after a whole chunk
                for offset in {0, min(chunk, self._context - 4 - size)}:
                    if offset < 0:  # no room for it after a chunk, only at a prompt's start
                        continue
                    # a width may reach the context (a prompt one short of it, padded), never pass it
                    length = min(offset + size + 1, self._context - 1)
                    self.add(-99, [(5 * i + size) % self._vocab for i in range(length)], greedy, 1)
                    while self._seqs[-99].group is None:  # its last chunk's step queues its first decode
                        self.step(chunk)
                    self.remove(-99)
            phases = [(f"{len(widths)} padded widths", time.perf_counter())]
            steps = 4 + 2 * rows  # no row ends before the last step
            self.add(-100, [(7 * i + 11) % self._vocab for i in range(long)], greedy, steps)
            for _ in range(4):
                self.step(4 * chunk)
            phases.append((f"a prompt of {long} tokens", time.perf_counter()))
            for row in range(rows - 1):
                self.add(-101 - row, [(13 * i + row) % self._vocab for i in range(short)], greedy, steps)
                self.step(chunk)
                self.step(chunk)
            phases.append((f"batch sizes up to {rows}", time.perf_counter()))
        finally:
            for seq in list(self._seqs):
                self.remove(seq)
            self._caching = caching
            mx.clear_cache()
        ended = time.perf_counter()
        marks = [started] + [t for _, t in phases]  # on a GPU each phase's last step is still queued
        log.info("warm-up phases: %s", ", ".join(f"{name} {b - a:.2f} s" for (name, _), a, b in
                                                  zip(phases, marks, marks[1:]) if b - a >= 0.005))
        return ended - started

    def score(self, tokens: Sequence[int]) -> np.ndarray:
        ids = [int(t) for t in tokens]
        if not ids or min(ids) < 0 or max(ids) >= self._vocab or len(ids) > self._context:
            raise ValueError(f"score needs 1 to {self._context} token ids in [0, {self._vocab})")
        self._end_solo()  # a generate() left open (parity checks) ends here, as in the llama engine
        if self._seqs:
            raise EngineError("score() runs only while no sequence is held")
        cache, step = make_prompt_cache(self._model), max(1, self._options.prefill_step)
        rows = []
        for start in range(0, len(ids), step):
            logits = self._model(mx.array(ids[start:start + step])[None], cache=cache)[0]
            rows.append(np.array(logits.astype(mx.float32)))
        return np.concatenate(rows)

    def cache_stats(self) -> dict:
        return {**self._prompts.stats(), **super().cache_stats()}

    def close(self) -> None:
        self._drop_all()
        self._prompts.clear()
        self._model = None
        mx.clear_cache()

    # -- reading prompts -------------------------------------------------------------------------

    def _read(self, plan: Plan) -> None:
        """The planned prompt chunks, each up to the token before its prompt's last (which the decode
        step feeds): one pass per sequence, or on a GPU one pass for the chunks that start at the same
        position. Sequences whose prompts are read join the decode group together."""
        pending: list[tuple[_Sequence, int]] = []  # chunks read together after the loop
        ready: list[_Sequence] = []  # prompts read, to join the decode group together
        for chunk in plan.chunks:
            s = self._seqs[chunk.seq]
            end = min(chunk.end, len(s.prompt) - 1)
            if s.read < end:
                if self._together:
                    pending.append((s, end))
                else:
                    self._read_chunk(s, end)
            self._done_reading(s, ready)
        starts = [s.read for s, _ in pending]  # before any is read
        for start in sorted(set(starts)):
            rows = [p for p, at in zip(pending, starts) if at == start]
            if len(rows) == 1:
                self._read_chunk(*rows[0])
            else:
                self._read_together(rows)
            for s, _ in rows:
                self._done_reading(s, ready)
        self._join(ready)

    def _done_reading(self, s: _Sequence, ready: list[_Sequence]) -> None:
        if s.group is None and s.read == len(s.prompt) - 1 and s not in ready:
            ready.append(s)

    def _read_chunk(self, s: _Sequence, end: int) -> int:
        step, target = max(1, self._options.prefill_step), len(s.prompt) - 1
        start = s.read
        pad = self._padded(start, end) - (end - start)
        with mlx_attention.keys_in_steps(bool(self._bucket)):
            self._model(mx.array(s.prompt[start:end] + [0] * pad)[None], cache=s.cache)
        for c in s.cache if pad else ():
            c.trim(pad)  # the padding follows the chunk's tokens: the causal mask kept it out of them
        self._evaluate([c.state for c in s.cache])
        s.read, s.shared = end, None
        if self._checkpoints and self._caching and (end % step == 0 or end == target):
            self._keep(s.prompt[:end], copy.deepcopy(s.cache))
        return end - start

    def _read_together(self, rows: list[tuple[_Sequence, int]]) -> None:
        """Chunks of several sequences that all hold ``start`` tokens, in one forward pass: their KV
        stacked into one batch cache (the last pass's as it is, where it read just these rows),
        shorter chunks right-padded (a causal mask keeps padding that follows a row's tokens out of
        them); then each row's caches are views of its row, up to its own end. Copying each row out
        and back cost two small ops a row and layer each time (on CUDA, host time per op)."""
        start = rows[0][0].read
        width = self._padded(start, max(end for _, end in rows))
        tokens = mx.array([s.prompt[start:end] + [0] * (width - (end - start)) for s, end in rows])
        last = _last_pass([s for s, _ in rows]) if start else None
        batch = []
        for layer in range(len(rows[0][0].cache)):
            c = KVCache()
            if last is not None:
                c.keys, c.values = first_positions(last[0][layer], last[1], start)
            elif start:
                c.keys = mx.concatenate([s.cache[layer].keys[..., :start, :] for s, _ in rows])
                c.values = mx.concatenate([s.cache[layer].values[..., :start, :] for s, _ in rows])
            c.offset = start
            batch.append(c)
        with mlx_attention.keys_in_steps(bool(self._bucket)):
            self._model(tokens, cache=batch)
        for i, (s, end) in enumerate(rows):
            s.cache = [_kv_view(c, i, end) for c in batch]
            s.read, s.shared = end, (batch, i)
        self._evaluate([a for c in batch for a in (c.keys, c.values)])

    def _padded(self, start: int, end: int) -> int:
        """The width of the chunk of prompt positions ``start`` to ``end`` once padded to its bucket
        (to four buckets over WIDE_CHUNK tokens, so that larger chunks, ``--prefill-step``, add few
        widths to warm up): at most a whole chunk, and never past the context (a model may hold no
        position beyond)."""
        n = end - start
        if not self._bucket:
            return n
        bucket = self._bucket if n <= WIDE_CHUNK else 4 * self._bucket
        limit = min(max(1, self._options.prefill_step), self._context - start)
        return max(n, min(-(-n // bucket) * bucket, limit))

    def _evaluate(self, state: list) -> None:
        """A chunk's KV: queued on a GPU (the next step's graph waits for it), evaluated now on a
        CPU, whose allocator then gives back the chunk's activations."""
        if self._pipelined:
            mx.async_eval(state)
        else:
            mx.eval(state)
            mx.clear_cache()

    def _best_live(self, s: _Sequence) -> tuple[_Sequence | None, int]:
        if self._checkpoints:  # recurrent or sliding state cannot be cut back to a shared prefix
            return None, 0
        best, length = None, 0
        for other in self._seqs.values():
            if other is s or (other.group is None and other.cache is None):
                continue
            held = other.state_tokens()
            n = common_prefix(other.tokens, s.prompt, min(held, len(s.prompt) - 1))
            if n > length:
                best, length = other, n
        return best, length

    def _join(self, seqs: list[_Sequence]) -> None:
        """Sequences whose prompts are read join the decode group, all of one step's at once: rows
        read in one forward pass straight from its batch (cache kinds that cannot batch: a group
        each)."""
        if not seqs:
            return
        for s in seqs:
            s.fed = len(s.prompt) - 1
        if self._unbatchable:
            for s in seqs:
                s.group = self._new_group()
                self._groups.append(s.group)
                s.group.join([s], [s.cache], [s.prompt[-1]])
                s.cache = None
            return
        if not self._groups:
            self._groups.append(self._new_group())
        group = self._groups[-1]
        if group.vacancies >= len(seqs):  # each into a slot a row left, in place
            group.join(seqs, [s.cache for s in seqs], [s.prompt[-1] for s in seqs])
        else:
            passes: dict[int, list[_Sequence]] = {}
            for s in seqs:
                if s.shared is not None:
                    passes.setdefault(id(s.shared[0]), []).append(s)
            for rows in passes.values():
                if len(rows) > 1:
                    batch = batch_rows(rows[0].shared[0], [s.shared[1] for s in rows], [s.read for s in rows])
                    group.join_batch(rows, batch, [s.prompt[-1] for s in rows])
            own = [s for s in seqs if s.shared is None or len(passes[id(s.shared[0])]) == 1]
            if own:
                group.join(own, [s.cache for s in own], [s.prompt[-1] for s in own])
        for s in seqs:
            s.group, s.cache, s.shared = group, None, None

    def _new_group(self) -> DecodeGroup:
        return DecodeGroup(self._model, self._vocab, self._eos, self._pipelined, keep_slots=self._keep_slots)

    # -- memory ----------------------------------------------------------------------------------

    def _reserved(self, ends: list[int]) -> int:
        """KV bytes sequences holding ``ends`` tokens each need, twice (a join or leave copies a batch
        once): a batch holds every row, and every vacant slot, as long as its longest."""
        if not ends:
            return 0
        if self._unbatchable:
            return sum(self._footprint_bytes(n) for n in ends)
        rows = max(len(ends), sum(len(g.rows) for g in self._groups))  # vacant slots hold KV too
        return rows * self._footprint_bytes(max(ends))

    def _compact_groups(self) -> bool:
        """Cut every vacant slot out of the decode groups; whether there was one."""
        vacant = any(g.vacancies for g in self._groups)
        for g in self._groups:
            g.compact()
        return vacant

    def preempt(self, seq: int) -> list[tuple[int, Step]]:
        """Take back a sequence's state (offered to the prompt cache, so that reading it again is
        mostly a restore). Its group's step in flight is read first, so that the token it sampled
        there is kept."""
        s = self._seqs[seq]
        out = []
        if s.group is not None and s.group.unread is not None:
            out, s.group.unread = s.group.read(s.group.unread), None
        state, held = self._release(s, vacate=False)
        log.info("the KV memory (%.0f MB) is full: sequence %d preempted after %d tokens, to be read "
                 "again", self._pool / 1e6, s.id, len(s.tokens))
        if state is not None and held > 0:
            self._keep(s.tokens[:held], state)
        s.shared = None
        s.read = s.fed = 0
        return [(row.id, step) for row, step in out]

    def readmit(self, seq: int, prompt: Sequence[int], max_tokens: int) -> None:
        s = self._seqs[seq]
        s.prompt, s.tokens = list(prompt), list(prompt)

    def _footprint_bytes(self, tokens: int) -> int:
        """What one sequence of ``tokens`` reserves (twice its KV: a join or leave copies it)."""
        return 2 * self._footprint.bytes(tokens)

    def _default_max_batch(self) -> int:
        """The device's cap, or fewer where the pool cannot reserve :data:`TYPICAL_SEQUENCE` tokens
        (or the whole context if shorter) for each. Not whole contexts: where the context is sized to
        memory (``fit_context``) that would be one sequence, and requests that say how much they
        want would never batch."""
        cap = MAX_BATCH_GPU if self._pipelined else MAX_BATCH_CPU
        typical = min(self._context, TYPICAL_SEQUENCE)
        return max(1, min(cap, self._pool // self._footprint_bytes(typical)))

    def _keep(self, tokens: list[int], cache: list[Any]) -> None:
        """Store ``cache``, which holds exactly ``tokens``, for later prompts (it is not used again)."""
        if self._caching:
            self._prompts.insert(tokens, Frozen(cache, len(tokens)))

    def _drop_all(self) -> None:
        for s in self._seqs.values():
            s.alive = False
        self._seqs.clear()
        self._groups.clear()


def _kv_prefixes(caches: list[Any], n: int) -> list[KVCache]:
    return kv_copies([(c.keys[..., :n, :], c.values[..., :n, :]) for c in caches])


def _kv_view(c: KVCache, row: int, n: int) -> KVCache:
    """A plain KV cache of one row's first ``n`` positions of a batch's, sharing its buffers: a
    later write copies them (MLX does not write in place into a buffer another array reads)."""
    view = KVCache()
    view.keys, view.values, view.offset = c.keys[row:row + 1, :, :n], c.values[row:row + 1, :, :n], n
    return view


def _last_pass(seqs: list[_Sequence]) -> tuple[list[KVCache], mx.array | None] | None:
    """The layer caches of the forward pass that read the last chunk of every one of ``seqs``, and
    their rows in it (None: all its rows, in order), or None if they were not all read there."""
    if not seqs or any(s.shared is None or s.shared[0] is not seqs[0].shared[0] for s in seqs):
        return None
    batch = seqs[0].shared[0]
    return batch, row_index([s.shared[1] for s in seqs], batch[0].keys.shape[0])
