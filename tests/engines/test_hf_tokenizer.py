"""The Hugging Face tokenizer the MLX engine serves with: the same ids as ``tokenizers`` itself, and
tokenizing without the GIL, so that a long prompt being read does not stop the worker's steps (on a
GPU the worker builds each step's graph in Python) or the event loop's streams."""

from __future__ import annotations

import threading

import pytest

from mesh_llm.engines.hf_tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from mesh_llm.models import default_mlx_folder

    return HFTokenizer.from_folder(default_mlx_folder())


@pytest.mark.parametrize("text", ["", "Hello, world!", "naïve café 東京 🙂",
                                  "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces and\ttabs\n\n",
                                  "x" * 5000])
@pytest.mark.parametrize("special", [False, True])
def test_ids_are_those_tokenizers_gives(tokenizer, text, special):
    expected = tokenizer._tok.encode(text, add_special_tokens=special).ids  # noqa: SLF001
    assert tokenizer.encode(text, special) == expected


def test_a_long_prompt_is_tokenized_without_the_gil(tokenizer):
    """A thread counting while another tokenizes 600 KB: with the GIL held throughout (``tokenizers``'
    own ``encode``), the counter barely moves; through ``HFTokenizer.encode`` it runs on. A ratio,
    so the machine's speed does not matter (measured here: 40x)."""
    text = "The quick brown fox jumps over the lazy dog; the compiler reads every token. " * 8000

    def counted_beside(encode) -> int:
        started, done, count = threading.Event(), threading.Event(), 0

        def run():
            started.set()
            encode(text)
            done.set()

        thread = threading.Thread(target=run)
        thread.start()
        started.wait()
        while not done.is_set():
            count += 1
        thread.join()
        return count

    held = counted_beside(lambda t: tokenizer._tok.encode(t, add_special_tokens=False))  # noqa: SLF001
    ours = counted_beside(lambda t: tokenizer.encode(t, False))
    assert ours > 8 * held, (ours, held)
