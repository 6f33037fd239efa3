"""OpenAI response objects built from the worker's chunks: chat and text completions, whole or as
server-sent events framed exactly as OpenAI sends them."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from mesh_llm.api.errors import APIError
from mesh_llm.runtime.tool_formats import Event, Parser
from mesh_llm.runtime.worker import Chunk, TokenLogprob, Usage


def error_kind(chunk: Chunk) -> tuple[int, str, str]:
    """A generation's error chunk as the HTTP status of a non-streamed answer, and the OpenAI error
    type and code a stream's error event carries."""
    if chunk.rejected:  # the request's own fault (its grammar): nothing was sent yet
        return 400, "invalid_request_error", "invalid_request"
    if chunk.shutdown:
        return 503, "server_error", "server_shutting_down"
    if chunk.timed_out:
        return 504, "server_error", "request_timeout"
    return 500, "server_error", "generation_failed"


def generation_error(chunk: Chunk) -> APIError:
    """The error a non-streamed request answers for a generation's error chunk."""
    status, _, code = error_kind(chunk)
    return APIError(status, chunk.error, code=code)


async def last_chunk(chunks: AsyncIterator[Chunk], take: Callable[[Chunk], object]) -> Chunk:
    """Hands each chunk of a generation to ``take`` and returns the last; an error chunk raises
    the error a non-streamed request answers."""
    async for chunk in chunks:
        if chunk.error:
            raise generation_error(chunk)
        take(chunk)
        if chunk.finish_reason is not None:
            return chunk
    raise APIError(500, "the generation ended without a result", code="generation_failed")


def parsed(parser: Parser, chunk: Chunk) -> list[Event]:
    """The parser's events for a chunk; at the last, with whatever it held back."""
    events = parser.feed(chunk.text) if chunk.text else []
    return events + parser.finish() if chunk.finish_reason is not None else events


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                             separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _chat_logprob(lp: TokenLogprob) -> dict:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top],
    }


@dataclass
class _TextLogprobs:
    """The legacy completions logprobs object, built up token by token."""

    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, logprobs: tuple[TokenLogprob, ...]) -> dict:
        start = len(self.tokens)
        for lp in logprobs:
            self.tokens.append(lp.token)
            self.token_logprobs.append(lp.logprob)
            self.top_logprobs.append(dict(lp.top))
            self.text_offset.append(self.offset)
            self.offset += len(lp.token)
        return self.json(start)

    def json(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}


class ToolCalls:
    """A reply's content and tool calls, assembled from a tool-call parser's events."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict] = {}

    def add(self, events: list[Event]) -> None:
        for e in events:
            if e.kind == "content":
                self.content.append(e.text)
            elif e.kind == "call":
                self.calls[e.index] = {"id": e.id, "type": "function",
                                       "function": {"name": e.name, "arguments": ""}}
            else:
                self.calls[e.index]["function"]["arguments"] += e.text

    def text(self) -> str | None:
        """The content; None when the reply is only calls (as OpenAI sends it)."""
        text = "".join(self.content)
        return None if self.calls and not text.strip() else text

    def finish_reason(self, finish: str | None) -> str | None:
        return "tool_calls" if self.calls and finish == "stop" else finish


def chat_deltas(events: list[Event]) -> list[dict]:
    """OpenAI's streamed deltas for parser events: content, a call's id and name, its argument fragments."""
    deltas: list[dict] = []
    for e in events:
        if e.kind == "content":
            if deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += e.text
            else:
                deltas.append({"content": e.text})
        elif e.kind == "call":
            deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                           "function": {"name": e.name, "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return deltas


class ResponseBuilder:
    """Turns chunks into one OpenAI completion (``collect``) or its event stream (``stream``). With a
    tool-call ``parser`` (chat only), calls go to ``tool_calls`` and their markup never to content."""

    def __init__(self, kind: str, model: str, logprobs: bool, include_usage: bool = False,
                 parser: Parser | None = None):
        assert kind in ("chat", "text")
        self.kind, self.model, self.logprobs, self.include_usage = kind, model, logprobs, include_usage
        self.parser = parser
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._text_logprobs = _TextLogprobs()

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj + (".chunk" if chunk and self.kind == "chat" else ""),
                "created": self.created, "model": self.model, "system_fingerprint": None,
                "choices": choices}

    def _logprobs(self, chunk_logprobs: tuple[TokenLogprob, ...]) -> dict | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [_chat_logprob(lp) for lp in chunk_logprobs], "refusal": None}
        return self._text_logprobs.add(chunk_logprobs)

    def _choice(self, text: str, logprobs: dict | None, finish: str | None, delta: dict | None) -> dict:
        if self.kind == "chat":
            body = {"delta": delta} if delta is not None else {
                "message": {"role": "assistant", "content": text, "refusal": None}}
        else:
            body = {"text": text}
        return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish}

    async def collect(self, chunks: AsyncIterator[Chunk]) -> dict:
        parts: list[str] = []
        all_logprobs: list[TokenLogprob] = []
        last = Chunk()
        async for last in chunks:
            if last.error:
                raise generation_error(last)
            parts.append(last.text)
            all_logprobs.extend(last.logprobs)
        logprobs = self._logprobs(tuple(all_logprobs))
        choice = self._choice("".join(parts), logprobs, last.finish_reason, None)
        if self.parser is not None:
            calls = ToolCalls()
            calls.add(self.parser.feed("".join(parts)) + self.parser.finish())
            choice["message"]["content"] = calls.text()
            if calls.calls:
                choice["message"]["tool_calls"] = list(calls.calls.values())
            choice["finish_reason"] = calls.finish_reason(last.finish_reason)
        body = self._envelope([choice], False)
        body["usage"] = usage_json(last.usage)
        return body

    async def stream(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        extra = {"usage": None} if self.include_usage else {}
        if self.kind == "chat":
            first = self._choice("", None, None, {"role": "assistant", "content": "", "refusal": None})
            yield sse({**self._envelope([first], True), **extra})
        calls = ToolCalls()
        async for chunk in chunks:
            if chunk.error:
                _, kind, code = error_kind(chunk)
                yield sse({"error": {"message": chunk.error, "type": kind, "param": None, "code": code}})
                break
            finish = chunk.finish_reason
            if self.parser is not None:
                events = self.parser.feed(chunk.text) if chunk.text else []
                if finish is not None:
                    events += self.parser.finish()
                calls.add(events)
                deltas = chat_deltas(events) or ([{}] if chunk.logprobs else [])
                for i, delta in enumerate(deltas):
                    logprobs = self._logprobs(chunk.logprobs) if i == 0 and chunk.logprobs else None
                    yield sse({**self._envelope([self._choice("", logprobs, None, delta)], True), **extra})
                finish = calls.finish_reason(finish)
            elif chunk.text or chunk.logprobs:
                delta = {"content": chunk.text} if self.kind == "chat" else None
                choice = self._choice(chunk.text, self._logprobs(chunk.logprobs), None, delta)
                yield sse({**self._envelope([choice], True), **extra})
            if finish is not None:
                final = self._choice("", None, finish, {} if self.kind == "chat" else None)
                yield sse({**self._envelope([final], True), **extra})
                if self.include_usage and chunk.usage is not None:
                    yield sse({**self._envelope([], True), "usage": usage_json(chunk.usage)})
        yield sse("[DONE]")
