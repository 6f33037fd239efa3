"""The scheduler's policy on a scripted runner (tests/fake_engine.py): admission, fairness, prompt
chunks, prefix waits, preemption and resumption, cancellation. Milliseconds, no model."""

from __future__ import annotations

import random

import pytest

from fake_engine import FakeEngine, next_token
from mesh_llm.engines.base import EngineError, NoCapacity, SamplingParams
from mesh_llm.runtime.scheduler import common_prefix

GREEDY = SamplingParams(temperature=0.0)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def alone(p: list[int], n: int) -> list[int]:
    """What the fake model answers to ``p`` on its own: ``n`` greedy tokens."""
    history, out = list(p), []
    for _ in range(n):
        out.append(next_token(history))
        history.append(out[-1])
    return out


def drive(engine: FakeEngine, work: dict[int, tuple[list[int], int, int]], budget: int = 32,
          cancel_at: dict[int, int] | None = None, limit: int = 10_000):
    """Run ``{seq: (prompt, tokens, step it arrives at)}`` as the worker does: arrivals wait in a
    first-come-first-served line, admitted while the engine takes them; each is removed once it has
    its tokens (or at step ``cancel_at[seq]``). Returns each one's tokens and the step it ended at."""
    out = {seq: [] for seq in work}
    ended: dict[int, int] = {}
    line: list[int] = []
    cancel_at = cancel_at or {}
    for step in range(limit):
        line += [seq for seq, (_, _, at) in work.items() if at == step]
        while line:
            p, n, _ = work[line[0]]
            try:
                engine.add(line[0], p, GREEDY, n)
            except NoCapacity:
                break
            line.pop(0)
        for seq, st in engine.step(budget):
            out[seq].append(st.token)
        for seq in list(engine.seqs):
            if len(out[seq]) >= work[seq][1] or cancel_at.get(seq) == step:
                engine.remove(seq)
                ended[seq] = step
        if len(ended) == len(work):
            return out, ended
    raise AssertionError(f"not done after {limit} steps: {len(ended)} of {len(work)} ended")


def test_decode_rows_first_then_chunks_in_arrival_order_within_the_budget():
    engine = FakeEngine(prefill_step=16)
    engine.add(0, prompt(0, 5), GREEDY, 8)
    engine.step(32)  # reads its 5 tokens, samples its first
    for seq in (1, 2, 3):
        engine.add(seq, prompt(seq, 40), GREEDY, 8)
    engine.step(24)
    plan = engine.plans[-1]
    assert plan.decode == [0]
    # the first in line reads a whole chunk (16), the next would need 16 more than the 8 left: waits
    assert [(c.seq, c.start, c.end) for c in plan.chunks] == [(1, 0, 16)]
    engine.step(40)
    assert [(c.seq, c.start, c.end) for c in engine.plans[-1].chunks] == [(1, 16, 32), (2, 0, 16)]


def test_the_first_in_line_always_progresses_cut_to_the_budget():
    engine = FakeEngine(prefill_step=64)
    engine.add(0, prompt(0, 100), GREEDY, 4)
    engine.step(10)
    assert [(c.start, c.end) for c in engine.plans[-1].chunks] == [(0, 10)]
    engine.step(100)  # then back on the chunk grid: the prompt splits as it would alone
    assert [(c.start, c.end) for c in engine.plans[-1].chunks] == [(10, 64)]


def test_admission_stops_at_max_batch_and_memory_and_the_line_is_never_jumped():
    engine = FakeEngine(max_batch=2, kv_tokens=100)
    engine.add(0, prompt(0, 30), GREEDY, 10)
    with pytest.raises(NoCapacity, match="KV cells"):
        engine.add(1, prompt(1, 80), GREEDY, 10)  # 40 + 90 > 100
    engine.add(1, prompt(1, 40), GREEDY, 10)
    with pytest.raises(NoCapacity, match="all 2 sequences are running"):
        engine.add(2, prompt(2, 4), GREEDY, 1)
    with pytest.raises(ValueError, match="already running"):
        engine.add(0, prompt(0, 4), GREEDY, 1)


def test_no_sequence_starves_under_a_stream_of_arrivals():
    """A long request arrives behind short ones while more short ones keep arriving, in memory that
    holds it only when nothing else runs: the line is first come first served, so it runs as soon
    as those before it end, and the later ones wait behind it."""
    engine = FakeEngine(max_batch=4, kv_tokens=400, prefill_step=32)
    work = {seq: (prompt(seq, 20), 30, seq) for seq in range(6)}
    work[6] = (prompt(6, 300), 20, 6)  # needs 320 of the 400 tokens
    work.update({seq: (prompt(seq, 20), 30, seq) for seq in range(7, 40)})  # one a step, for 33 steps
    out, ended = drive(engine, work)
    assert all(len(out[seq]) == work[seq][1] for seq in work)
    assert out[6] == alone(work[6][0], 20)
    later = [ended[seq] for seq in range(7, 40)]
    assert ended[6] < min(later)  # nobody that arrived after it was served before it ended


@pytest.mark.parametrize("pipelined", [False, True], ids=["read-each-step", "pipelined"])
def test_the_newest_is_preempted_and_answers_on_exactly_as_alone(pipelined):
    """Three sequences whose answers outgrow the memory: the newest gives its state back (and, from
    a pipelined engine, the token it had in flight), waits, reads again what it held and sampled,
    and every answer is the one it gives alone."""
    engine = FakeEngine(max_batch=3, kv_tokens=300, prefill_step=16, share=False, pipelined=pipelined)
    work = {seq: (prompt(seq, 60), 100, 0) for seq in range(3)}
    preempted = []
    original = engine.preempt
    engine.preempt = lambda seq: preempted.append(seq) or original(seq)
    out, _ = drive(engine, work)
    assert preempted and preempted[0] == 2  # the newest first
    assert 0 not in preempted  # never the oldest
    assert engine.scheduler.preemptions == len(preempted)
    for seq, (p, n, _) in work.items():
        assert out[seq] == alone(p, n)


def test_preempted_sequences_resume_before_newcomers():
    engine = FakeEngine(max_batch=3, kv_tokens=200, prefill_step=16, share=False)
    for seq in range(2):
        engine.add(seq, prompt(seq, 60), GREEDY, 100)
    while not engine.scheduler.preemptions:
        engine.step(64)
    with pytest.raises(NoCapacity, match="preempted"):
        engine.add(2, prompt(2, 4), GREEDY, 2)
    engine.remove(0)
    engine.step(64)
    assert engine.plans[-1].chunks and engine.plans[-1].chunks[0].seq == 1  # it reads again first
    engine.add(2, prompt(2, 4), GREEDY, 2)


def test_a_newcomer_waits_for_a_prefix_another_is_reading_and_that_pays():
    """Two questions on one 200-token document, arriving together: the second waits while the first
    reads the document, then starts from its state. 200 prompt tokens fewer are computed than
    without sharing, and both answers are the same."""
    document = prompt(99, 200)
    work = {0: (document + prompt(1, 10), 8, 0), 1: (document + prompt(2, 12), 8, 0)}
    shared, separate = FakeEngine(prefill_step=32), FakeEngine(prefill_step=32, share=False)
    out_shared, _ = drive(shared, work, budget=64)
    out_separate, _ = drive(separate, work, budget=64)
    assert out_shared == out_separate
    assert separate.computed - shared.computed == 200
    first_chunk_of_1 = next(c for plan in shared.plans for c in plan.chunks if c.seq == 1)
    assert first_chunk_of_1.start == 200  # it began from the document the other had read
    assert common_prefix(work[0][0], work[1][0]) == 200


def test_waiting_never_blocks_everyone():
    """Both wait on nothing: a newcomer waits only for an earlier sequence still reading, so the
    first always goes, and one that shares nothing never waits."""
    engine = FakeEngine(prefill_step=8)
    engine.add(0, prompt(0, 30), GREEDY, 2)
    engine.add(1, prompt(1, 30), GREEDY, 2)
    engine.step(16)
    assert [c.seq for c in engine.plans[-1].chunks] == [0, 1]


def test_a_cancelled_sequence_frees_its_memory_before_the_next_step():
    """One sequence holds most of the memory; the next is refused. Removing the first mid-prompt
    frees its room at once: the next is admitted before another step runs, and the step reads it."""
    engine = FakeEngine(max_batch=4, kv_tokens=300, prefill_step=16)
    engine.add(0, prompt(0, 250), GREEDY, 10)
    engine.step(32)
    assert engine.held(0) == 16
    with pytest.raises(NoCapacity):
        engine.add(1, prompt(1, 100), GREEDY, 10)
    engine.remove(0)
    assert 0 not in engine.seqs
    engine.add(1, prompt(1, 100), GREEDY, 10)
    engine.step(32)
    assert [c.seq for c in engine.plans[-1].chunks] == [1] and engine.plans[-1].decode == []


def test_claims_grow_with_the_answer_and_whole_answers_where_preemption_is_not_allowed():
    engine = FakeEngine(headroom=8)
    scheduler = engine.scheduler
    engine.add(0, prompt(0, 20), GREEDY, 100)
    assert scheduler.claims() == {0: 28}  # prompt and the runner's headroom
    sampled = sum(len(engine.step(64)) for _ in range(20))
    assert sampled == 19  # the prompt took two chunks of 16 and 4
    assert scheduler.claims() == {0: 20 + sampled - 1 + 2}  # what it holds, and its next
    engine.reserves_answers = True
    assert scheduler.claims() == {0: 120}


def test_an_engine_that_fails_mid_step_drops_every_sequence():
    engine = FakeEngine()
    engine.add(0, prompt(0, 10), GREEDY, 5)
    engine.fail_next = True
    with pytest.raises(EngineError):
        engine.step(32)
    assert len(engine.scheduler) == 0
    engine.add(0, prompt(0, 10), GREEDY, 5)  # the id is free again
    assert engine.step(32)


@pytest.mark.parametrize("seed", [5, 6])
@pytest.mark.parametrize("pipelined", [False, True], ids=["read-each-step", "pipelined"])
def test_random_arrivals_cancellations_and_tight_memory_keep_every_answer_exact(pipelined, seed):
    """Thirty sequences of random lengths arriving at random steps, some cut early by their
    clients, in memory they overfill many times (a sequence is preempted again and again): no step
    holds more than the memory, every readmitted prompt is what the sequence held and sampled (the
    fake asserts both), and every answer that runs to its end is the one it gives alone."""
    rng = random.Random(seed)
    engine = FakeEngine(max_batch=6, kv_tokens=400, prefill_step=16, pipelined=pipelined)
    work = {seq: (prompt(100 + seq, rng.randint(5, 150)), rng.randint(1, 160), rng.randint(0, 80))
            for seq in range(30)}
    cut = {seq: work[seq][2] + rng.randint(1, 30) for seq in rng.sample(sorted(work), 6)}
    out, _ = drive(engine, work, budget=48, cancel_at=cut)
    assert engine.scheduler.preemptions > 0
    for seq, (p, n, _) in work.items():
        expected = alone(p, n)
        if seq in cut:
            assert out[seq] == expected[: len(out[seq])]
        else:
            assert out[seq] == expected
