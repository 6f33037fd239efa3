"""OpenAI request shapes, validated by pydantic: a bad field becomes a 400 naming that field.

Unknown fields are accepted and ignored, as OpenAI clients send many (``user``, ``metadata``...);
fields that would change the answer and are not served are refused (each request's ``REFUSED``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    FailFast,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

Stop = str | list[str] | None


class _StopAtFirst(FailFast):
    """pydantic's ``FailFast`` (a list stops at its first bad item: 60,000 bad parts cost one error,
    not 60,000), hashable so that it can sit inside a union."""

    __hash__ = object.__hash__


FIRST_ERROR = _StopAtFirst()


def _lone_surrogate(value: Any) -> list[str] | None:
    """The path to a string holding a lone surrogate, or None (the path built only on a find)."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return []
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate(key) is not None:
            return [key]
        path = _lone_surrogate(item)
        if path is not None:
            return [str(key), *path]
    return None


class RequestBody(BaseModel):
    """A request's top level: unknown fields are kept (each request says which it refuses), and no
    string anywhere in it holds a lone surrogate. JSON allows one (``"\\ud800"``), which no tokenizer
    can encode and no answer can carry back: refused before anything runs, whichever field holds it
    (one only echoed back, like ``metadata``, failed after the whole generation, or cut a stream)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        path = _lone_surrogate(data)
        if path is not None:
            raise PydanticCustomError("invalid_unicode", "'{where}' holds text that is not valid Unicode (a "
                                      "lone surrogate)", {"where": ".".join(path) or "body"})
        return data


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], FIRST_ERROR] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], FIRST_ERROR] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def chat_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (keys only where they have a value)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:  # a participant's name, or a tool's: for templates that render it
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


def refused(extra: dict[str, Any] | None, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` in ``extra`` with a value that would change the answer."""
    extra = extra or {}
    return next((name for name in names if extra.get(name) not in (None, {}, [], "", False)
                 and extra.get(name) != _NEUTRAL.get(name)), None)


# Sampling settings other servers take (OpenAI's penalties, llama.cpp's and vLLM's extras) that this
# one does not apply: refused unless sent at the value that changes nothing.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "repeat_penalty": 1,
            "min_tokens": 0, "best_of": 1, "typical_p": 1, "mirostat": 0, "n_probs": 0, "n": 1, "top_k": 0,
            "min_p": 0}
SAMPLING_REFUSED = (*_NEUTRAL, "logit_bias", "grammar", "json_schema", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "chat_template", "chat_template_kwargs")


class SamplingFields(RequestBody):
    """Fields shared by chat and text completions."""

    REFUSED: ClassVar[tuple[str, ...]] = SAMPLING_REFUSED
    model: str | None = None  # None: the one model served (llama-server and vLLM do the same)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0  # not OpenAI, accepted as llama.cpp and vLLM do
    min_p: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.0
    seed: StrictInt | None = None
    stop: Stop = None
    n: Annotated[StrictInt, Field(ge=1)] = 1
    ignore_eos: StrictBool = False  # not OpenAI: generate exactly max_tokens (benchmarks)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Stop) -> Stop:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # as OpenAI answers
            raise ValueError("only allowed when stream is true")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def refused_field(self) -> str | None:
        """The first field sent that this server does not serve (empty or neutral values are harmless)."""
        return refused(self.model_extra, self.REFUSED)


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # every call is constrained to the parameters anyway


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"a json_schema is read only with type json_schema, not {self.type}")
        return self

    def schema_or_none(self) -> dict[str, Any] | None:
        """The schema the reply must match, None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.type == "json_schema" else None


def check_tool_choice(value: Any, named: type[BaseModel]) -> Any:
    """"none", "auto", "required", a named function, or None, with one clear message otherwise
    (a plain union would name its members in the error's field)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        try:
            return named.model_validate(value)
        except ValueError:
            pass
    raise ValueError('expected "none", "auto", "required" or a named function')


# Fields that would change the answer but are not served: a 400 rather than silence.
CHAT_REFUSED = (*SAMPLING_REFUSED, "functions", "function_call", "audio", "modalities", "prediction",
                "web_search_options", "suffix", "echo", "reasoning_effort", "verbosity",
                "add_generation_prompt", "continue_final_message", "store")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1), FIRST_ERROR]
    max_completion_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], FIRST_ERROR] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None

    REFUSED: ClassVar[tuple[str, ...]] = CHAT_REFUSED

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return check_tool_choice(value, NamedToolChoice)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], FIRST_ERROR] | Annotated[list[StrictInt], FIRST_ERROR]  # a list of ints is token ids
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: Literal[False] = False
    max_tokens: Annotated[StrictInt, Field(gt=0)] = 16  # OpenAI's default for completions, also for null
    REFUSED: ClassVar[tuple[str, ...]] = (*SAMPLING_REFUSED, "suffix", "response_format", "tools",
                                          "tool_choice", "functions", "function_call", "messages",
                                          "top_logprobs")

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_limit(cls, value: Any) -> Any:
        return 16 if value is None else value  # null as omitted: OpenAI's default, not the whole context

    def token_limit(self) -> int | None:
        return self.max_tokens
