"""OpenAI request shapes, validated by pydantic: a bad field becomes a 400 naming that field.

Unknown fields are accepted and ignored, as OpenAI clients send many (``user``, ``metadata``...).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Stop = str | list[str] | None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # not OpenAI, accepted as llama.cpp and vLLM do
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: int | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1)] = 1
    ignore_eos: bool = False  # not OpenAI: generate exactly max_tokens (benchmarks)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Stop) -> Stop:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]  # a list of ints is token ids
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: Literal[False] = False
    max_tokens: Annotated[int, Field(gt=0)] | None = 16  # OpenAI's default for completions

    def token_limit(self) -> int | None:
        return self.max_tokens
