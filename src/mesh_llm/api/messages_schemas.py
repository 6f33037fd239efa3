"""The Anthropic Messages API's request (``POST /v1/messages``, ``/v1/messages/count_tokens``) and
its content blocks as chat messages.

Served: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use`` and
``tool_result`` blocks, ``tools`` (client tools: name, description, input_schema), ``tool_choice``
(auto, any, tool, none; ``disable_parallel_tool_use``), ``max_tokens``, ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``stream``. ``metadata`` is informational and
``cache_control`` (on the request or a block) a hint (the prompt cache here is automatic): both are
accepted and change nothing. ``thinking`` only disabled; images, documents, server tools and any other field are
refused with a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from mesh_llm.api.errors import APIError, unsupported
from mesh_llm.api.schemas import FIRST_ERROR, FunctionName, RequestBody
from mesh_llm.runtime.tool_formats import Function
from mesh_llm.runtime.tools import ToolChoice

_NO_PARAMETERS = {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: dict(_NO_PARAMETERS))
    type: str | None = None  # "custom" (or absent): a client tool; others are Anthropic's server tools


class ToolChoiceBlock(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[dict[str, Any]], FIRST_ERROR]


class MessagesRequest(RequestBody):
    model: str | None = None  # None: the one model served
    messages: Annotated[list[Message], FIRST_ERROR] = Field(min_length=1)
    system: str | Annotated[list[dict[str, Any]], FIRST_ERROR] | None = None
    tools: Annotated[list[Tool], FIRST_ERROR] | None = None
    tool_choice: ToolChoiceBlock | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=1)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None  # informational (user_id): changes nothing


class CreateMessage(MessagesRequest):
    max_tokens: Annotated[StrictInt, Field(gt=0)]

    def check_served(self) -> None:
        """A 400 for each field sent that this server would not honour."""
        thinking = (self.model_extra or {}).get("thinking")
        if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
            raise APIError(400, "extended thinking is not supported by this server: send thinking "
                           "{\"type\": \"disabled\"} or omit it", param="thinking")
        for name, value in (self.model_extra or {}).items():
            harmless = (name == "service_tier" and value in ("auto", "standard_only")) or name == "cache_control"
            if name != "thinking" and not harmless:
                raise unsupported(name)
        check_tools(self)


def check_tools(body: MessagesRequest) -> None:
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(400, f"tools of type '{tool.type}' (Anthropic's server tools) are not supported; "
                           "only client tools with an input_schema", param=f"tools.{i}.type")
    choice = body.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice.name")


def functions(body: MessagesRequest) -> list[Function]:
    return [Function(t.name, t.input_schema or _NO_PARAMETERS, t.description) for t in body.tools or []]


def tool_choice(body: MessagesRequest) -> tuple[ToolChoice, bool]:
    """The runtime's choice and whether several calls may come in one turn."""
    choice = body.tool_choice
    if choice is None:
        return ToolChoice("auto"), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "any":
        return ToolChoice("required"), parallel
    if choice.type == "tool":
        return ToolChoice("required", choice.name), parallel
    return ToolChoice(choice.type), parallel


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages: a user turn's tool results become tool messages
    (before its text), an assistant turn's tool_use blocks its ``tool_calls``."""
    messages: list[dict[str, Any]] = []
    if body.system:
        text = body.system if isinstance(body.system, str) else _texts(body.system, "system", "\n\n")
        messages.append({"role": "system", "content": text})
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(message.content):
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content", "")
                text = content if isinstance(content, str) else _texts(content, f"{where}.{j}.content")
                messages.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", f"{where}.{j}"),
                                 "content": text})
            elif kind == "tool_use" and message.role == "assistant":
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise APIError(400, "a tool_use block's input must be an object", param=f"{where}.{j}.input")
                calls.append({"id": _field(block, "id", f"{where}.{j}"), "type": "function",
                              "function": {"name": _field(block, "name", f"{where}.{j}"),
                                           "arguments": json.dumps(arguments, ensure_ascii=False)}})
            else:
                raise APIError(400, f"content blocks of type '{kind}' are not supported in a {message.role} "
                               "message; send text, tool_use (assistant) and tool_result (user) blocks",
                               param=f"{where}.{j}")
        if calls:
            messages.append({"role": "assistant", "content": "".join(texts), "tool_calls": calls})
        elif texts or not message.content:
            messages.append({"role": message.role, "content": "".join(texts)})
    return messages


def _texts(blocks: list[dict[str, Any]], param: str, separator: str = "") -> str:
    out = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(400, f"content blocks of type '{kind}' are not supported here; only text",
                           param=f"{param}.{j}")
        out.append(block["text"])
    return separator.join(out)


def _field(block: dict[str, Any], key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"a {block.get('type')} block needs a string '{key}'", param=f"{param}.{key}")
    return value
