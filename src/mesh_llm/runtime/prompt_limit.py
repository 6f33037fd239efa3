"""Refusing a prompt that cannot fit the context before tokenizing it: the tokenizer's
``min_tokens`` (linear, nothing tokenized) against the room the request leaves, so that megabytes of
special tokens are a quick refusal rather than seconds to minutes of a core
(:mod:`mesh_llm.engines.token_floor` says why and how the bound holds)."""

from __future__ import annotations

from mesh_llm.engines.base import Tokenizer


class PromptTooLong(ValueError):
    """The prompt has at least ``at_least`` tokens, more than the ``room`` it may take."""

    def __init__(self, at_least: int, room: int):
        super().__init__(f"the prompt has at least {at_least} tokens, more than the {room} that fit")
        self.at_least, self.room = at_least, room


def encode_within(tokenizer: Tokenizer, text: str, add_special_tokens: bool, room: int | None) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens)``, or :class:`PromptTooLong` without tokenizing
    when ``text`` provably has more than ``room`` tokens (None: no limit)."""
    refuse_beyond(tokenizer, text, room)
    return tokenizer.encode(text, add_special_tokens)


def refuse_beyond(tokenizer: Tokenizer, text: str, room: int | None) -> None:
    """:class:`PromptTooLong` when ``text`` provably has more than ``room`` tokens (None: no limit)."""
    if room is not None and (at_least := tokenizer.min_tokens(text)) > room:
        raise PromptTooLong(at_least, room)
