"""What formats whose templates render the tools themselves share: the template gets ``tools`` and the
history as written, and the output is free unless the request needs a call or a JSON reply."""

from __future__ import annotations

from typing import Any

from mesh_llm.runtime.constrain import lark_grammar, lark_json
from mesh_llm.runtime.tool_formats.base import Function


class NativeFormat:
    name = "native"

    def prepare(self, messages: list[dict[str, Any]], functions: list[Function], required: bool,
                parallel: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages to render and the template's extra variables."""
        return messages, ({"tools": [f.openai_json() for f in functions]} if functions else {})

    @staticmethod
    def json(schema: dict[str, Any]) -> str:
        return lark_json(schema)

    def grammar(self, functions: list[Function], required: bool, parallel: bool,
                response_schema: dict[str, Any] | None, literal) -> str | None:
        """The grammar the output must follow: only calls when one is required, a JSON reply or calls
        when the reply has a schema, else none (the model calls tools or not; the parser finds them).
        ``literal(text)`` spells a marker in Lark (a special token by id, else a string)."""
        if not required and response_schema is None:
            return None
        start = "start: calls" if required else f"start: {self.json(response_schema)} | calls"
        return lark_grammar(start + "\n" + self.calls_lark(functions, parallel, literal))

    def calls_lark(self, functions: list[Function], parallel: bool, literal) -> str:
        """Lark rules defining ``calls``: one call, or (``parallel``) one or more."""
        raise NotImplementedError
