"""A chat request's messages, tools, tool_choice and response_format made into a runtime
:class:`~mesh_llm.runtime.tools.ChatPlan`, every mistake in them a 400 naming its field."""

from __future__ import annotations

import asyncio
from typing import Any

from mesh_llm.api.errors import APIError, unsupported
from mesh_llm.api.generation import PromptRoom
from mesh_llm.api.schemas import ChatCompletionRequest, NamedToolChoice
from mesh_llm.engines.base import Tokenizer
from mesh_llm.runtime.chat import TemplateError
from mesh_llm.runtime.prompt_limit import PromptTooLong
from mesh_llm.runtime.tool_formats import Function
from mesh_llm.runtime.tools import ChatPlan, ToolChoice, ToolRequestError, plan_chat

_NO_PARAMETERS = {"type": "object", "properties": {}}


async def chat_plan(tokenizer: Tokenizer, body: ChatCompletionRequest,
                    room: PromptRoom | None = None) -> ChatPlan:
    refused = body.refused_field()
    if refused is not None:
        raise unsupported(refused)
    functions = [Function(t.function.name, t.function.parameters or _NO_PARAMETERS, t.function.description)
                 for t in body.tools or []]
    choice = tool_choice(body.tool_choice)
    schema = body.response_format.schema_or_none() if body.response_format else None
    return await make_plan(tokenizer, [m.chat_dict() for m in body.messages], functions, choice,
                           body.parallel_tool_calls, schema, room=room)


def tool_choice(value: str | NamedToolChoice | None) -> ToolChoice:
    if isinstance(value, NamedToolChoice):
        return ToolChoice("required", value.function.name)
    return ToolChoice(value or "auto")


async def make_plan(tokenizer: Tokenizer, messages: list[dict[str, Any]], functions: list[Function],
                    choice: ToolChoice, parallel: bool, schema: dict[str, Any] | None,
                    fields: dict[str, str] | None = None, room: PromptRoom | None = None) -> ChatPlan:
    """Renders and compiles off the event loop (a first constrained request builds the model's token
    table: 0.1-0.5 s). A prompt that provably does not fit ``room`` is refused before tokenizing."""
    try:
        return await asyncio.to_thread(plan_chat, tokenizer, messages, functions, choice, parallel, schema,
                                       fields, room.tokens if room is not None else None)
    except PromptTooLong as exc:
        raise room.exceeded(exc.at_least) from None
    except ToolRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except TemplateError as exc:
        raise APIError(400, str(exc), param=(fields or {}).get("messages", "messages")) from None
