"""Hermes / Qwen: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call
(Qwen2.5, Qwen3, Hermes 2 Pro and 3, SmolLM3 and others whose templates write that block)."""

from __future__ import annotations

from mesh_llm.runtime.tool_formats.base import (
    CallStream,
    Content,
    Event,
    Function,
    MarkerText,
    any_of,
    openai_call_id,
)
from mesh_llm.runtime.tool_formats.native import NativeFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesFormat(NativeFormat):
    name = "hermes"

    @staticmethod
    def detect(template: str) -> bool:
        # Qwen3-Coder, GLM and others put XML, not JSON, inside the block
        return OPEN in template and not any(m in template for m in ("<function=", "<arg_key>", "<parameter="))

    def new_id(self) -> str:
        return openai_call_id()

    def parser(self) -> HermesParser:
        return HermesParser(self.new_id)

    def calls_lark(self, functions: list[Function], parallel: bool, literal) -> str:
        schema = any_of([f.call_schema() for f in functions])
        call = f'{literal(OPEN)} "\\n" {self.json(schema)} "\\n" {literal(CLOSE)}'
        return f'calls: call ("\\n" call)*\ncall: {call}' if parallel else f"calls: {call}"


class HermesParser:
    def __init__(self, new_id):
        self._new_id = new_id
        self._content = Content()
        self._text = MarkerText(OPEN)
        self._closing: MarkerText | None = None  # after a call's object, up to </tool_call>
        self._call: CallStream | None = None

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            if self._call is not None:
                found, text = self._call.feed(text)
                events += found
                if text is None:
                    break
                self._call, self._closing = None, MarkerText(CLOSE)
            elif self._closing is not None:
                _, text = self._closing.feed(text)  # what lies between the object and </tool_call>
                if text is None:
                    break
                self._closing = None
            else:
                content, text = self._text.feed(text)
                events += self._content.text(content)
                if text is None:
                    break
                self._call = CallStream(self._content.call_started(), self._new_id)
        return events

    def finish(self) -> list[Event]:
        events = self._call.finish() if self._call is not None else []
        if self._call is None and self._closing is None:
            events += self._content.text(self._text.flush())
        return events + self._content.finish()
