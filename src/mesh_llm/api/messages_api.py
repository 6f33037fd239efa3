"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API (what the
``anthropic`` SDK, Claude Code and many agent tools speak) on the same plan, constraint and parsers
as chat completions. A reply becomes content blocks, ``text`` and one ``tool_use`` per call, whole or
as Anthropic's event stream (``message_start``, ``content_block_start``, ``content_block_delta``,
``content_block_stop``, ``message_delta`` with the stop reason and usage, ``message_stop``). Errors on
these routes come in Anthropic's shape (:class:`AnthropicErrors`)."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request

from mesh_llm.api.body import body_schema, json_body
from mesh_llm.api.chat_tools import make_plan
from mesh_llm.api.errors import MESSAGES_ERRORS, AnthropicErrorBody, documented
from mesh_llm.api.generation import PromptRoom, collect_unless_left, open_generation, stream_response
from mesh_llm.api.messages_schemas import (
    CreateMessage,
    MessagesRequest,
    chat_messages,
    check_tools,
    functions,
    tool_choice,
)
from mesh_llm.api.responses import generation_error, last_chunk, parsed
from mesh_llm.engines.base import SamplingParams
from mesh_llm.runtime.tool_formats import PlainText
from mesh_llm.runtime.worker import Chunk

_FIELDS = {"messages": "messages", "tools": "tools", "tool_choice": "tool_choice"}
PATH = "/v1/messages"


def install_messages(app: FastAPI, lookup: Callable) -> None:
    @app.post(PATH, responses=MESSAGES_ERRORS, openapi_extra=body_schema(CreateMessage))
    async def create_message(body: json_body(CreateMessage), request: Request):
        served = lookup(body.model)
        body.check_served()
        choice, parallel = tool_choice(body)
        with served.worker.arriving() as arrival:
            plan = await make_plan(served.worker.tokenizer, chat_messages(body), functions(body), choice,
                                   parallel, None, _FIELDS, PromptRoom.of(served.worker, body.max_tokens, "messages"))
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    constraint=plan.constraint)
            generation = open_generation(served.worker, plan.prompt, params, body.max_tokens,
                                         tuple(body.stop_sequences or ()), prompt_param="messages",
                                         arrival=arrival)
        builder = MessageBuilder(served.id, plan.parser, len(plan.prompt))
        if body.stream:
            return stream_response(builder.stream(aiter(generation)), generation)
        return await collect_unless_left(builder.collect(aiter(generation)), request, generation)

    @app.post(PATH + "/count_tokens", openapi_extra=body_schema(MessagesRequest),
              responses=documented(400, 401, 404, 413, 503, body=AnthropicErrorBody))
    async def count_tokens(body: json_body(MessagesRequest)) -> dict:
        served = lookup(body.model)
        check_tools(body)
        choice, parallel = tool_choice(body)
        plan = await make_plan(served.worker.tokenizer, chat_messages(body), functions(body), choice, parallel,
                               None, _FIELDS)
        return {"input_tokens": len(plan.prompt)}


class MessageBuilder:
    """Content blocks built from parser events; every change is also a stream event."""

    def __init__(self, model: str, parser, prompt_tokens: int):
        self.id = "msg_" + uuid.uuid4().hex
        self.model, self.parser, self.prompt_tokens = model, parser or PlainText(), prompt_tokens
        self.content: list[dict[str, Any]] = []
        self._arguments: dict[int, str] = {}  # block index -> a tool_use's JSON arguments so far
        self._open: int | None = None  # the block being written

    async def collect(self, chunks: AsyncIterator[Chunk]) -> dict:
        return self._message(await last_chunk(chunks, self._events))

    async def stream(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        yield _sse("message_start", message=self._message(None))
        async for chunk in chunks:
            if chunk.error:
                yield _sse("error", error={"type": anthropic_type(generation_error(chunk).status),
                                           "message": chunk.error})
                return
            for kind, payload in self._events(chunk):
                yield _sse(kind, **payload)
            if chunk.finish_reason is not None:
                final = self._message(chunk)
                yield _sse("message_delta", delta={"stop_reason": final["stop_reason"],
                                                   "stop_sequence": final["stop_sequence"]}, usage=final["usage"])
                yield _sse("message_stop")
                return

    def _events(self, chunk: Chunk) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for e in parsed(self.parser, chunk):
            if e.kind == "content":
                if self._open is None or self.content[self._open]["type"] != "text":
                    out += self._close() + self._start({"type": "text", "text": ""})
                self.content[self._open]["text"] += e.text
                out.append(("content_block_delta", {"index": self._open,
                                                    "delta": {"type": "text_delta", "text": e.text}}))
            elif e.kind == "call":
                out += self._close() + self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                self._arguments[self._open] = ""
            else:
                self._arguments[self._open] += e.text
                out.append(("content_block_delta", {"index": self._open,
                                                    "delta": {"type": "input_json_delta", "partial_json": e.text}}))
        if chunk.finish_reason is not None:
            out += self._close()
        return out

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict]]:
        self.content.append(block)
        self._open = len(self.content) - 1
        return [("content_block_start", {"index": self._open, "content_block": copy.deepcopy(block)})]

    def _close(self) -> list[tuple[str, dict]]:
        index, self._open = self._open, None
        if index is None:
            return []
        if index in self._arguments:
            self.content[index]["input"] = _object(self._arguments[index])
        return [("content_block_stop", {"index": index})]

    def _message(self, last: Chunk | None) -> dict:
        usage = last.usage if last is not None else None
        stop_reason = stop_sequence = None
        if last is not None:
            if last.finish_reason == "length":  # a call cut short too: its input is what could be read
                stop_reason = "max_tokens"
            elif any(b["type"] == "tool_use" for b in self.content):
                stop_reason = "tool_use"
            elif last.stop_sequence is not None:
                stop_reason, stop_sequence = "stop_sequence", last.stop_sequence
            else:
                stop_reason = "end_turn"
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": copy.deepcopy(self.content) if last is not None else [],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": usage.prompt_tokens if usage else self.prompt_tokens,
                          "output_tokens": usage.completion_tokens if usage else 0,
                          "cache_read_input_tokens": usage.cached_tokens if usage else 0,
                          "cache_creation_input_tokens": 0}}


def _object(arguments: str) -> dict:
    """A call's arguments as its ``input``: an object, or {} where they are not one (cut by the token
    limit, or written freely by a model under ``auto``)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _sse(kind: str, **payload) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicErrors:
    """Errors on the Messages routes in Anthropic's shape (``{"type": "error", "error": {"type",
    "message"}}``, which its SDK reads), whoever made them: the routes, validation, the API key, the
    body limit, the mesh. Other routes pass as they are; an error already in that shape too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            return await self.app(scope, receive, send)
        start: dict | None = None
        body = b""

        async def shaped(message):
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            body = _reshaped(start["status"], body)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaped)


def _reshaped(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(message, str):
        return body
    return json.dumps({"type": "error", "error": {"type": anthropic_type(status), "message": message}},
                      ensure_ascii=False).encode()
