"""Opening a generation on a model's worker and answering with it, shared by every generating route:
the context check, the queue's answer (429, 503), and cancelling the generation however the client's
response ends (finished, client gone mid-stream, gone before the stream started, or a non-streamed
client gone while it waits)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from mesh_llm.api.errors import APIError
from mesh_llm.engines.base import SamplingParams
from mesh_llm.runtime.worker import (
    Arrival,
    Generation,
    GenerationRequest,
    ModelWorker,
    QueueFull,
    WorkerNotReady,
)


@dataclass(frozen=True)
class PromptRoom:
    """The prompt tokens a request leaves room for (the context less the tokens it asks for, at
    least one), to refuse a longer prompt before tokenizing it (``runtime.prompt_limit``)."""

    context: int
    max_tokens: int | None
    param: str  # the field the prompt came in

    @classmethod
    def of(cls, worker: ModelWorker, max_tokens: int | None, param: str) -> PromptRoom:
        return cls(worker.info.context_length, max_tokens, param)

    @property
    def tokens(self) -> int:
        return self.context - (self.max_tokens or 1)

    def exceeded(self, at_least: int) -> APIError:
        """The 400 :func:`open_generation` would give once the prompt were tokenized."""
        return context_exceeded(self.context, f"at least {at_least}", self.max_tokens, self.param)


def context_exceeded(context: int, prompt: str, max_tokens: int | None, param: str) -> APIError:
    """The 400 for a prompt of ``prompt`` tokens that, with ``max_tokens`` (None: not given), does
    not fit the context."""
    if max_tokens and max_tokens >= context:
        why = f"{max_tokens} tokens were asked for, which leaves no room for the prompt"
    elif max_tokens:
        why = f"the prompt has {prompt} tokens and {max_tokens} more were asked for"
    else:
        why = f"the prompt has {prompt} tokens, which leaves no room for an answer"
    return APIError(400, f"this model's context is {context} tokens, but {why}", param=param,
                    code="context_length_exceeded")


def open_generation(worker: ModelWorker, prompt: list[int], params: SamplingParams, max_tokens: int | None,
                    stop: tuple[str, ...] = (), ignore_eos: bool = False,
                    prompt_param: str = "messages", arrival: Arrival | None = None) -> Generation:
    """Queue the generation (``max_tokens`` None: up to the end of the context); ``arrival``, the
    request's count in ``worker.arriving()``, ends once it is queued (a refusal ends the block)."""
    room = PromptRoom.of(worker, max_tokens, prompt_param)
    if len(prompt) > room.tokens:
        raise context_exceeded(room.context, str(len(prompt)), max_tokens, prompt_param)
    max_tokens = max_tokens or room.context - len(prompt)
    job = GenerationRequest(prompt=prompt, params=params, max_tokens=max_tokens, stop=stop,
                            ignore_eos=ignore_eos)
    try:
        generation = worker.open(job)
    except QueueFull as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}) \
            from None
    except WorkerNotReady as exc:
        raise APIError(503, str(exc), code="model_loading") from None
    if arrival is not None:
        arrival.done()
    return generation


def stream_response(events: AsyncIterator[bytes], generation: Generation) -> StreamingResponse:
    """Server-sent events of one generation."""
    return _GenerationStream(events, generation.cancel)


async def collect_unless_left(collect: Awaitable, request: Request, generation: Generation):
    """The whole answer, or an empty 499 once the client of a non-streamed request has left (its
    generation cancelled at once, not when the next token is due)."""
    answer = asyncio.ensure_future(collect)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, left}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():  # nobody will read it
            return Response(status_code=499)
        return answer.result()
    finally:
        for task in (answer, left):
            task.cancel()
        generation.cancel()


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection. The body has been read, so the next ASGI
    message is the disconnect (event-driven: no polling between tokens)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _GenerationStream(StreamingResponse):
    """A streamed response that cancels its generation however it ends, including a client that
    left before the stream started (then the body iterator never runs, and its finally neither)."""

    def __init__(self, content, cancel):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cancel = cancel

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel()
