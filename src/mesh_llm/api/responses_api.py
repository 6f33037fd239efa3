"""``POST /v1/responses``: OpenAI's Responses API (what the Agents SDK and Codex speak) on the same
plan, constraint and parsers as chat completions. A reply becomes output items, a ``message`` with
``output_text`` and one ``function_call`` per call, whole or as the Responses event stream
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ..., ``response.completed``)."""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request

from mesh_llm.api.body import body_schema, json_body
from mesh_llm.api.chat_tools import make_plan
from mesh_llm.api.errors import GENERATION_ERRORS
from mesh_llm.api.generation import PromptRoom, collect_unless_left, open_generation, stream_response
from mesh_llm.api.responses import error_kind, last_chunk, parsed
from mesh_llm.api.responses_schemas import NamedFunctionChoice, ResponsesRequest
from mesh_llm.engines.base import SamplingParams
from mesh_llm.runtime.tool_formats import Function, PlainText
from mesh_llm.runtime.tools import ToolChoice
from mesh_llm.runtime.worker import Chunk, Usage

_FIELDS = {"messages": "input", "tools": "tools", "tool_choice": "tool_choice", "response_format": "text.format"}
_NO_PARAMETERS = {"type": "object", "properties": {}}


def install_responses(app: FastAPI, lookup: Callable) -> None:
    @app.post("/v1/responses", responses=GENERATION_ERRORS, openapi_extra=body_schema(ResponsesRequest))
    async def create_response(body: json_body(ResponsesRequest), request: Request):
        served = lookup(body.model)
        body.check_served()
        functions = [Function(t.name, t.parameters or _NO_PARAMETERS, t.description) for t in body.tools or []]
        choice = body.tool_choice
        choice = ToolChoice("required", choice.name) if isinstance(choice, NamedFunctionChoice) \
            else ToolChoice(choice or "auto")
        with served.worker.arriving() as arrival:
            plan = await make_plan(served.worker.tokenizer, body.chat_messages(), functions, choice,
                                   body.parallel_tool_calls, body.response_schema(), _FIELDS,
                                   PromptRoom.of(served.worker, body.max_output_tokens, "input"))
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, constraint=plan.constraint)
            generation = open_generation(served.worker, plan.prompt, params, body.max_output_tokens,
                                         prompt_param="input", arrival=arrival)
        builder = ResponsesBuilder(served.id, body, plan.parser)
        if body.stream:
            return stream_response(builder.stream(aiter(generation)), generation)
        return await collect_unless_left(builder.collect(aiter(generation)), request, generation)


class ResponsesBuilder:
    """Output items built from parser events; every change is also a stream event."""

    def __init__(self, model: str, body: ResponsesRequest, parser):
        self.id = "resp_" + uuid.uuid4().hex
        self.model, self.body, self.parser = model, body, parser or PlainText()
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._sequence = 0

    async def collect(self, chunks: AsyncIterator[Chunk]) -> dict:
        return self._response(await last_chunk(chunks, self._events))

    async def stream(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        yield self._sse("response.created", response=self._response(None))
        yield self._sse("response.in_progress", response=self._response(None))
        async for chunk in chunks:
            if chunk.error:
                yield self._sse("error", code=error_kind(chunk)[2], message=chunk.error, param=None)
                return
            for kind, payload in self._events(chunk):
                yield self._sse(kind, **payload)
            if chunk.finish_reason is not None:
                final = self._response(chunk)
                kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                yield self._sse(kind, response=final)
                return

    def _events(self, chunk: Chunk) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for e in parsed(self.parser, chunk):
            if e.kind == "content":
                if self._open is None or self._open["type"] != "message":
                    out += self._close() + self._open_message()
                self._open["content"][0]["text"] += e.text
                out.append(("response.output_text.delta", {**self._where(), "content_index": 0,
                                                            "delta": e.text, "logprobs": []}))
            elif e.kind == "call":
                out += self._close()
                self._open = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "call_id": e.id,
                              "name": e.name, "arguments": "", "status": "in_progress"}
                out += self._added()
            else:
                self._open["arguments"] += e.text
                out.append(("response.function_call_arguments.delta", {**self._where(), "delta": e.text}))
        if chunk.finish_reason is not None:
            out += self._close()
            if not self.output:  # an empty reply is still a message
                out += self._open_message() + self._close()
        return out

    def _open_message(self) -> list[tuple[str, dict]]:
        self._open = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []}
        out = self._added()
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open["content"].append(part)
        out.append(("response.content_part.added", {**self._where(), "content_index": 0,
                                                     "part": copy.deepcopy(part)}))
        return out

    def _added(self) -> list[tuple[str, dict]]:
        self.output.append(self._open)
        return [("response.output_item.added", {"output_index": len(self.output) - 1,
                                                "item": copy.deepcopy(self._open)})]

    def _close(self) -> list[tuple[str, dict]]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                       "logprobs": []}))
            out.append(("response.content_part.done", {**where, "content_index": 0,
                                                        "part": copy.deepcopy(part)}))
        else:
            out.append(("response.function_call_arguments.done", {**where, "arguments": item["arguments"]}))
        item["status"] = "completed"
        out.append(("response.output_item.done", {"output_index": where["output_index"],
                                                  "item": copy.deepcopy(item)}))
        return out

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _sse(self, kind: str, **payload) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def _response(self, last: Chunk | None) -> dict:
        body = self.body
        status = "in_progress" if last is None else "incomplete" if last.finish_reason == "length" else "completed"
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": copy.deepcopy(self.output) if last is not None else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": fmt},
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunctionChoice) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "metadata": body.metadata or {}, "truncation": "disabled",
            "usage": _usage(last.usage) if last is not None and last.usage is not None else None,
        }


def _usage(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
