"""A chat request with tools or a JSON reply, made concrete for one model: the prompt its template
renders, the constraint on its output, and the parser that finds tool calls in it.

Engine-neutral and HTTP-neutral: the chat completions and the Responses routes both come here with
plain messages (OpenAI's chat shapes as dicts), the functions, and what the reply must be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from mesh_llm.engines.base import Tokenizer
from mesh_llm.runtime.chat import encode_chat
from mesh_llm.runtime.constrain import (
    GrammarConstraint,
    GrammarError,
    check_grammar,
    grammars_for,
    json_schema_grammar,
)
from mesh_llm.runtime.tool_formats import Function, Parser, format_for


class ToolRequestError(ValueError):
    """The request's tools, choice or history do not fit together; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required"] = "auto"
    function: str | None = None  # a named function (then mode is "required")


@dataclass
class ChatPlan:
    prompt: list[int]
    constraint: GrammarConstraint | None  # per request: it holds the sequence's grammar state
    parser: Parser | None  # None: the reply is plain content
    format: str | None  # the tool-call format's name, when tools are in play


def plan_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], functions: list[Function] = (),
              choice: ToolChoice = ToolChoice(), parallel: bool = True,
              response_schema: dict[str, Any] | None = None, fields: dict[str, str] | None = None,
              room: int | None = None) -> ChatPlan:
    """Raises :class:`ToolRequestError` (and ``TemplateError`` from rendering) for a bad request,
    ``PromptTooLong`` for a prompt that provably has more than ``room`` tokens. ``fields`` renames
    the params errors name (the Responses API spells them differently)."""
    fields = {"messages": "messages", "tools": "tools", "tool_choice": "tool_choice",
              "response_format": "response_format", **(fields or {})}
    messages = _with_tool_names(messages, fields["messages"])
    _check(functions, choice, fields)
    if response_schema is not None:
        _compile_check(response_schema, fields["response_format"])
    active = list(functions) if choice.mode != "none" else []
    history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    fmt = format_for(tokenizer.chat_template) if active or history else None
    extra: dict[str, Any] = {}
    required = choice.mode == "required"
    if fmt is not None:  # earlier calls are written in the format even when no tool may be called now
        messages, extra = fmt.prepare(messages, active, required, parallel and choice.function is None)
    prompt = encode_chat(tokenizer, messages, room, **extra)
    grammars = grammars_for(tokenizer)
    grammar = None
    if active:
        targets = [f for f in active if f.name == choice.function] if choice.function else active
        grammar = fmt.grammar(targets, required, parallel and choice.function is None, response_schema,
                              grammars.literal)
    elif response_schema is not None:
        grammar = json_schema_grammar(response_schema)
    try:
        constraint = grammars.constraint(grammar) if grammar is not None else None
    except GrammarError as exc:
        raise ToolRequestError(str(exc), fields["tools"] if active else fields["response_format"]) from None
    return ChatPlan(prompt, constraint, fmt.parser() if active else None, fmt.name if active else None)


def _check(functions: list[Function], choice: ToolChoice, fields: dict[str, str]) -> None:
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ToolRequestError("tool names must be unique", fields["tools"])
    if choice.mode == "required" and not functions:
        raise ToolRequestError("tool_choice requires a tool call, but no tools were given", fields["tool_choice"])
    if choice.function is not None and choice.function not in names:
        raise ToolRequestError(f"tool_choice names the function '{choice.function}', which is not among the "
                               f"tools ({', '.join(names) or 'none'})", fields["tool_choice"])
    for i, function in enumerate(functions):
        _compile_check(function.parameters, f"{fields['tools']}.{i}")


def _compile_check(schema: dict[str, Any], param: str) -> None:
    try:
        check_grammar(json_schema_grammar(schema))
    except GrammarError as exc:
        raise ToolRequestError(f"invalid JSON schema: {exc}", param) from None


def _with_tool_names(messages: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """Each tool result must answer a call made earlier in the conversation; it gets that call's
    function name (some templates print it). Call arguments become objects, as templates expect."""
    calls: dict[str, str] = {}
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_object_arguments(c) for c in message["tool_calls"]]
            calls.update({c["id"]: c["function"]["name"] for c in message["tool_calls"]})
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in calls:
                raise ToolRequestError(f"the tool message at {i} answers the call '{call_id}', but no earlier "
                                       "assistant message made a call with that id", f"{field}.{i}.tool_call_id")
            message.setdefault("name", calls[call_id])
        out.append(message)
    return out


def _object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: kept as text
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    return {**call, "function": {**call["function"], "arguments": arguments}}
