"""Incremental detokenizing with the embedded model's real tokenizers (llama.cpp's and tokenizers')."""

from __future__ import annotations

import pytest

from mesh_llm.engines.base import EngineOptions
from mesh_llm.runtime.detokenize import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n\n\tindent",
    "Café, naïve, Zürich, Ελληνικά, русский, 日本語のテキスト, 한국어.",
    "Emoji: 🚀🔥👩‍👩‍👧 and a flag 🇫🇷 in a row.",
    "  leading spaces and trailing   ",
    "<|im_start|>user\nHi<|im_end|>",
]


@pytest.fixture(scope="module", params=["llama", "hf"])
def tokenizer(request, default_gguf):
    if request.param == "llama":
        from mesh_llm.engines.llama.engine import LlamaEngine

        engine = LlamaEngine.load(default_gguf, EngineOptions(ctx_size=256))
        yield engine.tokenizer
        engine.close()
    else:
        from mesh_llm.engines.hf_tokenizer import HFTokenizer
        from mesh_llm.models import default_mlx_folder

        yield HFTokenizer.from_folder(default_mlx_folder())


def run(tokenizer, ids, stop=(), prompt=(1, 2, 3)):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), stop)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_decoded_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = run(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # no character is ever split across deltas


def test_byte_pieces_of_one_character_wait_for_the_rest(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE spells this emoji in several tokens
    deltas, _ = run(tokenizer, ids)
    assert deltas[:len(ids) - 1] == [""] * (len(ids) - 1)
    assert deltas[len(ids) - 1] == "🚀"


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("ab🚀", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas, _ = run(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_spanning_tokens_is_cut_and_never_leaks(tokenizer):
    text = "The answer is forty-two, and the question is unknown."
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = run(tokenizer, ids, stop=["two, and"])
    assert "".join(deltas) == "The answer is forty-"
    assert detok.stopped
    assert not any("two" in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    deltas, _ = run(tokenizer, ids, stop=["delta", "beta"])
    assert "".join(deltas) == "alpha "


def test_text_held_for_a_possible_stop_string_is_released(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    deltas, detok = run(tokenizer, ids, stop=["three four"])
    assert "".join(deltas) == "one two three" and not detok.stopped
    assert deltas[-1].endswith("three")  # held back until the end proved it was no stop string


def test_a_run_of_invalid_bytes_is_released_not_held_forever(tokenizer):
    # a lone UTF-8 continuation byte never completes a character: waiting for more would grow the
    # decode window (and its cost) with every such token
    lone = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")
    deltas, _ = run(tokenizer, [lone] * 40)
    released_before_flush = "".join(deltas[:-1])
    assert released_before_flush.count("\ufffd") >= 30
    assert "".join(deltas) == tokenizer.decode([lone] * 40)
