"""One thread per model that owns its engine: every MLX object stays on that thread, and the device
is used by one generation at a time. Requests wait in a bounded queue; results flow back as chunks.

The worker, not the engine, decides when a generation ends (max_tokens, EOS, stop strings, a client
gone), so every engine behaves the same. The scheduling loop is written around an ``active`` set so
that continuous batching can later decode several sequences per step without changing callers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from mesh_llm.engines.base import Engine, EngineError, EngineInfo, SamplingParams, Step, Tokenizer
from mesh_llm.runtime.detokenize import IncrementalDetokenizer

log = logging.getLogger("mesh_llm.worker")


class _Rejected(Exception):
    pass


class QueueFull(Exception):
    """The model's wait queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int):
        super().__init__("the model is busy: too many requests are waiting")
        self.retry_after = retry_after


class WorkerNotReady(Exception):
    """The model is still loading, or failed to load."""


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


@dataclass
class _Job:
    request: GenerationRequest
    deliver: Callable[[Chunk], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Generation:
    """The chunks of one queued generation, for asyncio callers. ``cancel()`` (or leaving the loop
    early, as when a client goes away) frees the worker within one token."""

    def __init__(self, worker: ModelWorker, request: GenerationRequest):
        loop = asyncio.get_running_loop()
        self._chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        self.cancel = worker.submit(request, lambda c: loop.call_soon_threadsafe(self._chunks.put_nowait, c))
        self._done = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        try:
            while not self._done:
                chunk = await self._chunks.get()
                self._done = chunk.finish_reason is not None
                yield chunk
        finally:
            self.cancel()


class ModelWorker:
    """Loads an engine on its own thread and serves generations from a bounded queue."""

    def __init__(self, name: str, load: Callable[[], Engine], max_queue: int = 64):
        self.name = name
        self._load = load
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
        self._ready = threading.Event()
        self._engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.info: EngineInfo | None = None
        self._thread = threading.Thread(target=self._run, name=f"worker-{name}", daemon=True)
        self._avg_job_s = 1.0
        self._serving = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._engine is not None

    @property
    def tokenizer(self) -> Tokenizer:
        if not self.ready:
            raise WorkerNotReady(f"model {self.name!r} is not loaded")
        return self._engine.tokenizer

    def cache_stats(self) -> dict:
        """The engine's prompt-cache counters ({} while loading); safe from any thread."""
        return self._engine.cache_stats() if self.ready else {}

    def load(self) -> dict[str, int]:
        """How busy the model is, for routing: sequences being generated, requests waiting for a
        slot, and the most sequences it decodes at once. Safe from any thread."""
        return {"active": self._serving, "waiting": self._queue.qsize(), "max_batch": 1}

    def stop(self, timeout: float = 30) -> None:
        """Finish the running generation, drop waiting ones, close the engine."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout)

    # -- requests --------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, deliver: Callable[[Chunk], None]) -> Callable[[], None]:
        """Queue a generation; returns a function that cancels it. ``deliver`` is called on the
        worker thread for every chunk. Raises :class:`QueueFull` when the wait queue is full."""
        if not self.ready:
            raise WorkerNotReady(f"model {self.name!r} is not loaded")
        job = _Job(request, deliver)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(retry_after=max(1, round(self._avg_job_s))) from None
        return job.cancelled.set

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
        self._ready.set()
        try:
            while (job := self._queue.get()) is not None:
                if not job.cancelled.is_set():
                    self._serving = 1
                    self._serve(job)
                    self._serving = 0
        finally:
            self._engine.close()

    def _serve(self, job: _Job) -> None:
        started = time.perf_counter()
        try:
            usage, finish = self._generate(job, started)
        except _Rejected as exc:
            job.deliver(Chunk(finish_reason="error", error=str(exc), rejected=True))
            return
        except Exception as exc:  # an engine failure ends this request, never the worker
            log.exception("generation failed on %s", self.name)
            job.deliver(Chunk(finish_reason="error", error=f"generation failed: {exc}"))
            return
        elapsed = time.perf_counter() - started
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * elapsed
        log.info("%s prompt=%d cached=%d completion=%d ttft=%.3fs decode=%.1f tok/s finish=%s",
                 self.name, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                 usage.ttft_s, usage.decode_tps, finish)

    def _generate(self, job: _Job, started: float) -> tuple[Usage, str]:
        req, engine = job.request, self._engine
        tokenizer = engine.tokenizer
        detok = IncrementalDetokenizer(tokenizer, req.prompt, req.stop)
        eos = frozenset() if req.ignore_eos else tokenizer.eos_token_ids
        want_logprobs = req.params.logprobs is not None
        count, cached, first_at = 0, 0, None
        finish = "length"  # the engine ends the stream itself only when the context is full
        try:
            steps = engine.generate(req.prompt, req.params)  # engines check the request here
        except (ValueError, EngineError) as exc:
            raise _Rejected(str(exc)) from None
        try:
            for step in steps:
                if first_at is None:
                    first_at, cached = time.perf_counter(), step.cached_tokens
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                count += 1
                if step.token in eos:
                    finish = "stop"
                    break
                text = detok.add(step.token)
                logprobs = (self._logprob(tokenizer, step),) if want_logprobs else ()
                if detok.stopped:
                    finish = "stop"
                if text or logprobs:
                    job.deliver(Chunk(text=text, logprobs=logprobs))
                if detok.stopped:
                    break
                if count >= req.max_tokens:
                    break
        finally:
            steps.close()
        now = time.perf_counter()
        first_at = first_at or now
        decode_tps = (count - 1) / (now - first_at) if count > 1 and now > first_at else 0.0
        usage = Usage(len(req.prompt), count, cached, first_at - started, decode_tps)
        if finish != "cancelled":
            job.deliver(Chunk(text=detok.flush(), finish_reason=finish, usage=usage))
        return usage, finish

    @staticmethod
    def _logprob(tokenizer: Tokenizer, step: Step) -> TokenLogprob:
        return TokenLogprob(
            token=tokenizer.decode([step.token]),
            logprob=step.logprob if step.logprob is not None else 0.0,
            # tokens a constraint masked out have no probability: they are not alternatives
            top=tuple((tokenizer.decode([t]), lp) for t, lp in step.top_logprobs if lp != float("-inf")),
        )
