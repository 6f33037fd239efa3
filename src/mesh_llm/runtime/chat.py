"""Chat templates, rendered once by us for every engine so both see the same token ids.

Follows Hugging Face's ``apply_chat_template`` environment (sandboxed Jinja, trim/lstrip blocks,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII) so model templates behave as
their authors tested them.
"""

from __future__ import annotations

import datetime
import json
import re
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mesh_llm.engines.base import Tokenizer
from mesh_llm.runtime.prompt_limit import encode_within, refuse_beyond

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
    A control token's text inside a message (``<|im_end|>`` in a pasted file, or in code an agent
    wrote) or a tool's definition is encoded as plain text, so none can close its turn or open
    another role's: only the template's own markup becomes control tokens (llama-server, vLLM and
    mlx-lm tokenize the rendered text whole, where it does).
    :class:`~mesh_llm.runtime.prompt_limit.PromptTooLong` when it provably has more than ``room``."""
    literals = _Literals.find(tokenizer.control_texts, {"messages": messages, **extra})
    if literals is None:
        return encode_within(tokenizer, render_chat(tokenizer, messages, **extra), False, room)
    text = render_chat(tokenizer, **literals.variables)
    refuse_beyond(tokenizer, literals.restored(text), room)
    ids: list[int] = []
    for markup, literal in literals.pieces(text):
        ids += tokenizer.encode(markup, False)
        if literal is not None:
            ids += tokenizer.encode_plain(literal)
    return ids


class _Literals:
    """The control-token texts found in the strings a template renders (the messages, the tools),
    each swapped for a placeholder while it renders: the text's index between two private-use
    characters that no string holds. The rendered text is then encoded piece by piece, cut at the
    placeholders. A cut stands where the whole text holds a control token, a boundary no token
    crosses either way, so the markup around it encodes as it would in the whole text (an SPM
    tokenizer's space prefix, which follows any control token, included)."""

    def __init__(self, texts: list[str], mark: str, variables: dict[str, Any]):
        self.texts, self.variables = texts, variables
        self._marks = re.compile(f"{mark}(\\d+){mark}")

    @classmethod
    def find(cls, control: frozenset[str], variables: dict[str, Any]) -> _Literals | None:
        pattern = _pattern(control)
        if pattern is None or not any(pattern.search(s) for s in _strings(variables)):
            return None
        held = "\0".join(_strings(variables))
        mark = next(chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in held)
        texts: list[str] = []

        def swap(match: re.Match) -> str:
            if match.group() not in texts:
                texts.append(match.group())
            return f"{mark}{texts.index(match.group())}{mark}"

        return cls(texts, mark, _map_strings(variables, lambda s: pattern.sub(swap, s)))

    def restored(self, text: str) -> str:
        """The rendered text as it would be without placeholders."""
        return self._marks.sub(lambda m: self.texts[int(m.group(1))], text)

    def pieces(self, text: str):
        """``(markup, literal)`` pairs in order; the last literal is None."""
        parts = self._marks.split(text)
        for i in range(0, len(parts), 2):
            yield parts[i], (self.texts[int(parts[i + 1])] if i + 1 < len(parts) else None)


@lru_cache(maxsize=16)
def _pattern(control: frozenset[str]) -> re.Pattern[str] | None:
    """One regex for any of the texts, longest first (as tokenizers match them)."""
    if not control:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(control, key=len, reverse=True)))


def _strings(value: Any):
    """Every string value inside ``value`` (not dict keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, change):
    """A copy of ``value`` with ``change`` applied to every string value (not to dict keys)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, change) for item in value]
    return value
