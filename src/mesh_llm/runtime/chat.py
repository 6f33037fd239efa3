"""Chat templates, rendered once by us for every engine so both see the same token ids.

Follows Hugging Face's ``apply_chat_template`` environment (sandboxed Jinja, trim/lstrip blocks,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII) so model templates behave as
their authors tested them.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mesh_llm.engines.base import Tokenizer
from mesh_llm.runtime.prompt_limit import encode_within

# A plain ChatML template for models that ship none (as mlx-lm and llama.cpp fall back to).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TemplateError(ValueError):
    """The model's chat template rejected the conversation (it raised, or it is broken)."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template does not parse: {exc}") from exc


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                **extra: Any) -> str:
    """The prompt text the model was trained to see for ``messages``."""
    template = _compile(tokenizer.chat_template or CHATML_TEMPLATE)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "",
                               **extra)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the model's chat template failed: {exc}") from exc


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], room: int | None = None,
                **extra: Any) -> list[int]:
    """Token ids of the rendered conversation. The template writes any BOS itself, as in Hugging Face.
    :class:`~mesh_llm.runtime.prompt_limit.PromptTooLong` when it provably has more than ``room``."""
    return encode_within(tokenizer, render_chat(tokenizer, messages, **extra), False, room)
