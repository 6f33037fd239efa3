"""Llama 3.1-3.3: a bare ``{"name": ..., "parameters": {...}}`` reply (optionally after
``<|python_tag|>``), one call per turn, as their templates ask for custom tools."""

from __future__ import annotations

import re

from mesh_llm.runtime.tool_formats.base import CallStream, Content, Event, Function, any_of, openai_call_id
from mesh_llm.runtime.tool_formats.native import NativeFormat

PYTHON_TAG = "<|python_tag|>"
_FIRST_KEY = re.compile(r'\s*\{\s*"(\w+)"')
_OPENING = re.compile(r'\s*\{\s*(?:"\w*)?')


class Llama3Format(NativeFormat):
    name = "llama3"

    @staticmethod
    def detect(template: str) -> bool:
        return "<|start_header_id|>" in template and '"parameters": ' in template

    def new_id(self) -> str:
        return openai_call_id()

    def parser(self) -> Llama3Parser:
        return Llama3Parser(self.new_id)

    def calls_lark(self, functions: list[Function], parallel: bool, literal) -> str:
        return f"calls: {self.json(any_of([f.call_schema('parameters') for f in functions]))}"


class Llama3Parser:
    """The reply is a call if it opens with a JSON object whose first key is "name" (or "type"), else
    it is content; text is held only while that is undecided."""

    def __init__(self, new_id):
        self._new_id = new_id
        self._content = Content()
        self._pending = ""  # text not yet known to be content or a call
        self._call: CallStream | None = None
        self._is_text = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            if self._is_text:
                return events + self._content.text(text)
            if self._call is not None:
                found, text = self._call.feed(text)
                events += found
                if text is None:
                    break
                self._call = None
                text = text.lstrip().lstrip(";")  # calls separated by ";" or whitespace
                continue
            self._pending += text
            text = ""
            pending = self._pending.removeprefix(PYTHON_TAG)
            if pending.isspace() or not pending or PYTHON_TAG.startswith(self._pending):
                break
            if pending.lstrip()[0] != "{":
                self._is_text = True
                text, self._pending = self._pending, ""
                continue
            first = _FIRST_KEY.match(pending)
            if first is None and _OPENING.fullmatch(pending):
                break  # '{' or '{"na': not decided yet
            if first is None or first[1] not in ("name", "type"):
                self._is_text = True
                text, self._pending = self._pending, ""
                continue
            self._pending = ""
            self._call = CallStream(self._content.call_started(), self._new_id, ("parameters", "arguments"))
            text = pending
        return events

    def finish(self) -> list[Event]:
        events = self._call.finish() if self._call is not None else self._content.text(self._pending)
        return events + self._content.finish()
