"""The Responses API's request (``POST /v1/responses``) and its input items as chat messages.

Served: ``input`` (a string, or message, ``function_call`` and ``function_call_output`` items),
``instructions``, function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``text.format``,
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``. Nothing is stored: ``store: true`` and
``previous_response_id`` are refused, as is every other field that would change the answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from mesh_llm.api.errors import APIError, unsupported
from mesh_llm.api.schemas import (
    FIRST_ERROR,
    SAMPLING_REFUSED,
    FunctionName,
    RequestBody,
    check_tool_choice,
    refused,
)

_TEXT_PARTS = ("input_text", "output_text", "text")
# Sent by clients but harmless here (no reasoning output to include).
_HARMLESS_INCLUDE = {"reasoning.encrypted_content"}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @field_validator("schema_")
    @classmethod
    def _only_json_schema(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        """As chat's ``response_format``: a schema beside another type would not be applied."""
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError(f"a schema is read only with type json_schema, not {info.data.get('type')}")
        return value


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None  # None: the one model served (llama-server and vLLM do the same)
    input: str | Annotated[list[dict[str, Any]], FIRST_ERROR]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], FIRST_ERROR] | None = None
    tool_choice: str | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return check_tool_choice(value, NamedFunctionChoice)

    def check_served(self) -> None:
        """A 400 for each field sent that this server would not honour."""
        if self.store:
            raise APIError(400, "responses are not stored by this server: send store false (or omit it) and "
                           "the whole conversation as input", param="store")
        if self.previous_response_id:
            raise APIError(400, "previous_response_id is not supported (responses are not stored): send the "
                           "whole conversation as input", param="previous_response_id")
        for name in ("reasoning", "background", "truncation", "top_logprobs", "max_tool_calls", "prompt",
                     "conversation"):
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, "disabled", {}) and not (name == "reasoning" and _no_effort(value)):
                raise unsupported(name)
        # chat completions' sampling fields the Responses API does not have
        name = refused(self.model_extra, (*SAMPLING_REFUSED, "stop", "seed", "ignore_eos"))
        if name is not None:
            raise unsupported(name)
        verbosity = (self.text.model_extra or {}).get("verbosity") if self.text else None
        if verbosity not in (None, "medium"):  # medium: OpenAI's default, how this server answers
            raise unsupported("text.verbosity")
        for item in self.include or []:
            if item not in _HARMLESS_INCLUDE:
                raise APIError(400, f"include '{item}' is not supported", param="include")
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function":
                raise APIError(400, f"tools of type '{tool.type}' are not supported; only function tools",
                               param=f"tools.{i}.type")
            if tool.name is None:
                raise APIError(400, "a function tool needs a name", param=f"tools.{i}.name")

    def response_schema(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "object"}
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
        return fmt.schema_

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages (a call's items join the assistant message
        before them, as one turn with ``tool_calls``)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                messages.append(_message(item, i))
            elif kind == "function_call":
                call = {"id": _text_field(item, "call_id", i), "type": "function",
                        "function": {"name": _text_field(item, "name", i),
                                     "arguments": _text_field(item, "arguments", i)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _parts_text(output, f"input.{i}.output")
                messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", i),
                                 "content": text})
            else:
                raise APIError(400, f"input items of type '{kind}' are not supported; send messages, "
                               "function_call and function_call_output items", param=f"input.{i}.type")
        if not messages:
            raise APIError(400, "the input is empty", param="input")
        return messages


def _no_effort(reasoning: Any) -> bool:
    return isinstance(reasoning, dict) and reasoning.get("effort") in (None, "none", "minimal") \
        and reasoning.get("summary") is None


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(400, f"unsupported message role '{role}'", param=f"input.{i}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"input.{i}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts_text(parts: Any, param: str) -> str:
    if not isinstance(parts, list):
        raise APIError(400, "expected a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"content parts of type '{kind}' are not supported; only text",
                           param=f"{param}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def _text_field(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"the {item.get('type')} item needs a string '{key}'", param=f"input.{i}.{key}")
    return value
