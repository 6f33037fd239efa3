"""llama.cpp's tokenizer as the engine calls it. A text with many special tokens is encoded in pieces
(llama.cpp splits at special tokens in time quadratic in their number), and the ids must be those of
one llama_tokenize call on the whole text: checked with the cut made before every cuttable special
token (the most cuts there can be), on the embedded model's chat template output and on every vocab
llama.cpp ships for its own tokenizer tests. ``min_tokens`` never exceeds the real count."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

ll = pytest.importorskip("llama_cpp.llama_cpp")

import mesh_llm.engines.llama.tokenizer as llama_tokenizer
from mesh_llm.engines.llama.tokenizer import LlamaTokenizer
from mesh_llm.runtime.chat import render_chat

VOCABS = ["aquila", "baichuan", "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon",
          "gemma-4", "gpt-2", "gpt-neox", "llama-bpe", "llama-spm", "mpt", "nomic-bert-moe", "phi-3", "qwen2",
          "qwen35", "refact", "starcoder"]
# pieces that sit next to special tokens in real prompts, and ones that could fool a splitter
PIECES = ["hello", " world", "\n", "\n\n", " ", "  ", "\t", "é", "漢字", "😀", "123", "<", ">", "|", "<|", "|>",
          "[", "]", "</", "x", "\x04", " <", "> ", "user", "assistant", "\r\n"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": ""}] * 3,
    [{"role": "user", "content": "  leading and trailing  \n"}, {"role": "assistant", "content": "\n"}],
    [{"role": "user", "content": "a <|im_end|> inside, <|im_start|>system\nand a <|im_ half"}],
    [{"role": "user", "content": "Ünïcödé 🙂 \x04 tabs\tand\r\nCRLF"}, {"role": "assistant", "content": "<|"}],
    [{"role": "user", "content": "<file_sep><repo_name><reponame><|endoftext|>"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}] * 300,  # cut at 256 too
]


def load(path: Path):
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    assert model, path
    return model


def one_call(model, text: str, add_special: bool) -> list[int]:
    """What llama_tokenize gives for the whole text in one call: the reference."""
    data = text.encode("utf-8")
    n = 2 * len(data) + 16
    out = (ll.llama_token * n)()
    got = ll.llama_tokenize(ll.llama_model_get_vocab(model), data, len(data), out, n, add_special, True)
    assert got >= 0
    return out[:got]


def special_texts(model) -> list[str]:
    vocab = ll.llama_model_get_vocab(model)
    attrs = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED | ll.LLAMA_TOKEN_ATTR_UNKNOWN
    ids = [t for t in range(ll.llama_vocab_n_tokens(vocab)) if ll.llama_vocab_get_attr(vocab, t) & attrs]
    return sorted({ll.llama_vocab_get_text(vocab, t).decode("utf-8", "replace") for t in ids})


def random_texts(specials: list[str], seed: int, count: int = 150) -> list[str]:
    rnd = random.Random(seed)
    pieces = specials[:400] + PIECES * 3
    return ["".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 80))) for _ in range(count)]


def assert_as_one_call(model, tokenizer: LlamaTokenizer, texts: list[str]) -> None:
    for text in texts:
        for add_special in (False, True):
            expected = one_call(model, text, add_special)
            assert tokenizer.encode(text, add_special) == expected, (text, add_special)
        assert tokenizer.min_tokens(text) <= len(one_call(model, text, False)), text


@pytest.fixture(scope="module")
def smollm(default_gguf):
    model = load(default_gguf)
    yield model, LlamaTokenizer(model)
    ll.llama_model_free(model)


@pytest.fixture
def cut_everywhere(monkeypatch):
    monkeypatch.setattr(llama_tokenizer, "CHUNK_SPECIALS", 1)


@pytest.mark.parametrize("cuts", ["default", "everywhere"])
def test_chat_prompts_are_encoded_as_one_call_would(smollm, cuts, monkeypatch):
    if cuts == "everywhere":
        monkeypatch.setattr(llama_tokenizer, "CHUNK_SPECIALS", 1)
    model, tokenizer = smollm
    texts = [render_chat(tokenizer, c, add_generation_prompt=g) for c in CONVERSATIONS for g in (True, False)]
    assert_as_one_call(model, tokenizer, texts)


def test_random_mixtures_are_encoded_as_one_call_would(smollm, cut_everywhere):
    model, tokenizer = smollm
    assert_as_one_call(model, tokenizer, random_texts(special_texts(model), seed=0, count=300))


def test_thousands_of_special_tokens_encode_in_pieces_with_the_same_ids(smollm):
    model, tokenizer = smollm
    text = render_chat(tokenizer, [{"role": "user", "content": ""}] * 5000)  # 10,000 special tokens
    ids = tokenizer.encode(text, False)
    assert ids == one_call(model, text, False)
    assert tokenizer.min_tokens(text) == 10_003  # each <|im_start|> and <|im_end|>, and the system turn's


def test_floor_counts_special_tokens_and_bytes(smollm):
    _, tokenizer = smollm
    ends = "<|im_end|>" * 1000
    assert tokenizer.min_tokens(ends) == 1000 == len(tokenizer.encode(ends, False))
    assert tokenizer.min_tokens("") == 0
    # 162 bytes is the vocab's longest token; six ASCII control characters have no token and are dropped
    assert tokenizer.min_tokens("7" * 162_000) == 1000
    assert tokenizer.min_tokens("\x04" * 162_000) == 0 == len(tokenizer.encode("\x04" * 162_000, False))


def vocab_path(name: str) -> Path:
    folder = os.environ.get("MESH_LLM_GGUF_VOCABS")
    path = Path(folder or "/nonexistent") / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"set MESH_LLM_GGUF_VOCABS to a folder with ggml-vocab-{name}.gguf (make test does)")
    return path


@pytest.mark.parametrize("name", VOCABS)
def test_every_llama_cpp_vocab_encodes_as_one_call_would(name, cut_everywhere):
    """SPM (space prefix after special tokens), BPE of every pre-tokenizer, WPM and UGM (never cut),
    phi-3 (its special tokens strip the whitespace after them), whitespace-only user-defined tokens."""
    path = vocab_path(name)
    model = load(path)
    try:
        tokenizer = LlamaTokenizer(model)
        inputs = path.with_name(path.name + ".inp")
        texts = inputs.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inputs.exists() else []
        specials = special_texts(model)
        texts += random_texts(specials, seed=len(name))
        texts += [" ".join(specials), "\n".join(specials) + "\n", "".join(specials) * 3]
        assert_as_one_call(model, tokenizer, texts)
    finally:
        ll.llama_model_free(model)


def test_a_token_that_eats_the_whitespace_before_it_is_not_cut_before(tmp_path, cut_everywhere):
    """llama.cpp gives jina-v2's <mask> left-strip (the whitespace before it is dropped); the text
    may not be cut just before it, or that whitespace would be tokenized. gpt-2's vocab is rewritten
    with that pre-tokenizer and a <mask> token, the one such case among BPE and SPM vocabs."""
    from gguf import GGUFReader, GGUFWriter

    source = GGUFReader(vocab_path("gpt-2"))
    path = tmp_path / "ggml-vocab-jina-mask.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    added = {"<mask>": 3, "<|sep|>": 3}
    for name, field in source.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "tokenizer.ggml.pre":
            value = "jina-v2-code"
        elif name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value += list(added) if name.endswith("tokens") else list(added.values())
        writer.add_key_value(name, value, field.types[0], field.types[1] if len(field.types) > 1 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = load(path)
    try:
        tokenizer = LlamaTokenizer(model)
        assert one_call(model, "a  <mask>", False) == one_call(model, "a<mask>", False)  # it does strip
        texts = ["a  <mask>", "x <|sep|>  <mask> y\n<mask>", " <mask>" * 20, "<|sep|> \t<mask>" * 10]
        assert_as_one_call(model, tokenizer, texts + random_texts(list(added), seed=7))
    finally:
        ll.llama_model_free(model)
