"""Opening a generation on a model's worker, shared by every generating route: the context check,
the queue's answer (429, 503), and cancelling when the client of a non-streamed request leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from mesh_llm.api.errors import APIError
from mesh_llm.engines.base import SamplingParams
from mesh_llm.runtime.worker import Chunk, Generation, GenerationRequest, ModelWorker, QueueFull, WorkerNotReady


def open_generation(worker: ModelWorker, prompt: list[int], params: SamplingParams, max_tokens: int | None,
                    stop: tuple[str, ...] = (), ignore_eos: bool = False,
                    prompt_param: str = "messages") -> Generation:
    """Queue the generation (``max_tokens`` None: up to the end of the context)."""
    context = worker.info.context_length
    max_tokens = max_tokens or context - len(prompt)
    if max_tokens < 1 or len(prompt) + max_tokens > context:
        raise APIError(400, f"this model's context is {context} tokens, but the prompt has {len(prompt)} "
                       f"tokens and {max_tokens} more were asked for", param=prompt_param,
                       code="context_length_exceeded")
    job = GenerationRequest(prompt=prompt, params=params, max_tokens=max_tokens, stop=stop,
                            ignore_eos=ignore_eos)
    try:
        return worker.open(job)
    except QueueFull as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}) \
            from None
    except WorkerNotReady as exc:
        raise APIError(503, str(exc), code="model_loading") from None


async def until_disconnect(chunks: AsyncIterator[Chunk], request: Request, cancel) -> AsyncIterator[Chunk]:
    """Pass chunks on, but cancel the generation if the client of a non-streamed request leaves."""
    while True:
        pending = asyncio.ensure_future(anext(chunks))
        while not pending.done():
            done, _ = await asyncio.wait({pending}, timeout=0.25)
            if not done and await request.is_disconnected():
                pending.cancel()
                cancel()
                return
        try:
            chunk = pending.result()
        except StopAsyncIteration:
            return
        yield chunk
        if chunk.finish_reason is not None:
            return
