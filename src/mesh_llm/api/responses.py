"""OpenAI response objects built from the worker's chunks: chat and text completions, whole or as
server-sent events framed exactly as OpenAI sends them."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mesh_llm.runtime.worker import Chunk, TokenLogprob, Usage


class GenerationError(Exception):
    def __init__(self, message: str, rejected: bool):
        super().__init__(message)
        self.rejected = rejected


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


class ResponseBuilder:
    """Turns chunks into one OpenAI completion (``collect``) or its event stream (``stream``)."""

    def __init__(self, kind: str, model: str, logprobs: bool, include_usage: bool = False):
        assert kind in ("chat", "text")
        self.kind, self.model, self.logprobs, self.include_usage = kind, model, logprobs, include_usage
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
                raise GenerationError(last.error, last.rejected)
            parts.append(last.text)
            all_logprobs.extend(last.logprobs)
        logprobs = self._logprobs(tuple(all_logprobs))
        body = self._envelope([self._choice("".join(parts), logprobs, last.finish_reason, None)], False)
        body["usage"] = usage_json(last.usage)
        return body

    async def stream(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        extra = {"usage": None} if self.include_usage else {}
        if self.kind == "chat":
            first = self._choice("", None, None, {"role": "assistant", "content": "", "refusal": None})
            yield sse({**self._envelope([first], True), **extra})
        async for chunk in chunks:
            if chunk.error:
                kind = "invalid_request_error" if chunk.rejected else "server_error"
                yield sse({"error": {"message": chunk.error, "type": kind, "param": None, "code": None}})
                break
            if chunk.text or chunk.logprobs:
                delta = {"content": chunk.text} if self.kind == "chat" else None
                choice = self._choice(chunk.text, self._logprobs(chunk.logprobs), None, delta)
                yield sse({**self._envelope([choice], True), **extra})
            if chunk.finish_reason is not None:
                final = self._choice("", None, chunk.finish_reason, {} if self.kind == "chat" else None)
                yield sse({**self._envelope([final], True), **extra})
                if self.include_usage and chunk.usage is not None:
                    yield sse({**self._envelope([], True), "usage": usage_json(chunk.usage)})
        yield sse("[DONE]")
