"""The MLX engine decoding many sequences together (add / step / remove), against each sequence alone.

The embedded SmolLM2 (its imported MLX folder, float32 on this CPU): eight sequences with different
prompts, lengths, sampling settings and start steps; sequences removed mid-prefill and mid-decode;
per-row constraints; admission. Tiny random models from mlx-lm's own classes cover the other layer
caches: sliding windows (gemma3), recurrent state (mamba), a conv + attention hybrid (lfm2), and
chunked attention (llama4), which mlx-lm cannot batch.

Alone and batched differ only by rounding: a decode step multiplies an (8, d) matrix instead of a
(1, d) one, and rows shorter than the batch's longest are left-padded and masked. Measured on this
CPU: logprobs within 3e-5 of the solo run's; the tolerance below is 1e-3.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace

import pytest

from mesh_llm.engines import engine_class, is_installed
from mesh_llm.engines.base import EngineError, EngineOptions, NoCapacity, SamplingParams

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

if not is_installed("mlx"):  # checked without importing mlx.core, which must come after the BLAS fix
    pytest.skip("the mlx extra is not installed", allow_module_level=True)

MLXEngine = engine_class("mlx")  # imports mlx.core after the BLAS fix

from batch_runs import AllowOnly, Case, Forced, compare, run_alone, run_batched
from random_mlx import random_model

from mesh_llm.engines.hf_tokenizer import HFTokenizer
from mesh_llm.runtime.chat import encode_chat

TOLERANCE = 1e-3
CONTEXT = 1024
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for learning a new language.",
    "What does a compiler do? Keep it brief.",
    "Describe how to make a cup of tea, step by step.",
    "Write a haiku about autumn.",
    "Explain photosynthesis to a child.",
    "List five prime numbers.",
    "Why is the sky blue?",
]
DOCUMENT = ("MLX is an array framework for machine learning research. Arrays live in shared memory and "
            "operations run lazily: a graph is built and computed only when a result is needed. ") * 4


def greedy(logprobs=5, constraint=None):
    return lambda: SamplingParams(temperature=0, logprobs=logprobs, constraint=constraint)


def seeded(seed, logprobs=0, **filters):
    return lambda: SamplingParams(temperature=0.8, seed=seed, logprobs=logprobs, **filters)


@pytest.fixture(scope="module")
def smollm():
    """SmolLM2 with the prompt cache off (so that solo runs recompute everything), prefill in
    32-token chunks."""
    from mesh_llm.models import default_mlx_folder

    engine = MLXEngine.load(default_mlx_folder(), EngineOptions(ctx_size=CONTEXT, prefill_step=32,
                                                                cache_bytes=0))
    yield engine
    engine.close()


def sibling(engine, pipelined=None, together=None, model=None, bucket=0, keep_slots=None,
            prefill_step=32, context=CONTEXT, **options):
    """Another engine on the same weights, with other options. ``pipelined``: queue each step before
    reading the last, ``together``: read chunks that start at the same position in one pass,
    ``keep_slots``: rows that leave the decode batch leave their slots (the defaults on a GPU), and
    ``bucket``: prompt chunks padded and their keys read in steps (mlx_attention), to check those
    paths on this CPU;
    chunks of ``prefill_step`` tokens; a ``context`` of that many positions."""
    if bucket:
        from mesh_llm.engines.mlx.kernels import attention as mlx_attention

        assert mlx_attention.install(engine._model, in_steps=True)
    return MLXEngine(model or engine._model, engine.tokenizer, {}, context,
                     EngineOptions(prefill_step=prefill_step, **options), {}, "safetensors",
                     pipelined=pipelined, together=together, bucket=bucket,
                     keep_slots=keep_slots)


class CountingModel:
    """A model that records the rows and width of every pass over more than one position (prompt
    chunks), and the rows of every decode step."""

    def __init__(self, model):
        self.model, self.chunk_rows, self.chunk_widths, self.decode_rows = model, [], [], []

    def __call__(self, inputs, cache=None):
        if inputs.shape[1] > 1:
            self.chunk_rows.append(inputs.shape[0])
            self.chunk_widths.append(inputs.shape[1])
        else:
            self.decode_rows.append(inputs.shape[0])
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def chat(engine, question, document=""):
    content = f"{document}\n\n{question}" if document else question
    return encode_chat(engine.tokenizer, [{"role": "user", "content": content}])


def eight_cases(engine) -> list[Case]:
    prompts = [chat(engine, q, DOCUMENT if i in (2, 5) else "") for i, q in enumerate(QUESTIONS)]
    params = [greedy(), seeded(1), greedy(), seeded(2, top_k=20), greedy(logprobs=None),
              seeded(3, logprobs=3, top_p=0.9), seeded(4, min_p=0.1), greedy(logprobs=2)]
    lengths = [12, 16, 9, 14, 11, 16, 13, 10]
    starts = [0, 0, 1, 3, 3, 4, 7, 9]
    return [Case(p, m, n, s) for p, m, n, s in zip(prompts, params, lengths, starts)]


def agree_with_solo(cases: list[Case], alone, batched) -> list:
    """Each batched sequence against its solo run: greedy tokens equal where no logprobs are
    reported, logprobs within TOLERANCE, seeded rows never diverging, no prompt reuse. Returns the
    (index, comparison) of the greedy rows that part at a near-tie."""
    differ = []
    for i, case in enumerate(cases):
        assert [s.cached_tokens for s in batched[i]] == [0] * case.tokens
        params = case.params()
        if params.logprobs is None:  # no logprobs to compare: the greedy tokens must agree
            assert [s.token for s in batched[i]] == [s.token for s in alone[i]]
            continue
        result = compare(alone[i], batched[i], TOLERANCE)
        if params.temperature > 0:  # a seeded row draws the same noise alone and batched
            assert result.diverged_at is None
        if result.diverged_at is not None:
            differ.append((i, result))
        assert all(len(s.top_logprobs) == (params.logprobs or 0) for s in batched[i])
    return differ


def same_as_alone(cases: list[Case], alone, batched) -> None:
    """Each batched sequence exactly as its solo run: greedy tokens equal where no logprobs are
    reported, else logprobs within TOLERANCE and no token parting, not even at a near-tie."""
    for i, case in enumerate(cases):
        if case.params().logprobs is None:
            assert [s.token for s in batched[i]] == [s.token for s in alone[i]], i
        else:
            assert compare(alone[i], batched[i], TOLERANCE).diverged_at is None, i


def test_eight_sequences_match_their_solo_runs(smollm):
    cases = eight_cases(smollm)
    assert len({len(c.prompt) for c in cases}) >= 6 and max(len(c.prompt) for c in cases) > 150
    alone = [run_alone(smollm, c) for c in cases]
    differ = agree_with_solo(cases, alone, run_batched(smollm, cases, budget=64))
    print(f"\n{len(differ)} of 8 sequences diverge from their solo runs: {differ}")
    assert smollm.cache_stats()["entries"] == 0


@pytest.mark.parametrize("pipelined", [False, True], ids=["read-each-step", "pipelined"])
def test_chunks_read_together_match_their_solo_runs(smollm, pipelined):
    """Prompt chunks that start at the same position read in one pass, shorter ones right-padded
    (the GPU default): five sequences arrive at once, three later; each of the eight answers as it
    does alone, and the five read their chunks in passes of five rows."""
    model = CountingModel(smollm._model)
    engine = sibling(smollm, pipelined, together=True, model=model, cache_bytes=0)
    cases = [replace(c, start=0 if i < 5 else c.start) for i, c in enumerate(eight_cases(engine))]
    alone = [run_alone(smollm, c) for c in cases]
    batched = run_batched(engine, cases, budget=4096)
    assert max(model.chunk_rows) == 5, model.chunk_rows
    same_as_alone(cases, alone, batched)


def test_a_seeded_sequence_samples_the_same_alone_and_in_a_batch(smollm):
    prompt = chat(smollm, QUESTIONS[1])
    case = Case(prompt, seeded(7), 16)
    others = [Case(chat(smollm, q), seeded(100 + i), 16) for i, q in enumerate(QUESTIONS[2:5])]
    alone = [s.token for s in run_alone(smollm, case)]
    batched = run_batched(smollm, [*others, case], budget=4096)
    assert [s.token for s in batched[3]] == alone
    other_seed = Case(prompt, seeded(8), 16)
    assert [s.token for s in run_alone(smollm, other_seed)] != alone


def test_a_newcomers_first_token_comes_from_the_step_that_read_its_prompt(smollm):
    """Pipelined (a GPU's default), a step returns the tokens of the pass queued at the step before,
    except a newcomer's first token: the step that reads the end of its prompt reads it too, so that
    its time to first token does not include the next step's build. A newcomer that joins running
    streams brings their pending tokens with it; every token is the solo run's."""
    engine = sibling(smollm, pipelined=True, cache_bytes=0, prefill_step=512)  # a prompt a step
    first, second = Case(chat(smollm, QUESTIONS[0]), greedy(None), 6), Case(chat(smollm, QUESTIONS[6]),
                                                                           greedy(None), 4)
    alone = [[s.token for s in run_alone(smollm, c)] for c in (first, second)]
    engine.add(0, first.prompt, first.params(), first.tokens)
    assert [(seq, s.token) for seq, s in engine.step(4096)] == [(0, alone[0][0])]
    assert engine.step(4096) == []  # the pass queued now is read at the next step
    assert [(seq, s.token) for seq, s in engine.step(4096)] == [(0, alone[0][1])]
    engine.add(1, second.prompt, second.params(), second.tokens)
    out = [(seq, s.token) for seq, s in engine.step(4096)]
    assert out == [(0, alone[0][2]), (0, alone[0][3]), (1, alone[1][0])]
    tokens = {0: alone[0][:4], 1: alone[1][:1]}
    while len(tokens[0]) < first.tokens or len(tokens[1]) < second.tokens:
        for seq, s in engine.step(4096):
            tokens[seq].append(s.token)
    assert [tokens[0][:first.tokens], tokens[1][:second.tokens]] == alone
    engine.remove(0)
    engine.remove(1)


@pytest.mark.parametrize("pipelined", [False, True], ids=["read-each-step", "pipelined"])
def test_removing_one_mid_prefill_and_one_mid_decode_leaves_the_others_unchanged(smollm, pipelined):
    engine = sibling(smollm, pipelined, cache_bytes=0)
    cases = [Case(chat(smollm, QUESTIONS[0]), greedy(), 14),
             Case(chat(smollm, QUESTIONS[3]), greedy(), 14),  # removed after 4 decode steps
             Case(chat(smollm, QUESTIONS[4], DOCUMENT), greedy(), 14, start=2),  # removed mid-prefill
             Case(chat(smollm, QUESTIONS[6]), seeded(5, logprobs=2), 14, start=1)]
    alone = {i: run_alone(smollm, cases[i]) for i in (0, 3)}
    # Budget 32: the document's prompt (> 150 tokens) is still being read 3 steps after it came.
    batched = run_batched(engine, cases, budget=32, leave={1: 6, 2: 3})
    assert len(batched[2]) == 0 and 0 < len(batched[1]) < 14
    assert compare(alone[3], batched[3], TOLERANCE).diverged_at is None  # seeded: the same draws
    compare(alone[0], batched[0], TOLERANCE)  # greedy: the same tokens, or a near-tie


@pytest.mark.parametrize("pipelined", [False, True], ids=["read-each-step", "pipelined"])
def test_constraints_are_obeyed_per_row_and_leave_the_other_rows_alone(smollm, pipelined):
    """A constrained row's mask depends on its previous token: pipelined, the batch's next forward
    pass is queued before that token is read, and the constrained rows are sampled after it."""
    engine = sibling(smollm, pipelined, cache_bytes=0)
    vocab = smollm.tokenizer.vocab_size
    digits = [smollm.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    words = smollm.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    forced = smollm.tokenizer.encode(" one two three four five six", add_special_tokens=False)
    free = [Case(chat(smollm, QUESTIONS[i]), greedy(), 10) for i in (0, 6)]
    free.append(Case(chat(smollm, QUESTIONS[7]), seeded(9, logprobs=1), 10))
    alone = [run_alone(smollm, c) for c in free]
    constraints = [AllowOnly(digits, vocab), AllowOnly(words, vocab), Forced(forced, vocab)]
    constrained = [Case(chat(smollm, QUESTIONS[6]), greedy(constraint=constraints[0]), 10),
                   Case(chat(smollm, QUESTIONS[1]), seeded(11, constraint=constraints[1]), 10, start=1),
                   Case(chat(smollm, QUESTIONS[2]), seeded(12, constraint=constraints[2]), 10, start=2)]
    cases = [free[0], *constrained, *free[1:]]
    batched = run_batched(engine, cases, budget=4096, params=[c.params() for c in cases])
    got = [[s.token for s in batched[i]] for i in range(1, 4)]
    assert set(got[0]) <= set(digits) and set(got[1]) <= set(words)
    assert got[2] == (forced * 2)[:10]
    for tokens, constraint in zip(got, constraints):
        assert constraint.seen == tokens  # told of every token, in order
    for i, j in ((0, 0), (4, 1), (5, 2)):
        assert compare(alone[j], batched[i], TOLERANCE).diverged_at is None


def test_admission_stops_at_max_batch_and_at_the_memory_the_kv_needs(smollm):
    engine = sibling(smollm, max_batch=3, cache_bytes=0)
    assert engine.max_batch == 3 and engine.info().details["max_batch"] == "3"
    prompt = chat(engine, QUESTIONS[0])
    for seq in range(3):
        engine.add(seq, prompt, SamplingParams(temperature=0), 4)
    with pytest.raises(NoCapacity):
        engine.add(3, prompt, SamplingParams(temperature=0), 4)
    with pytest.raises(ValueError):
        engine.add(1, prompt, SamplingParams(temperature=0), 4)  # an id already held
    engine.remove(1)
    engine.add(3, prompt, SamplingParams(temperature=0), 4)
    with pytest.raises(EngineError):
        engine.score(prompt)  # only while no sequence is held
    for seq in (0, 2, 3):
        engine.remove(seq)
    assert engine.score(prompt).shape == (len(prompt), engine.tokenizer.vocab_size)
    # A context of 4M tokens: SmolLM2's float32 KV (46 KB a token) for one full sequence is more
    # memory than this machine (or an H200) has. By default the context shrinks to what one
    # sequence's KV, reserved twice, fits; asked for with ctx_size, it stands, and a sequence that
    # would need more than the engine's memory is refused.
    default = MLXEngine(smollm._model, smollm.tokenizer, {}, 4_000_000, EngineOptions(), {}, "safetensors")
    n_ctx = default.info().context_length
    assert n_ctx < 4_000_000
    # One whole context fills the engine's memory, yet the batch is sized for typical sequences,
    # and a sequence is reserved room for its prompt and ANSWER_HEADROOM tokens, not for all it may
    # answer: one that may fill the context (no max_tokens) decodes beside others.
    assert default.max_batch > 2
    for seq in (0, 1):
        default.add(seq, prompt, SamplingParams(temperature=0), 100)
    default.add(2, prompt, SamplingParams(temperature=0), n_ctx - len(prompt))
    assert {seq for seq, _ in default.step(64)} | {seq for seq, _ in default.step(64)} == {0, 1, 2}
    for seq in (0, 1, 2):
        default.remove(seq)
    huge = MLXEngine(smollm._model, smollm.tokenizer, {}, 4_000_000,
                     EngineOptions(max_batch=4, ctx_size=4_000_000), {}, "safetensors")
    assert huge.info().context_length == 4_000_000
    with pytest.raises(EngineError, match="KV"):  # it would not fit even alone
        huge.add(0, prompt, SamplingParams(temperature=0), 3_999_000)
    huge.add(0, prompt, SamplingParams(temperature=0), 100)
    with pytest.raises(EngineError, match="KV"):
        huge.add(1, prompt, SamplingParams(temperature=0), 3_999_000)


def preempting(smollm, monkeypatch, rows: int, max_batch: int = 3, **options):
    """An engine whose KV memory holds ``rows`` sequences of 256 tokens (one growth step of the KV
    buffers), counted twice as the engine counts it, and that gives a newcomer room for 8 answer
    tokens: three ~240-token prompts start together and outgrow it within 16 tokens. Its context
    is what the memory holds for one sequence."""
    from mesh_llm.engines.mlx.cache import Footprint

    monkeypatch.setattr(sys.modules[MLXEngine.__module__], "ANSWER_HEADROOM", 8)
    kv = 2 * Footprint.measure(smollm._model).bytes(256)
    return sibling(smollm, kv_bytes=rows * kv + kv // 2, max_batch=max_batch, **options)


@pytest.mark.parametrize("pipelined,keep_slots,cache_bytes",
                         [(False, False, 0), (True, False, 1 << 30), (True, True, 0)],
                         ids=["read-each-step-recomputed", "pipelined-restored", "slots-kept-recomputed"])
def test_sequences_that_outgrow_the_memory_are_preempted_and_answer_as_alone(smollm, monkeypatch,
                                                                            pipelined, keep_slots,
                                                                            cache_bytes):
    """Three sequences admitted on their prompts' room, none bounded by max_tokens, outgrow the KV
    memory: the newest are preempted (their state to the prompt cache, or dropped), resume when
    the oldest ends, and read again what they held, their in-flight token, PRNG key and constraint
    kept. Each answers as it does alone: greedy and seeded rows within TOLERANCE, the constrained
    row's tokens all allowed and seen once each."""
    engine = preempting(smollm, monkeypatch, 3, pipelined=pipelined, keep_slots=keep_slots,
                        cache_bytes=cache_bytes)
    rng = random.Random(7)
    vocab = engine.tokenizer.vocab_size
    digits = [smollm.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    params = [greedy(), seeded(3, logprobs=2), lambda: SamplingParams(temperature=0.7, seed=4,
                                                                      constraint=AllowOnly(digits, vocab))]
    cases = [Case([rng.randrange(vocab) for _ in range(n)], p, 24) for n, p in zip((236, 240, 244), params)]
    sent = [c.params() for c in cases]
    context = engine.info().context_length
    unbounded = {i: context - len(c.prompt) for i, c in enumerate(cases)}  # no max_tokens
    steps: dict[int, list] = {i: [] for i in range(3)}
    for i, case in enumerate(cases):
        engine.add(i, case.prompt, sent[i], unbounded[i])
    preempted_at = None
    while any(len(steps[i]) < 24 for i in range(3)):
        for seq, step in engine.step(4096):
            steps[seq].append(step)
            if len(steps[seq]) == 24:
                engine.remove(seq)
        if preempted_at is None and engine.cache_stats()["kv_preemptions"]:
            preempted_at = sorted(len(v) for v in steps.values())
    stats = engine.cache_stats()
    assert stats["kv_preemptions"] >= 2 and preempted_at[-1] < 24  # mid-answer
    if cache_bytes:  # read again from its stored state
        assert stats["tokens_reused"] > 0
    for i in range(2):
        assert compare(run_alone(smollm, cases[i]), steps[i], TOLERANCE).diverged_at is None or i == 0
    tokens = [s.token for s in steps[2]]
    assert tokens == [s.token for s in run_alone(smollm, cases[2])]  # a fresh constraint of its own
    assert set(tokens) <= set(digits) and sent[2].constraint.seen == tokens
    assert not engine._seqs and not len(engine.scheduler)  # noqa: SLF001 - every sequence left
    engine.close()


def test_slots_rows_left_are_cut_out_for_a_newcomer_that_would_not_fit_beside_them(smollm, monkeypatch):
    """Five short rows decode with slots kept; two leave, their slots kept vacant. A newcomer twice
    as long would need five rows of its length beside them, more than the memory (eight 256-token
    sequences); without the vacant slots, four fit, and it is admitted at once."""
    engine = preempting(smollm, monkeypatch, 8, max_batch=6, pipelined=True, keep_slots=True, cache_bytes=0)
    rng = random.Random(5)
    vocab = engine.tokenizer.vocab_size
    for seq in range(5):
        engine.add(seq, [rng.randrange(vocab) for _ in range(20)], SamplingParams(temperature=0), 40)
    while len({seq for seq, _ in engine.step(4096)}) < 5:
        pass
    engine.remove(1)
    engine.remove(3)
    engine.add(5, [rng.randrange(vocab) for _ in range(300)], SamplingParams(temperature=0), 8)
    out = [seq for _ in range(16) for seq, _ in engine.step(4096)]
    assert 5 in out and engine.cache_stats()["kv_preemptions"] == 0
    engine.close()


def test_preempted_sequences_resume_before_newcomers_are_admitted(smollm, monkeypatch):
    """While a preempted sequence waits for room, a newcomer is told NoCapacity (it waits in the
    worker's queue behind it), so preemption never starves a sequence."""
    engine = preempting(smollm, monkeypatch, 2)
    rng = random.Random(3)
    vocab = engine.tokenizer.vocab_size
    for seq, n in enumerate((244, 240)):
        engine.add(seq, [rng.randrange(vocab) for _ in range(n)], SamplingParams(temperature=0), 500)
    while not engine.cache_stats()["kv_preemptions"]:
        engine.step(4096)
    with pytest.raises(NoCapacity, match="preempted"):
        engine.add(2, [1, 2, 3], SamplingParams(temperature=0), 4)
    engine.remove(0)
    out = [seq for _ in range(12) for seq, _ in engine.step(4096)]  # it reads ~260 tokens, 32 a step
    assert out and set(out) == {1}  # resumed, not stuck
    with pytest.raises(NoCapacity, match="KV"):  # now only the memory it holds stands in the way
        engine.add(2, [1, 2, 3], SamplingParams(temperature=0), 4)
    engine.remove(1)
    engine.add(2, [1, 2, 3], SamplingParams(temperature=0), 4)
    engine.close()


def test_the_prompt_cache_yields_memory_to_live_sequences(smollm):
    engine = sibling(smollm, cache_bytes=1 << 50)  # as large as the engine's memory allows
    idle = engine.cache_stats()["max_bytes"]
    assert idle < 1 << 50
    engine.add(0, chat(engine, QUESTIONS[0]), SamplingParams(temperature=0), CONTEXT - 100)
    busy = engine.cache_stats()["max_bytes"]
    assert busy < idle
    engine.remove(0)
    assert engine.cache_stats()["max_bytes"] == idle


@pytest.mark.parametrize("together", [False, True], ids=["one-pass-each", "together"])
def test_sequences_resume_from_stored_and_live_states(smollm, together):
    """One document, four questions arriving together: the first reads the document, the others
    wait for it and copy its state; a later one resumes from a running sequence; each answers as it
    does alone."""
    engine = sibling(smollm, together=together, cache_bytes=1 << 30)
    cases = [Case(chat(engine, q, DOCUMENT), greedy(), 8) for q in QUESTIONS[:4]]
    shared = min(common(cases[0].prompt, c.prompt) for c in cases[1:])
    assert shared > 150
    alone = [run_alone(smollm, c) for c in cases]
    batched = run_batched(engine, cases, budget=64)
    assert batched[0][0].cached_tokens == 0
    assert all(batched[i][0].cached_tokens >= shared for i in (1, 2, 3))
    for i in range(4):
        assert compare(alone[i], batched[i], TOLERANCE).diverged_at is None
    # A running sequence shares more with the next prompt than any stored state does.
    first = Case(chat(engine, QUESTIONS[5], DOCUMENT), greedy(), 12)
    follow = Case(first.prompt, greedy(), 6, start=4)  # the same request again, while it runs
    batched = run_batched(engine, [first, follow], budget=4096)
    assert batched[1][0].cached_tokens == len(follow.prompt) - 1
    assert compare(run_alone(smollm, follow), batched[1], TOLERANCE).diverged_at is None
    stats = engine.cache_stats()
    assert stats["hits"] >= 4 and stats["entries"] >= 1


def test_newcomers_sharing_only_a_short_prefix_start_together_from_position_0(smollm):
    """Reading together (the GPU default), prompts that share fewer than TOGETHER_MIN_REUSE tokens
    with a stored state (here the chat template's opening and a first word, a different count for
    each) reuse nothing: all start at position 0 and their first chunks are read in one pass, where
    reusing would have given them different start positions and a pass each. Each answers as alone."""
    from mesh_llm.engines.mlx.engine import TOGETHER_MIN_REUSE

    model = CountingModel(smollm._model)
    engine = sibling(smollm, together=True, model=model, cache_bytes=1 << 30)
    first = Case(chat(engine, QUESTIONS[0]), greedy(), 4)
    run_batched(engine, [first], budget=4096)  # its state is stored in the prompt cache
    cases = [Case(chat(engine, q), greedy(logprobs=None), 6) for q in QUESTIONS[1:5]]
    shared = {common(first.prompt, c.prompt) for c in cases}
    assert len(shared) > 1 and 0 < min(shared) and max(shared) < min(TOGETHER_MIN_REUSE, 32)  # 32: its chunk
    model.chunk_rows.clear()
    batched = run_batched(engine, cases, budget=4096)
    assert all(s.cached_tokens == 0 for i in range(len(cases)) for s in batched[i])
    assert model.chunk_rows[0] == len(cases), model.chunk_rows
    same_as_alone(cases, [run_alone(smollm, c) for c in cases], batched)


def common(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- other kinds of layer cache: tiny random models from mlx-lm's own classes --------------------

KINDS = {
    "gemma3": {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64,
               "num_hidden_layers": 4, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
               "sliding_window": 8, "sliding_window_pattern": 2, "max_position_embeddings": 256},
    "mamba": {"model_type": "mamba", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
              "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
              "use_conv_bias": True, "time_step_rank": 8},
    "lfm2": {"model_type": "lfm2", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
             "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "block_ff_dim": 96, "full_attn_idxs": [1]},
    "llama4": {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 96, "intermediate_size_mlp": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
        "attention_chunk_size": 8, "interleave_moe_layer_step": 2, "num_local_experts": 2,
        "num_experts_per_tok": 1, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0,
        "use_qk_norm": True, "max_position_embeddings": 256}},
}


@pytest.fixture(scope="module")
def tiny_models(checkpoints):
    tokenizer = HFTokenizer.from_folder(checkpoints["llama"].path)
    built = {}
    for kind, config in KINDS.items():
        built[kind] = (random_model(kind, config), tokenizer, config)
    return built


@pytest.mark.parametrize("pipelined", [False, True], ids=["read-each-step", "pipelined"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_other_layer_caches_serve_several_sequences(tiny_models, kind, pipelined):
    """Sliding windows that wrap, recurrent and hybrid state batch; llama4's chunked attention
    cannot, so its sequences take one forward pass each, beside one another: bit for bit as alone."""
    model, tokenizer, config = tiny_models[kind]
    engine = MLXEngine(model, tokenizer, config, 256, EngineOptions(prefill_step=4, cache_bytes=0), {},
                       "safetensors", pipelined=pipelined)
    batches = "cannot batch" not in engine.info().details["batching"]
    assert batches == (kind != "llama4")
    rng = random.Random(kind)
    cases = [Case([rng.randrange(3, 320) for _ in range(n)], greedy(), 20, start)
             for n, start in ((5, 0), (23, 0), (11, 2), (30, 5))]
    cases[1].params = seeded(3, logprobs=2)
    alone = [run_alone(engine, c) for c in cases]
    batched = run_batched(engine, cases, budget=8, leave={3: 12})
    for i in range(3):
        if batches:
            assert compare(alone[i], batched[i], TOLERANCE).diverged_at is None
        else:
            assert batched[i] == alone[i]
    assert 0 < len(batched[3]) < 20


def test_a_bad_constraint_mask_ends_the_sequence_instead(smollm):
    """A mask that allows nothing gives the end-of-sequence token, not a token it forbids."""
    vocab = smollm.tokenizer.vocab_size
    nothing = AllowOnly([], vocab)
    steps = run_alone(smollm, Case(chat(smollm, QUESTIONS[0]), greedy(constraint=nothing), 2))
    assert {s.token for s in steps} <= set(smollm.tokenizer.eos_token_ids)


def test_prompts_read_in_one_pass_join_the_decode_group_from_its_batch(smollm, monkeypatch):
    """Four newcomers read together join the decode group straight from the batch they were read in
    (no merge), and four more joining the running four add one extend a layer (merging each row's
    copy back cost two small ops a row and layer; joined one at a time, each join copied the whole
    batch again); every sequence answers as it does alone."""
    from mlx_lm.models.cache import BatchKVCache

    engine = sibling(smollm, together=True, max_batch=8)
    vocab = engine.tokenizer.vocab_size
    cases = [Case([(7 * i + 13 * j) % vocab for j in range(40)], greedy(), 6, 0 if i < 4 else 3)
             for i in range(8)]
    alone = [run_alone(smollm, c) for c in cases]
    calls = {"merge": 0, "extend": 0}
    merge, extend = BatchKVCache.merge.__func__, BatchKVCache.extend

    def counted_merge(cls, caches):
        calls["merge"] += 1
        return merge(cls, caches)

    def counted_extend(self, other):
        calls["extend"] += 1
        return extend(self, other)

    monkeypatch.setattr(BatchKVCache, "merge", classmethod(counted_merge))
    monkeypatch.setattr(BatchKVCache, "extend", counted_extend)
    batched = run_batched(engine, cases, budget=4096)
    layers = len(engine._model.layers)
    assert calls == {"merge": 0, "extend": layers}
    assert all([s.token for s in batched[i]] == [s.token for s in alone[i]] for i in range(8))
    engine.close()


def test_rows_read_together_stay_one_batch_through_chunks_joins_and_a_leave(smollm):
    """Six newcomers read together (the GPU default), whose prompts end after one, two and three
    chunks: rows that go on are read from the last pass's batch (some of its rows: a gather), rows
    that end join the decode group from it right-aligned, and one removed mid-prompt leaves its own
    copy to the prompt cache, which a later prompt resumes from. Each answers as it does alone."""
    model = CountingModel(smollm._model)
    engine = sibling(smollm, together=True, model=model, cache_bytes=1 << 30, max_batch=8)
    vocab = engine.tokenizer.vocab_size
    cases = [Case([(7 * i + 13 * j + 3) % vocab for j in range(n)], greedy(), 5)
             for i, n in enumerate([20, 50, 70, 40, 90, 75])]
    later = Case(cases[4].prompt[:80] + [11, 12, 13], greedy(), 5, start=4)
    batched = run_batched(engine, [*cases, later], budget=4096, leave={4: 2})
    assert model.chunk_rows[:3] == [6, 5, 2], model.chunk_rows  # chunks of 32 tokens
    assert len(batched[4]) == 0 and batched[6][0].cached_tokens == 64
    kept = [c for i, c in enumerate([*cases, later]) if i != 4]
    same_as_alone(kept, [run_alone(smollm, c) for c in kept], [batched[i] for i in (0, 1, 2, 3, 5, 6)])
    engine.close()


def test_rows_that_leave_keep_their_slots_for_newcomers_until_half_are_empty(smollm):
    """The GPU's default. Six rows decode; two leave and the batch keeps its six slots; two
    newcomers shorter than the batch fill them in place, a longer one is appended (7); a row that
    leaves gives its slot to a newcomer resuming from the prefix the first row to leave left to the
    prompt cache; the
    longest row leaving lets the batch shrink (6), and then it shrinks only once half its slots are
    empty (3, 1). Each sequence answers as it does alone."""
    model = CountingModel(smollm._model)
    engine = sibling(smollm, pipelined=True, together=True, keep_slots=True, model=model,
                     cache_bytes=1 << 30, max_batch=8)
    del model.decode_rows[:]  # the engine's one-token measure of its KV footprint
    vocab = engine.tokenizer.vocab_size
    cases = [Case([(7 * i + 13 * j + 3) % vocab for j in range(60)], greedy(), n)
             for i, n in enumerate([4, 6, 26, 28, 30, 34])]
    cases += [Case([(5 * i + 11 * j) % vocab for j in range(20)], greedy(), n, start=9)
              for i, n in enumerate([3, 12])]
    cases.append(Case([(3 * j + 1) % vocab for j in range(120)], greedy(), 6, start=9))
    cases.append(Case(cases[0].prompt + [4, 5, 6], greedy(), 6, start=14))  # resumes from row 0's state
    batched = run_batched(engine, cases, budget=4096)
    same_as_alone(cases, [run_alone(smollm, c) for c in cases], [batched[i] for i in range(len(cases))])
    assert batched[9][0].cached_tokens == 60  # all it shares with row 0, whose slot was kept
    sizes = [n for k, n in enumerate(model.decode_rows) if k == 0 or n != model.decode_rows[k - 1]]
    assert sizes == [6, 7, 6, 3, 1], sizes
    assert not engine._seqs and not engine._groups  # noqa: SLF001 - every row left
    engine.close()


def test_a_constrained_and_a_seeded_newcomer_in_slots_rows_left(smollm):
    """A slot a row left takes a newcomer with its own sampling: a constrained one (its mask, told
    of every token) and a seeded one (its PRNG key put in the slot: the same draws as alone). The
    batch keeps four rows throughout, and every row answers as it does alone."""
    model = CountingModel(smollm._model)
    engine = sibling(smollm, pipelined=True, keep_slots=True, model=model, cache_bytes=0, max_batch=8)
    del model.decode_rows[:]
    vocab = smollm.tokenizer.vocab_size
    digits = [smollm.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    constraint = AllowOnly(digits, vocab)
    cases = [Case(chat(smollm, QUESTIONS[i]), greedy(), n) for i, n in ((0, 2), (1, 10), (2, 24), (3, 24))]
    cases.append(Case(chat(smollm, QUESTIONS[6]), greedy(constraint=constraint), 8, start=6))
    cases.append(Case(chat(smollm, QUESTIONS[7]), seeded(5, logprobs=1), 8, start=14))
    params = [c.params() for c in cases]
    batched = run_batched(engine, cases, budget=4096, params=params)
    digits_got = [s.token for s in batched[4]]
    # told of every token in order; perhaps of one more, in flight when the row ended (a pipelined
    # pass read together with a newcomer's first token, which the runtime drops)
    seen = constraint.seen
    assert set(digits_got) <= set(digits) and seen[:len(digits_got)] == digits_got
    assert len(seen) - len(digits_got) in (0, 1), seen
    # the newcomers took the slots rows 0 and 1 left (else the batch would have grown to 5 and 6)
    assert max(model.decode_rows) == 4 and model.decode_rows[:20] == [4] * 20, model.decode_rows
    free = [0, 1, 2, 3, 5]
    same_as_alone([cases[i] for i in free], [run_alone(smollm, cases[i]) for i in free],
                  [batched[i] for i in free])
    engine.close()


def test_a_slot_no_newcomer_takes_is_cut_out_after_a_while(smollm, monkeypatch):
    """A vacant slot is stepped with the others; one that no newcomer has taken for VACANT_STEPS
    steps is cut out (here 3): four rows, one leaves after two tokens, the batch keeps four slots for
    three more steps, then steps three. Each row answers as it does alone."""
    from mesh_llm.engines.mlx import batch as mlx_batch

    monkeypatch.setattr(mlx_batch, "VACANT_STEPS", 3)
    model = CountingModel(smollm._model)
    engine = sibling(smollm, pipelined=True, together=True, keep_slots=True, model=model, max_batch=4)
    del model.decode_rows[:]
    vocab = engine.tokenizer.vocab_size
    cases = [Case([(7 * i + 13 * j + 3) % vocab for j in range(30 + i)], greedy(), n)
             for i, n in enumerate([2, 12, 12, 12])]
    batched = run_batched(engine, cases, budget=4096)
    same_as_alone(cases, [run_alone(smollm, c) for c in cases], [batched[i] for i in range(4)])
    assert model.decode_rows[:8] == [4] * 6 + [3] * 2, model.decode_rows
    engine.close()


@pytest.mark.parametrize("keep_slots", [False, True], ids=["cut", "slots-kept"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_arrivals_lengths_and_leaves_read_together_and_pipelined_answer_as_alone(smollm, seed,
                                                                                       keep_slots):
    """The GPU's reading and stepping on this CPU (chunks read together, each step queued before the
    last is read, rows that leave cut out or leaving their slots) under a random load: ten prompts of
    5-100 tokens, half of them starting with the same 40 (resumed from a stored or running prefix),
    arriving over seven steps, a prompt budget of 96 tokens a step (three chunks), two sequences
    removed at random steps, mid-prompt or mid-answer. Every other sequence answers as it does alone
    (logprobs within TOLERANCE; a token may part only at a near-tie)."""
    rng = random.Random(seed)
    engine = sibling(smollm, pipelined=True, together=True, keep_slots=keep_slots, cache_bytes=1 << 30,
                     max_batch=10)
    vocab = engine.tokenizer.vocab_size
    document = [rng.randrange(vocab) for _ in range(40)]  # half the prompts start with it
    cases = [Case(document[:40 * (i % 2)] + [rng.randrange(vocab) for _ in range(rng.randint(5, 60))],
                  greedy(), rng.randint(3, 8), rng.randint(0, 6)) for i in range(10)]
    leaving = rng.sample(range(10), 2)
    batched = run_batched(engine, cases, budget=96, leave={i: rng.randint(0, 4) for i in leaving})
    for i, case in enumerate(cases):
        if i not in leaving:
            compare(run_alone(smollm, case), batched[i], TOLERANCE)
    assert not engine._seqs and not len(engine.scheduler)  # noqa: SLF001 - every row left
    engine.close()


def test_random_arrivals_in_short_memory_are_preempted_and_answer_as_alone(smollm, monkeypatch):
    """The GPU's reading and stepping on this CPU (chunks read together, pipelined, slots kept) with
    KV memory for three 256-token sequences: eight prompts of 170-240 tokens, half of them starting
    with the same 40, none bounded by max_tokens, arriving over eight steps; two removed at random
    steps. Sequences are preempted mid-prompt or mid-answer, newcomers wait for room, and every
    sequence not removed answers as it does alone."""
    rng = random.Random(1)
    engine = preempting(smollm, monkeypatch, 3, max_batch=8, pipelined=True, together=True,
                        keep_slots=True, cache_bytes=1 << 30)
    vocab, context = engine.tokenizer.vocab_size, engine.info().context_length
    document = [rng.randrange(vocab) for _ in range(40)]
    cases = [Case(document[:40 * (i % 2)] + [rng.randrange(vocab) for _ in range(rng.randint(170, 200))],
                  greedy(), rng.randint(20, 50), rng.randint(0, 8)) for i in range(8)]
    leaving = rng.sample(range(8), 2)
    batched = run_batched(engine, cases, budget=96, leave={i: rng.randint(0, 20) for i in leaving},
                          max_tokens={i: context - len(c.prompt) for i, c in enumerate(cases)})
    assert engine.cache_stats()["kv_preemptions"] > 0
    for i, case in enumerate(cases):
        if i not in leaving:
            compare(run_alone(smollm, case), batched[i], TOLERANCE)
    assert not engine._seqs and not len(engine.scheduler)  # noqa: SLF001 - every sequence left
    engine.close()


def test_warm_up_leaves_nothing_behind_and_changes_no_output(smollm):
    """The warm-up (on by default on a GPU, where it compiles and plans serving's shapes before the
    first request) holds no sequence and stores no prompt afterwards, and a request after it decodes
    exactly as on an engine that never warmed up."""
    engine = sibling(smollm, cache_bytes=64 << 20, max_batch=3)
    case = Case(chat(engine, QUESTIONS[3]), greedy(), 12, 0)
    cold = run_alone(engine, case)
    engine._prompts.clear()
    seconds = engine.warm_up()
    assert seconds > 0
    assert engine.cache_stats()["entries"] == 0 and not engine._seqs
    assert compare(cold, run_alone(engine, case), 0.0).diverged_at is None
    engine.close()


def test_the_warm_up_reads_every_padded_width_with_room_for_one_sequence(smollm):
    """At ``max_batch`` 1 as at 8 (a padded width once went in beside the warm-up's long prompt: the
    engine had no room, and the whole warm-up was skipped)."""
    model = CountingModel(smollm._model)
    engine = sibling(smollm, model=model, bucket=12, max_batch=1)
    assert engine.warm_up() > 0
    assert set(model.chunk_widths) == {12, 24, 32} and not engine._seqs
    engine.close()


def test_the_warm_up_fits_a_context_shorter_than_a_chunk(smollm):
    """``--ctx-size`` under ``--prefill-step`` (a padded width then reaches the context itself): the
    warm-up still reads every width a prompt can take, each prompt shorter than the context (on an
    H100 a 256-token context failed to load: a 257-token warm-up prompt)."""
    model = CountingModel(smollm._model)
    engine = sibling(smollm, model=model, bucket=12, context=30)
    assert engine.info().context_length == 30
    assert engine.warm_up() > 0
    assert set(model.chunk_widths) == {12, 24, 30} and not engine._seqs
    engine.close()


def test_chunks_over_512_tokens_are_padded_to_256_so_larger_chunks_add_few_widths(smollm):
    """With CUDA's bucket (64) and ``--prefill-step 1024``: widths of 64 up to 512 tokens, then 768
    and 1,024, ten in all (sixteen at multiples of 64), which is what the warm-up reads."""
    engine = sibling(smollm, bucket=64, prefill_step=1024)
    widths = {engine._padded(0, n) for n in range(1, 1025)}  # noqa: SLF001
    assert sorted(widths) == [*range(64, 513, 64), 768, 1024]
    assert engine._padded(0, 513) == 768 and engine._padded(100, 612) == 512  # noqa: SLF001
    engine.close()


def test_rows_that_report_no_logprobs_sample_the_same_from_raw_logits():
    """``mlx_sampling.scores`` skips the normalisation where nothing depends on it: greedy picks,
    top-k, min-p and seeded draws take the same tokens from float16 logits as from log-probabilities;
    a row asking for logprobs (or top-p) gets them normalised."""
    import mlx.core as mx

    from mesh_llm.engines.mlx.sampling import RowSettings, SequenceSampler, sample, scores, split_keys

    vocab = 500
    logits = (mx.random.normal((6, vocab), key=mx.random.key(3)) * 4 + 30).astype(mx.float16)
    reference = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, top_k=20, seed=2), SamplingParams(temperature=1.0, min_p=0.1, seed=3),
              SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=4), SamplingParams(temperature=0)]
    for rows in (params, [params[0], params[5]]):
        settings = RowSettings([SequenceSampler(p, vocab) for p in rows], vocab)
        values = scores(logits[: len(rows)], settings)
        assert values.dtype == (mx.float32 if settings.sampled else mx.float16)  # greedy: not even a cast
        subkeys = split_keys(mx.stack([s.key for s in settings.samplers]))[1] if settings.sampled else None
        assert (sample(values, settings, subkeys).tolist()
                == sample(reference[: len(rows)], settings, subkeys).tolist())
    reporting = RowSettings([SequenceSampler(SamplingParams(temperature=0, logprobs=1), vocab)], vocab)
    assert mx.allclose(scores(logits[:1], reporting), reference[:1], atol=1e-5).item()
    top_p = RowSettings([SequenceSampler(SamplingParams(temperature=1, top_p=0.9, seed=5), vocab)], vocab)
    assert mx.allclose(scores(logits[:1], top_p), reference[:1], atol=1e-5).item()


def test_the_fused_decode_attention_takes_only_one_query_over_a_batch_cache():
    """Where engines/mlx/kernels/attention.py stands in for mlx-lm's attention (run on the GPU machine by
    test_mlx_gpu.py): one query per row over a BatchKVCache's own buffers, a head size it was built
    for, no sinks, matching dtypes; and it is installed only on CUDA (here, a CPU, mlx-lm's attention is untouched)."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from mesh_llm.engines.mlx.kernels.attention import applies, install

    q = mx.zeros((2, 14, 1, 64), dtype=mx.float16)
    batch = BatchKVCache([0, 3])
    k, _ = batch.update_and_fetch(*(mx.zeros((2, 2, 9, 64), dtype=mx.float16),) * 2)
    assert applies(q, k, k, batch, None)
    assert not applies(q, k, k, BatchKVCache([0, 3]), None)  # the kernel reads the cache's own buffers
    assert not applies(q, mx.zeros((2, 2, 300, 64), dtype=mx.float16), k, batch, None)  # not that buffer's
    assert not applies(q, k, k, KVCache(), None)  # one row: MLX's own fused kernel, unmasked
    assert not applies(mx.zeros((2, 14, 5, 64), dtype=mx.float16), k, k, batch, None)  # a prompt chunk
    assert not applies(q, k, k, batch, mx.zeros((14,)))  # attention sinks
    assert not applies(mx.zeros((2, 14, 1, 80)), mx.zeros((2, 2, 9, 80)), mx.zeros((2, 2, 9, 80)), batch, None)
    assert not applies(q, k.astype(mx.float32), k.astype(mx.float32), batch, None)
    before = llama.scaled_dot_product_attention
    assert install(llama.Model(llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
        "num_attention_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 32}))) is mx.cuda.is_available()
    assert (llama.scaled_dot_product_attention is before) is not mx.cuda.is_available()


def test_a_chunk_reading_keys_in_steps_attends_as_mlx_lm_does():
    """prefill_in_steps: a 5-position chunk after 300 cached ones, over a buffer of 812 positions
    whose last hold stale values, reads 512 keys and gives mlx-lm's causal attention over the 305."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mesh_llm.engines.mlx.kernels.attention import prefill_in_steps

    cache = KVCache()
    k1, k2, k3 = mx.random.split(mx.random.key(3), 3)
    cache.update_and_fetch(mx.random.normal((1, 2, 300, 64), key=k1), mx.random.normal((1, 2, 300, 64), key=k2))
    cache.update_and_fetch(mx.random.normal((1, 2, 400, 64), key=k2), mx.random.normal((1, 2, 400, 64), key=k1))
    cache.trim(400)  # stale positions 300-699 stay in the buffer
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, 5, 64), key=k3),
                                          mx.random.normal((1, 2, 5, 64), key=k1))
    assert cache.keys.shape[2] == 812 and keys.shape[2] == 305
    queries = mx.random.normal((1, 4, 5, 64), key=k3)
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
    assert mx.allclose(prefill_in_steps(queries, cache, 0.125), want, atol=1e-5).item()


@pytest.mark.parametrize("together", [False, True], ids=["one-pass-each", "together"])
def test_padded_prompt_chunks_answer_as_unpadded_ones(smollm, together, monkeypatch):
    """``bucket``: every prompt chunk padded to a multiple of 12 tokens (at
    most the 32-token chunk), its attention over keys read in 256-position steps, and the padding
    trimmed from the caches again, alone and read together: the warm-up reads each padded width,
    each sequence answers as it does unpadded, and a prompt stored by the prompt cache resumes with
    its real tokens only."""
    from mesh_llm.engines.mlx.kernels import attention as mlx_attention

    stepped, in_steps = [], mlx_attention.prefill_in_steps
    monkeypatch.setattr(mlx_attention, "prefill_in_steps",
                        lambda q, cache, scale: stepped.append(q.shape[2]) or in_steps(q, cache, scale))
    model = CountingModel(smollm._model)
    engine = sibling(smollm, together=together, model=model, bucket=12)
    assert engine.info().details["prefill_bucket"] == "prompt chunks padded to a multiple of 12 tokens"
    engine.warm_up()
    assert set(model.chunk_widths) == {12, 24, 32}, model.chunk_widths
    model.chunk_widths.clear()
    cases = [replace(c, start=0 if i < 4 else c.start) for i, c in enumerate(eight_cases(engine))]
    alone = [run_alone(smollm, c) for c in cases]
    same_as_alone(cases, alone, run_batched(engine, cases, budget=4096))
    assert set(model.chunk_widths) <= {12, 24, 32}, model.chunk_widths
    assert set(stepped) == {12, 24, 32}  # every chunk's attention, one call a layer
    again = run_alone(engine, replace(cases[0], tokens=4))
    assert again[0].cached_tokens == len(cases[0].prompt) - 1
    assert [s.token for s in again] == [s.token for s in alone[0][:4]]
