"""The generic format, for templates that know nothing of tools (the embedded SmolLM2's among them),
after llama.cpp's: the tools are described in the system message, and the reply is constrained to
one JSON object, ``{"tool_call": {"name", "arguments"}}``, ``{"tool_calls": [...]}`` (parallel calls)
or ``{"response": ...}`` (a reply; absent when a call is required). Any model can then call tools,
and every call it makes parses and matches its function's parameters."""

from __future__ import annotations

import json
import re
from typing import Any

from mesh_llm.runtime.constrain import json_schema_grammar
from mesh_llm.runtime.tool_formats.base import (
    CallList,
    CallStream,
    Content,
    Event,
    Function,
    JsonScanner,
    JsonStringStream,
    any_of,
    openai_call_id,
)

_KEY = re.compile(r'\s*\{\s*"(tool_calls|tool_call|response)"\s*:\s*')
_OPENING = re.compile(r'\s*(?:\{\s*(?:"\w*"?\s*)?)?')  # what could still become the envelope


class GenericFormat:
    name = "generic"

    def new_id(self) -> str:
        return openai_call_id()

    def prepare(self, messages: list[dict[str, Any]], functions: list[Function], required: bool,
                parallel: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The tools in the system message; earlier calls written as JSON, as the model is asked to
        write them (in words when no tool may be called now), and tool results as user turns in words
        (these templates know no tool role)."""
        out: list[dict[str, Any]] = []
        for message in messages:
            if message.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in message["tool_calls"]]
                if functions:
                    envelope = {"tool_calls": calls} if len(calls) > 1 else {"tool_call": calls[0]}
                    text = json.dumps(envelope, ensure_ascii=False)
                else:  # no tool may be called now: in words, so that the reply is words too
                    text = " ".join(f"I called {c['name']} with {json.dumps(c['arguments'], ensure_ascii=False)}."
                                    for c in calls)
                out.append({"role": "assistant", "content": text})
            elif message["role"] == "tool":
                text = f"The tool {message.get('name', '')} answered: {message['content']}"
                if out and out[-1]["role"] == "user" and out[-1].get("tool_result"):
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "tool_result": True})
            else:
                out.append(message)
        for message in out:
            message.pop("tool_result", None)
        if functions:
            text = _instructions(functions, required, parallel)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out, {}

    def grammar(self, functions: list[Function], required: bool, parallel: bool,
                response_schema: dict[str, Any] | None, literal=None) -> str:
        """One call, or with ``parallel`` also a list of calls (offered beside the single form, which
        the prompt shows: a small model asked for a list tends to repeat its call until cut off)."""
        calls = any_of([f.call_schema() for f in functions])
        forms = [_object("tool_call", calls)]
        if parallel:
            forms.append(_object("tool_calls", {"type": "array", "items": calls, "minItems": 1}))
        if not required:
            forms.append(_object("response", response_schema or {"type": "string"}))
        return json_schema_grammar(any_of(forms))

    def parser(self) -> GenericParser:
        return GenericParser(self.new_id)


def _object(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {key: schema}, "required": [key]}


def _instructions(functions: list[Function], required: bool, parallel: bool) -> str:
    tools = "\n".join(json.dumps(f.openai_json()["function"], ensure_ascii=False) for f in functions)
    example = json.dumps({"tool_call": {"name": functions[0].name, "arguments": {}}})
    ways = [f"{example} (with the tool's arguments) to call a tool"]
    if parallel:
        ways.append('{"tool_calls": [...]} to call several at once')
    if not required:
        ways.append('{"response": "..."} to reply (once a tool has answered, reply with its result)')
    return f"You can call these tools:\n{tools}\n\nRespond with one JSON object: " + ", or ".join(ways) + "."


class GenericParser:
    def __init__(self, new_id):
        self._new_id = new_id
        self._content = Content()
        self._buffer = ""
        self._part: CallStream | CallList | JsonScanner | JsonStringStream | None = None
        self._mode = "start"  # then "tool_call", "tool_calls", "list", "response", "json", "text", "end"

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text and self._mode != "end":
            if self._mode == "start":
                text = self._start(text)
            elif self._mode == "text":
                return events + self._content.text(text)
            elif self._mode == "tool_calls":  # up to the list's "["
                text = text.lstrip()
                if text:
                    self._mode, self._part, text = "list", CallList(self._content, self._new_id), text[1:]
            elif self._mode == "response" and not isinstance(self._part, (JsonStringStream, JsonScanner)):
                text = text.lstrip()
                if text[:1] == '"':
                    self._part, text = JsonStringStream(), text[1:]
                elif text:
                    self._part = JsonScanner()
            else:
                found, text = self._part.feed(text)
                if isinstance(found, str):
                    events += self._content.text(found)
                else:
                    events += found
                if text is not None:
                    self._mode = "end"
        return events

    def _start(self, text: str) -> str:
        self._buffer += text
        match = _KEY.match(self._buffer)
        if match is None:
            if _OPENING.fullmatch(self._buffer):
                return ""  # not decided yet
            self._mode, rest = "text", self._buffer  # not the envelope: the model's words as they are
            self._buffer = ""
            return rest
        self._mode, rest = match[1], self._buffer[match.end():]
        self._buffer = ""
        if self._mode == "tool_call":
            self._part = CallStream(self._content.call_started(), self._new_id)
        return rest

    def finish(self) -> list[Event]:
        if self._mode == "start":  # cut before the envelope's key was whole ('{"tool_c'): markup
            events = []
        elif isinstance(self._part, (CallStream, CallList)):
            events = self._part.finish()
        else:
            events = []
        return events + self._content.finish()
