"""Tool-call formats: how a model family writes tool calls, one small module each.

A format is chosen from the model's chat template (the markers it writes), and gives the messages and
template variables to render, a streaming parser for the reply, and the grammar that constrains a
reply that must be a call (or JSON). Templates with no known format get the generic one.
"""

from __future__ import annotations

from mesh_llm.runtime.tool_formats.base import Event, Function, Parser, PlainText
from mesh_llm.runtime.tool_formats.generic import GenericFormat
from mesh_llm.runtime.tool_formats.hermes import HermesFormat
from mesh_llm.runtime.tool_formats.llama3 import Llama3Format
from mesh_llm.runtime.tool_formats.mistral import MistralFormat

ToolFormat = GenericFormat | HermesFormat | Llama3Format | MistralFormat

__all__ = ["Event", "Function", "Parser", "PlainText", "ToolFormat", "format_for"]


def format_for(template: str | None) -> ToolFormat:
    template = template or ""
    if MistralFormat.detect(template):
        return MistralFormat(template)
    if HermesFormat.detect(template):
        return HermesFormat()
    if Llama3Format.detect(template):
        return Llama3Format()
    return GenericFormat()
