"""One thread per model that owns its engine and schedules its sequences (continuous batching).

Every MLX object stays on that thread. Requests wait in a bounded queue; the thread admits them into
the engine while it has room (``Engine.max_batch``, or ``NoCapacity`` when its memory is short), runs
one engine step at a time over all of them, and ends each sequence on its own stop conditions
(max_tokens, EOS, stop strings, a client gone). Prefill is bounded per step (``prefill_budget``
prompt tokens) so that running streams keep flowing while a newcomer's long prompt is read.

The worker, not the engine, decides when a generation ends, so every engine behaves the same.
Results flow back as :class:`Chunk` objects through each request's ``deliver`` callback.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mesh_llm.engines.base import (
    GPU_PREFILL_CHUNKS,
    Engine,
    EngineError,
    EngineInfo,
    NoCapacity,
    SamplingParams,
    Step,
    Tokenizer,
)
from mesh_llm.runtime.detokenize import IncrementalDetokenizer

log = logging.getLogger("mesh_llm.worker")

SHUTDOWN_MESSAGE = "the server is shutting down"
CPU_PREFILL_BUDGET = 128  # prompt tokens per step while other sequences decode, on a CPU
IDLE_PREFILL_STEPS = 4  # with nothing decoding, a step reads this many steps' worth of prompts
SLOW_STEP_S = 1.0  # a step longer than this, with streams decoding, is logged: they stood still that long
# A step that reads prompts beside decoding streams is held near this long: its prompt budget halves
# after a longer one and doubles back (to the engine's) after one under half of it. On a GPU steps
# stay far under it; on a CPU that other work shares, a 128-token step took 3-15 s, every stream
# standing still meanwhile.
PROMPT_STEP_TARGET_S = 0.5
MIN_PREFILL_BUDGET = 16
# After a step that sent a request's first or last chunk, the worker waits (the GIL released) up to
# this long for the consumer to take it. Otherwise the event loop, woken to send it, waits for the
# GIL while the worker builds the next step, up to Python's switch interval (5 ms) and often longer:
# on an H100 (2026-12-06) the server added 4.6-7.4 ms to the MLX engine's time to first token.
HANDOVER_S = 0.005
# ... only after a step of at most this many tokens: the event loop takes a step's chunks in order, so
# behind many streams' it would keep the worker waiting (while a GPU-bound step would hide it, a
# host-bound one would not).
HANDOVER_TOKENS = 8
# With nothing running, the worker holds its first step up to this long while other requests for the
# model are still being read and tokenized (``ModelWorker.arriving``), so that prompts sent together
# are read in one pass instead of the first alone and the rest behind it. A lone request waits for
# nobody.
GATHER_S = 0.020


def prefill_budget(info: EngineInfo, configured: int | None = None) -> int:
    """Prompt tokens a step reads while other sequences decode: the engine's chunk (or ``configured``);
    on a CPU, which reads ~100-500 prompt tokens a second, at most ``CPU_PREFILL_BUDGET``, so that
    running streams' next token is never more than about a second away; on a GPU, where one pass over
    several chunks costs little more than over one, ``GPU_PREFILL_CHUNKS`` of them."""
    budget = max(1, configured or info.prefill_step)
    return min(budget, CPU_PREFILL_BUDGET) if info.device == "cpu" else budget * GPU_PREFILL_CHUNKS


class QueueFull(Exception):
    """The model's wait queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int):
        super().__init__("the model is busy: too many requests are waiting")
        self.retry_after = retry_after


class WorkerNotReady(Exception):
    """The model is still loading, failed to load, or its worker has stopped."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float
    decode_tps: float


@dataclass(frozen=True)
class Chunk:
    """A piece of one generation: text released since the last chunk, with its tokens' logprobs.
    The last chunk has ``finish_reason`` ("stop", "length" or "error") and ``usage``."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    rejected: bool = False  # the engine refused the request itself (a client error, not a failure)
    shutdown: bool = False  # ended because the server is shutting down (a 503, not a failure)
    timed_out: bool = False  # ended at the server's --request-timeout (a 504)
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended it, if one did


class Incoming:
    """Requests on their way to some worker whose body is still being read and validated (the API
    does that before it knows which model): an idle worker's first step waits for them as for its
    own arrivals. Without it, 32 requests sent at once reached the worker one by one from the
    parsing threads, and their prompts were read in five or six passes beside decoding instead of
    one or two."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    @contextmanager
    def counted(self) -> Iterator[None]:
        with self._lock:
            self.count += 1
        try:
            yield
        finally:
            with self._lock:
                self.count -= 1


class Arrival:
    """A request being read and tokenized for a model (``ModelWorker.arriving``) until ``done``."""

    def __init__(self, arrived: Callable[[], None]):
        self._arrived: Callable[[], None] | None = arrived

    def done(self) -> None:
        arrived, self._arrived = self._arrived, None
        if arrived is not None:
            arrived()


class Handover:
    """How many chunks a consumer on another thread has passed on, for the worker to wait for
    without holding the GIL (a count, so that taking an earlier chunk never ends a later wait)."""

    def __init__(self):
        self._taken = 0
        self._changed = threading.Condition()

    def took(self, all_of_them: bool = False) -> None:
        """One more chunk passed on (``all_of_them``: the consumer is gone, wait for it no more)."""
        with self._changed:
            self._taken = sys.maxsize if all_of_them else self._taken + 1
            self._changed.notify_all()

    def wait(self, count: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._taken >= count, timeout)


@dataclass
class _Job:
    request: GenerationRequest
    deliver: Callable[[Chunk], None]
    handover: Handover | None = None  # counts the chunks the consumer has passed on
    cancelled: threading.Event = field(default_factory=threading.Event)
    delivered: int = 0  # chunks delivered (an admitted job's first: its first text or logprobs)
    submitted: float = field(default_factory=time.perf_counter)


class _Sequence:
    """A job admitted into the engine: its detokenizer and counters."""

    def __init__(self, job: _Job, tokenizer: Tokenizer):
        req = job.request
        self.job = job
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt, req.stop)
        self.eos = frozenset() if req.ignore_eos else tokenizer.eos_token_ids
        self.count = 0
        self.cached = 0
        self.first_at: float | None = None
        self.admitted = time.perf_counter()
        self.error: str | None = None  # why it ends in an error

    def usage(self, now: float) -> Usage:
        first = self.first_at or now
        decode_tps = (self.count - 1) / (now - first) if self.count > 1 and now > first else 0.0
        return Usage(len(self.job.request.prompt), self.count, self.cached, first - self.job.submitted,
                     decode_tps)


class Generation:
    """The chunks of one queued generation, for asyncio callers. ``cancel()`` (or leaving the loop
    early, as when a client goes away) frees its slot at the worker's next step."""

    def __init__(self, worker: ModelWorker, request: GenerationRequest):
        loop = asyncio.get_running_loop()
        self._chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        self._handover = Handover()
        self.cancel = worker.submit(request, lambda c: loop.call_soon_threadsafe(self._chunks.put_nowait, c),
                                    self._handover)
        self._done = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        try:
            while not self._done:
                chunk = await self._chunks.get()
                self._done = chunk.finish_reason is not None
                yield chunk
                self._handover.took()  # sent on, and back for more
        finally:
            self._handover.took(all_of_them=True)
            self.cancel()


class ModelWorker:
    """Loads an engine on its own thread and serves generations from a bounded queue, batched."""

    def __init__(self, name: str, load: Callable[[], Engine], max_queue: int = 64,
                 prefill_budget: int | None = None, request_timeout: float | None = None,
                 incoming: Incoming | None = None):
        self.name = name
        self._incoming = incoming if incoming is not None else Incoming()
        self._load = load
        self._max_queue = max_queue  # requests that may wait beyond the batch's free slots
        self._request_timeout = request_timeout  # seconds from submission to the last chunk
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._submit_lock = threading.Lock()
        self._prefill_budget = prefill_budget  # None: the engine's prefill step
        self._paced_budget = 0  # the prompt budget of a step beside decoding streams (PROMPT_STEP_TARGET_S)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._wake = threading.Event()  # set when a job is queued or the worker must stop
        self._engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.info: EngineInfo | None = None
        self._thread = threading.Thread(target=self._run, name=f"worker-{name}", daemon=True)
        self._pending: deque[_Job] = deque()  # taken from the queue, waiting for engine room
        self._active: dict[int, _Sequence] = {}
        self._ids = itertools.count()
        self._avg_job_s = 1.0
        self._alive = False
        self._handovers: list[tuple[Handover, int]] = []  # consumers to wait for after this step
        self._arriving = 0  # requests being prepared (``arriving``)
        self._arriving_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._alive

    @property
    def tokenizer(self) -> Tokenizer:
        if not self.ready:
            raise WorkerNotReady(f"model {self.name!r} is not loaded")
        return self._engine.tokenizer

    def cache_stats(self) -> dict:
        """The engine's prompt-cache counters ({} while loading); safe from any thread."""
        return self._engine.cache_stats() if self.ready else {}

    def load(self) -> dict[str, int]:
        """How busy the model is, for routing: sequences in the engine, requests waiting for a
        slot, and the most sequences it decodes at once. Safe from any thread."""
        engine = self._engine if self.ready else None
        return {"active": len(self._active), "waiting": self._queue.qsize() + len(self._pending),
                "max_batch": engine.max_batch if engine is not None else 0}

    def _held(self) -> int:
        """Requests submitted and not yet ended: running, or waiting for a slot. Read from any
        thread: a job moving between the three is briefly counted once too few, never twice."""
        return len(self._active) + len(self._pending) + self._queue.qsize()

    def stop(self, timeout: float = 30) -> None:
        """End every generation (running ones and waiting ones are answered with an error chunk),
        then close the engine."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- requests --------------------------------------------------------------------------------

    @contextmanager
    def arriving(self) -> Iterator[Arrival]:
        """Count a request from its lookup until it is queued (``arrival.done()`` right after, or
        the block's end): an idle worker holds its first step for it (``GATHER_S``)."""
        with self._arriving_lock:
            self._arriving += 1
        arrival = Arrival(self._arrived)
        try:
            yield arrival
        finally:
            arrival.done()

    def _arrived(self) -> None:
        with self._arriving_lock:
            self._arriving -= 1
        self._wake.set()

    def submit(self, request: GenerationRequest, deliver: Callable[[Chunk], None],
               handover: Handover | None = None) -> Callable[[], None]:
        """Queue a generation; returns a function that cancels it. ``deliver`` is called on the
        worker thread for every chunk; a consumer on another thread that counts in ``handover`` each
        chunk it has passed on has its first and last chunks handed over at once (``HANDOVER_S``).
        Raises :class:`QueueFull` when the wait queue is full."""
        if not self.ready or self._stopping.is_set():
            raise WorkerNotReady(f"model {self.name!r} is not loaded")
        job = _Job(request, deliver, handover)
        with self._submit_lock:
            beyond = self._held() - self._engine.max_batch  # held requests no free slot takes
            if beyond >= self._max_queue:
                # a slot frees about every ``_avg_job_s``: this one would wait for beyond + 1 of them
                raise QueueFull(retry_after=max(1, math.ceil((beyond + 1) * self._avg_job_s)))
            self._queue.put_nowait(job)
        self._wake.set()

        def cancel() -> None:
            job.cancelled.set()
            self._wake.set()

        return cancel

    def open(self, request: GenerationRequest) -> Generation:
        """Queue a generation for an asyncio caller (raises :class:`QueueFull` at once)."""
        return Generation(self, request)

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = self._load()
            self.info = self._engine.info()
        except BaseException as exc:  # reported by whoever waits for the model
            self.load_error = exc
            self._ready.set()
            return
        self._prefill_budget = self._paced_budget = prefill_budget(self.info, self._prefill_budget)
        self._alive = True
        self._ready.set()
        try:
            while not self._stopping.is_set():
                self._drop_cancelled()
                if self._request_timeout is not None:
                    self._end_expired()
                idle = not self._active
                self._admit()
                if not self._active:
                    self._wake.wait()
                    self._wake.clear()
                    continue
                if idle and self._still_arriving() and GATHER_S > 0:
                    self._gather()
                self._step()
        except BaseException:  # a bug in the scheduler itself: fail loudly, never hang clients
            log.exception("worker %s stopped", self.name)
        finally:
            self._alive = False
            self._shutdown()

    def _admit(self) -> None:
        """Move waiting jobs into the engine while it has room; a job the engine cannot take yet
        stays first in line (later ones wait behind it, so a long prompt is not starved)."""
        engine = self._engine
        while len(self._active) < engine.max_batch:
            if not self._pending:
                try:
                    self._pending.append(self._queue.get_nowait())
                except queue.Empty:
                    return
            job = self._pending[0]
            if job.cancelled.is_set():  # the client left while it waited
                self._pending.popleft()
                log.info("%s prompt=%d cached=0 completion=0 ttft=0.000s decode=0.0 tok/s "
                         "finish=cancelled", self.name, len(job.request.prompt))
                continue
            seq = next(self._ids)
            req = job.request
            try:
                engine.add(seq, req.prompt, req.params, req.max_tokens)
            except NoCapacity:
                return
            except (ValueError, EngineError) as exc:
                self._pending.popleft()
                self._send(job, Chunk(finish_reason="error", error=str(exc), rejected=True))
                continue
            except Exception as exc:  # an engine bug: this request fails, the worker goes on
                log.exception("%s: add failed", self.name)
                self._pending.popleft()
                self._send(job, Chunk(finish_reason="error", error=f"generation failed: {exc}"))
                continue
            self._pending.popleft()
            self._active[seq] = _Sequence(job, engine.tokenizer)
            log.debug("%s: a %d-token prompt admitted after %.1f ms in the queue", self.name,
                      len(req.prompt), 1000 * (time.perf_counter() - job.submitted))

    def _gather(self) -> None:
        """Admit the requests arriving with the first one, up to ``GATHER_S``: sent together, their
        prompts are then read in one pass. Reading the first alone would delay the rest by its
        whole prompt and then have them read in passes beside its decoding."""
        started = time.perf_counter()
        deadline = started + GATHER_S
        while (self._still_arriving() and len(self._active) < self._engine.max_batch
               and not self._stopping.is_set()):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._wake.wait(left)
            self._wake.clear()
            self._admit()
        log.debug("%s: the first step held %.1f ms for requests arriving with it (%d admitted, %d still "
                  "arriving)", self.name, 1000 * (time.perf_counter() - started), len(self._active),
                  self._still_arriving())

    def _still_arriving(self) -> int:
        """Requests being prepared for this worker, and bodies being read that may be for it."""
        return self._arriving + self._incoming.count

    def _step(self) -> None:
        decoding = any(s.first_at is not None for s in self._active.values())
        prompts_read = any(s.first_at is None for s in self._active.values())
        # With streams running, read at most a paced prefill chunk's worth of prompt per step (they
        # wait for it); with none, newcomers' prompts go in larger steps.
        budget = self._paced_budget if decoding else IDLE_PREFILL_STEPS * self._prefill_budget
        started = time.perf_counter()
        try:
            outputs = self._engine.step(budget)
        except Exception as exc:  # the engine dropped every sequence (base.Engine.step)
            log.exception("%s: engine step failed", self.name)
            failed, self._active = self._active, {}
            for s in failed.values():
                self._send(s.job, Chunk(finish_reason="error", error=f"generation failed: {exc}"))
            return
        now = time.perf_counter()
        if decoding and prompts_read:
            self._pace(now - started)
        slow = now - started > SLOW_STEP_S
        if slow or log.isEnabledFor(logging.DEBUG):
            reading = sum(s.first_at is None for s in self._active.values())
            log.debug("%s: step %.1f ms, budget %d: %d reading, %d decoding, %d tokens out", self.name,
                      1000 * (now - started), budget, reading, len(self._active) - reading, len(outputs))
        if slow and decoding:  # a prompt read alone is its own first token's wait, a stall for nobody
            log.warning("%s: one engine step took %.1f s (%d sequences reading their prompts, %d "
                        "decoding)", self.name, now - started, reading, len(self._active) - reading)
        for seq, step in outputs:
            sequence = self._active.get(seq)
            if sequence is not None:
                finish = self._advance(sequence, step, now)
                if finish is not None:
                    self._finish(seq, finish, now)
        if len(outputs) <= HANDOVER_TOKENS:
            self._hand_over()
        self._handovers.clear()

    def _pace(self, took: float) -> None:
        """Size the next prompt budget beside decoding streams by how long this one took."""
        if took > PROMPT_STEP_TARGET_S:
            self._paced_budget = max(MIN_PREFILL_BUDGET, self._paced_budget // 2)
        elif took < PROMPT_STEP_TARGET_S / 2:
            self._paced_budget = min(self._prefill_budget, self._paced_budget * 2)

    def _advance(self, s: _Sequence, step: Step, now: float) -> str | None:
        """Take one sampled token; returns a finish reason once the sequence is done."""
        if s.first_at is None:
            s.first_at, s.cached = now, step.cached_tokens
        if s.job.cancelled.is_set():
            return "cancelled"
        s.count += 1
        if step.token in s.eos:
            constraint = s.job.request.params.constraint
            failed = constraint.failed if constraint is not None else None
            if failed:  # the constraint gave up: what came is not what was asked for
                s.error = f"the requested format could not be followed: {failed}"
                return "error"
            return "stop"
        text = s.detok.add(step.token)
        logprobs = ()
        if s.job.request.params.logprobs is not None:
            logprobs = (_logprob(self._engine.tokenizer, step),)
        if text or logprobs:
            self._send(s.job, Chunk(text=text, logprobs=logprobs), hand_over=s.job.delivered == 0)
        if s.detok.stopped:
            return "stop"
        if s.count >= s.job.request.max_tokens:
            return "length"
        return None

    def _finish(self, seq: int, finish: str, now: float) -> None:
        s = self._active.pop(seq)
        usage = s.usage(now)
        if finish == "error":  # the request's own fault (its grammar): a 400 where nothing was sent yet
            self._send(s.job, Chunk(finish_reason=finish, error=s.error, rejected=True, usage=usage))
        elif finish not in ("cancelled", "timeout"):  # sent first: the answer waits for no cleanup
            self._send(s.job, Chunk(text=s.detok.flush(), finish_reason=finish, usage=usage,
                                    stop_sequence=s.detok.matched), hand_over=True)
        try:
            self._engine.remove(seq)
        except Exception:  # the sequence is over either way
            log.exception("%s: remove failed", self.name)
        # with the batch full, a slot frees about every (time in the engine) / max_batch seconds
        served = now - s.admitted
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * served / max(1, self._engine.max_batch)
        log.info("%s prompt=%d cached=%d completion=%d ttft=%.3fs decode=%.1f tok/s finish=%s",
                 self.name, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                 usage.ttft_s, usage.decode_tps, finish)

    def _drop_cancelled(self) -> None:
        """Free the slots of clients that left, prompt half read or not, before the next step."""
        now = time.perf_counter()
        for seq in [seq for seq, s in self._active.items() if s.job.cancelled.is_set()]:
            self._finish(seq, "cancelled", now)

    def _end_expired(self) -> None:
        """End each request older than ``--request-timeout``, waiting or running, between steps."""
        now = time.perf_counter()
        deadline = now - self._request_timeout
        while True:  # waiting jobs are checked in order, so take them all out of the queue
            try:
                self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        expired = [j for j in self._pending if j.submitted < deadline]
        ended = [seq for seq, s in self._active.items() if s.job.submitted < deadline]
        if not expired and not ended:
            return
        message = f"the request ran past the server's request timeout of {self._request_timeout:g} s"
        for job in expired:
            self._pending.remove(job)
            log.info("%s: a waiting request ended: %s", self.name, message)
            self._send(job, Chunk(finish_reason="error", error=message, timed_out=True))
        for seq in ended:
            sequence = self._active[seq]
            self._send(sequence.job, Chunk(finish_reason="error", error=message, timed_out=True,
                                           usage=sequence.usage(now)))
            self._finish(seq, "timeout", now)

    def _send(self, job: _Job, chunk: Chunk, hand_over: bool = False) -> None:
        """Deliver a chunk (``hand_over``: one the client waits on, whose consumer the step's end waits
        for); a callback that raises cancels its own job, never the worker."""
        try:
            job.deliver(chunk)
        except Exception:
            log.exception("%s: delivering a chunk failed; cancelling that request", self.name)
            job.cancelled.set()
            return
        job.delivered += 1
        if hand_over and job.handover is not None:
            self._handovers.append((job.handover, job.delivered))

    def _hand_over(self) -> None:
        """Wait, without the GIL, until the consumers of this step's first and last chunks have taken
        them (``HANDOVER_S`` at most, for all of them together)."""
        deadline = time.perf_counter() + HANDOVER_S
        for handover, count in self._handovers:
            if not handover.wait(count, max(0.0, deadline - time.perf_counter())):
                return

    def _shutdown(self) -> None:
        """Answer everything still held or waiting, then close the engine."""
        jobs = [s.job for s in self._active.values()] + list(self._pending)
        self._active.clear()
        self._pending.clear()
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if not job.cancelled.is_set():
                log.info("%s: a request ended unfinished: %s", self.name, SHUTDOWN_MESSAGE)
                self._send(job, Chunk(finish_reason="error", error=SHUTDOWN_MESSAGE, shutdown=True))
        try:
            self._engine.close()
        except Exception:
            log.exception("%s: closing the engine failed", self.name)


def _logprob(tokenizer: Tokenizer, step: Step) -> TokenLogprob:
    return TokenLogprob(
        token=tokenizer.decode([step.token]),
        logprob=step.logprob if step.logprob is not None else 0.0,
        # tokens a constraint masked out have no probability: they are not alternatives
        top=tuple((tokenizer.decode([t]), lp) for t, lp in step.top_logprobs if lp != float("-inf")),
    )
