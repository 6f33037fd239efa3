"""Mistral: ``[TOOL_CALLS]`` then a JSON list of calls (Mistral 7B v0.3, Nemo, Small 3.0), or, in the
newer tokenizers, ``[TOOL_CALLS]name[ARGS]{...}`` once per call (Small 3.2, Devstral, Ministral 3).
Their templates refuse tool-call ids other than nine letters and digits, so those are what it makes."""

from __future__ import annotations

import json

from mesh_llm.runtime.tool_formats.base import (
    CallList,
    Content,
    Event,
    Function,
    JsonScanner,
    MarkerText,
    any_of,
    short_call_id,
)
from mesh_llm.runtime.tool_formats.native import NativeFormat

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralFormat(NativeFormat):
    name = "mistral"

    def __init__(self, template: str):
        self.named = ARGS in template  # the newer name[ARGS]{...} form

    @staticmethod
    def detect(template: str) -> bool:
        return TOOL_CALLS in template

    def new_id(self) -> str:
        return short_call_id()

    def parser(self) -> MistralParser:
        return MistralParser(self.new_id)

    def calls_lark(self, functions: list[Function], parallel: bool, literal) -> str:
        if self.named:
            one = " | ".join(f"{json.dumps(f.name)} {literal(ARGS)} {self.json(f.parameters)}" for f in functions)
            call = f"{literal(TOOL_CALLS)} ({one})"
            return f"calls: call+\ncall: {call}" if parallel else f"calls: {call}"
        items = {"type": "array", "items": any_of([f.call_schema() for f in functions]), "minItems": 1}
        if not parallel:
            items["maxItems"] = 1
        return f"calls: {literal(TOOL_CALLS)} {self.json(items)}"


class MistralParser:
    def __init__(self, new_id):
        self._new_id = new_id
        self._content = Content()
        self._text = MarkerText(TOOL_CALLS)
        self._mode: str | None = None  # None: in content; "start", "list", "name", "args" after the marker
        self._buffer = ""
        self._calls = CallList(self._content, new_id)
        self._arguments: JsonScanner | None = None
        self._index = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            if self._mode is None:
                content, text = self._text.feed(text)
                events += self._content.text(content)
                if text is not None:
                    self._mode = "start"
            elif self._mode == "start":  # "[" opens a list; anything else is a name
                text = text.lstrip()
                if text:
                    self._mode = "list" if text[0] == "[" else "name"
                    text = text[1:] if text[0] == "[" else text
            elif self._mode == "list":
                found, text = self._calls.feed(text)
                events += found
                if text is not None:
                    self._mode = "done"
            elif self._mode == "name":
                self._buffer += text
                text = None
                at = self._buffer.find(ARGS)
                if at >= 0:
                    name = self._buffer[:at].split(CALL_ID)[0].strip()
                    text, self._buffer = self._buffer[at + len(ARGS):], ""
                    index = self._content.call_started()
                    events.append(Event("call", index=index, id=self._new_id(), name=name))
                    self._index, self._arguments, self._mode = index, JsonScanner(), "args"
            elif self._mode == "done":
                break
            else:  # "args"
                part, text = self._arguments.feed(text)
                if part:
                    events.append(Event("arguments", part, self._index))
                if text is not None:
                    self._mode, self._text = None, MarkerText(TOOL_CALLS)  # another call may follow
            if text is None:
                break
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._mode is None:
            events += self._content.text(self._text.flush())
        elif self._mode == "list":
            events += self._calls.finish()
        return events + self._content.finish()
