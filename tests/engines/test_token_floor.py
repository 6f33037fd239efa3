"""The lower bound on a text's token count that lets the API refuse a prompt over the context without
tokenizing it: which special texts it counts (those nothing can take over), and that it never
exceeds the real count, on the Hugging Face tokenizers the MLX engine uses (llama.cpp's in
test_llama_tokenizer.py)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from gguf import GGUFReader

from mesh_llm.engines.hf_tokenizer import HFTokenizer
from mesh_llm.engines.token_floor import TokenFloor
from mesh_llm.models.gguf_tokenizer import build_tokenizer

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

PIECES = ["hello", " world", "\n", "\n\n", " ", "  ", "\t", "é", "e\u0301", "漢字", "😀", "\U00040000", "123",
          "<", ">", "|", "<|", "|>", "[", "]", "</", "x", "\x04", " <", "> ", "user", "\r\n"]


def test_counts_texts_nothing_can_take_over():
    floor = TokenFloor([b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>"])
    assert floor.atomic == {b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>"}
    assert floor.min_tokens(b"<|im_start|>user\nHi<|im_end|>\n" * 3) == 6
    assert floor.min_tokens(b"<|im_end" + b"|>") == 1 and floor.min_tokens(b"<|im_en|>") == 0


@pytest.mark.parametrize("specials,atomic", [
    ([b"<a>", b"<a>b"], {b"<a>b"}),  # a text inside a longer one: the longer may be split out instead
    ([b"xa", b"abcd"], set()),  # "xabcd": each overlaps the other
    ([b"aa", b"<x>"], {b"<x>"}),  # "aaa": a text that overlaps itself
    ([b" <y>", b"<z>\n", b"<w>"], {b"<w>"}),  # whitespace at an end, which a neighbour may strip
    ([b"<<", b"<x>"], set()),  # "<<x>": the end of one is the start of the other
    ([b"a\0b", b"<x>"], {b"<x>"}),
])
def test_texts_that_can_be_taken_over_are_not_counted(specials, atomic):
    assert TokenFloor(specials).atomic == atomic


def test_only_countable_texts_count_but_all_can_take_over():
    floor = TokenFloor([b"<s>", b"<t>", b"<s>x"], countable=[b"<s>", b"<t>"])
    assert floor.atomic == {b"<t>"}


def test_bytes_bound_leaves_out_bytes_that_may_be_dropped():
    floor = TokenFloor([b"<s>"], bytes_per_token=10, dropped=b"\x04")
    assert floor.min_tokens(b"a" * 95) == 10
    assert floor.min_tokens(b"a" * 95 + b"\x04" * 1000) == 10
    assert floor.min_tokens(b"<s>" * 20) == 20  # the larger of the two
    assert TokenFloor([]).min_tokens(b"a" * 10_000) == 0


def test_many_special_texts_one_pattern():
    specials = [b"<unused%d>" % i for i in range(6000)]
    specials += [b"<|reserved_special_token_%d|>" % i for i in range(250)]
    floor = TokenFloor(specials)
    assert len(floor.atomic) == 6250
    text = b"<unused1>x<unused5999><unused6000><|reserved_special_token_249|><|reserved_special_token_2"
    assert floor.min_tokens(text) == 3


def assert_bound_holds(tokenizer: HFTokenizer, texts: list[str]) -> None:
    for text in texts:
        assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text, False)), text


def random_texts(specials: list[str], seed: int, count: int = 200) -> list[str]:
    rnd = random.Random(seed)
    pieces = specials[:400] + PIECES * 3
    texts = ["".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 80))) for _ in range(count)]
    return texts + ["".join(specials) * 2, "\x04" * 5000, "a" * 5000, " " * 5000, "😀" * 2000, "7" * 3000]


def gguf_hf_tokenizer(path: Path) -> HFTokenizer:
    """The tokenizer the MLX engine builds for a GGUF (the embedded model is served that way)."""
    meta = {name: field.contents() for name, field in GGUFReader(path).fields.items()}
    text, config = build_tokenizer(meta)
    return HFTokenizer.from_json(text, config)


def added_texts(tokenizer: HFTokenizer) -> list[str]:
    from tokenizers import Tokenizer

    return [a.content for a in Tokenizer.from_str(tokenizer.to_json()).get_added_tokens_decoder().values()]


def test_the_embedded_model_as_mlx_serves_it(default_gguf):
    tokenizer = gguf_hf_tokenizer(default_gguf)
    assert tokenizer.min_tokens("<|im_start|>user\n<|im_end|>\n" * 1000) == 2000
    assert tokenizer.min_tokens("7" * 162_000) == 1000  # 162 bytes: the longest token
    assert tokenizer.min_tokens("\x04" * 162_000) == 0 == len(tokenizer.encode("\x04" * 162_000, False))
    assert_bound_holds(tokenizer, random_texts(added_texts(tokenizer), seed=0, count=400))


def test_a_normalizer_turns_the_bytes_bound_off():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|end|>"])
    plain = HFTokenizer(tok, {})
    # 7 bytes: <|end|>, the longest token
    assert 10_000 // 7 <= plain.min_tokens("a" * 10_000) <= len(plain.encode("a" * 10_000, False))
    tok.normalizer = normalizers.NFC()  # may shorten text ("e" + U+0301 becomes "é")
    assert HFTokenizer(tok, {}).min_tokens("a" * 10_000 + "<|end|>") == 1


@pytest.mark.slow  # gguf's reader takes seconds on a large vocab
@pytest.mark.parametrize("name", ["gpt-neox", "llama-bpe", "llama-spm", "phi-3", "qwen2", "starcoder"])
def test_llama_cpp_vocabs_converted_as_mlx_does(name):
    """Whitespace-only added tokens and bytes without a token (gpt-neox), hundreds of special tokens
    (llama-bpe, qwen2), SentencePiece with its normalizer (llama-spm, phi-3)."""
    folder = os.environ.get("MESH_LLM_GGUF_VOCABS")
    path = Path(folder or "/nonexistent") / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"set MESH_LLM_GGUF_VOCABS to a folder with ggml-vocab-{name}.gguf (make test does)")
    tokenizer = gguf_hf_tokenizer(path)
    assert_bound_holds(tokenizer, random_texts(added_texts(tokenizer), seed=len(name)))
