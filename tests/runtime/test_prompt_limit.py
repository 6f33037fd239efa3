"""A prompt that provably has more tokens than fit is refused before the tokenizer runs; one that
may fit is tokenized exactly as before."""

from __future__ import annotations

import pytest

from mesh_llm.runtime.chat import encode_chat
from mesh_llm.runtime.prompt_limit import PromptTooLong, encode_within


class Counting:
    """A tokenizer that says what it was asked: one token a character, ``<s>`` one token (a
    control token: in a chat message it is encoded by ``encode_plain``, three)."""

    chat_template = None
    bos_token = eos_token = None
    control_texts = frozenset({"<s>"})

    def __init__(self):
        self.encoded = 0

    def min_tokens(self, text: str) -> int:
        return text.count("<s>")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.encoded += 1
        return [0] * (len(text) - 2 * text.count("<s>"))

    def encode_plain(self, text: str) -> list[int]:
        self.encoded += 1
        return [0] * len(text)


def test_over_the_room_is_refused_without_tokenizing():
    tok = Counting()
    with pytest.raises(PromptTooLong) as caught:
        encode_within(tok, "<s>" * 11, False, room=10)
    assert (caught.value.at_least, caught.value.room, tok.encoded) == (11, 10, 0)


def test_within_the_room_or_without_one_is_tokenized():
    tok = Counting()
    assert encode_within(tok, "<s>" * 10, False, room=10) == [0] * 10
    assert encode_within(tok, "<s>" * 99, False, room=None) == [0] * 99
    assert tok.encoded == 2


def test_a_chat_over_the_room():
    tok = Counting()
    messages = [{"role": "user", "content": "<s>"}] * 20
    with pytest.raises(PromptTooLong):
        encode_chat(tok, messages, room=19)
    assert tok.encoded == 0 and encode_chat(tok, messages, room=20)
