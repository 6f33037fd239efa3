"""The worker on a scripted engine (tests/fake_engine.py): admission from its queue, waiting, errors
that end one request and never the worker, hand-overs, and a shutdown that answers everyone."""

from __future__ import annotations

import re
import threading
import time

import pytest

from fake_engine import FakeEngine
from mesh_llm.engines.base import EngineOptions, SamplingParams
from mesh_llm.runtime.worker import (
    SHUTDOWN_MESSAGE,
    Chunk,
    GenerationRequest,
    Incoming,
    ModelWorker,
    QueueFull,
    WorkerNotReady,
)

GREEDY = SamplingParams(temperature=0.0)


class Collector:
    """Chunks of one request as the worker delivers them, and an event when the last one arrives."""

    def __init__(self, fail_on_text: bool = False):
        self.chunks: list[Chunk] = []
        self.done = threading.Event()
        self.fail_on_text = fail_on_text

    def __call__(self, chunk: Chunk) -> None:
        if self.fail_on_text and chunk.text:
            raise RuntimeError("the client's callback broke")
        self.chunks.append(chunk)
        if chunk.finish_reason is not None:
            self.done.set()

    @property
    def final(self) -> Chunk:
        assert self.done.wait(120), "no final chunk"
        return self.chunks[-1]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


def make_worker(max_batch: int = 4, max_queue: int = 8, step_s: float = 0.001, **engine) -> ModelWorker:
    worker = ModelWorker("test", lambda: FakeEngine(max_batch=max_batch, step_s=step_s, **engine),
                         max_queue=max_queue)
    worker.start()
    assert worker.wait_ready(120) and worker.ready, worker.load_error
    return worker


def request(worker: ModelWorker, text: str, max_tokens: int = 8, **kw) -> GenerationRequest:
    prompt = worker.tokenizer.encode(text, add_special_tokens=True)
    return GenerationRequest(prompt=prompt, params=kw.pop("params", GREEDY), max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def worker():
    w = make_worker()
    yield w
    w.stop()


def test_requests_beyond_the_batch_wait_for_a_slot_and_all_finish():
    w = make_worker(max_batch=1)
    try:
        collectors = [Collector() for _ in range(3)]
        for i, c in enumerate(collectors):
            w.submit(request(w, f"Story number {i}:", max_tokens=6, ignore_eos=True), c)
        assert w.load()["max_batch"] == 1
        for c in collectors:
            assert c.final.finish_reason == "length" and c.final.usage.completion_tokens == 6
    finally:
        w.stop()


def test_a_callback_that_raises_cancels_its_own_request_only(worker):
    broken, fine = Collector(fail_on_text=True), Collector()
    worker.submit(request(worker, "Once upon a time", max_tokens=40, ignore_eos=True), broken)
    worker.submit(request(worker, "The sky is", max_tokens=10, ignore_eos=True), fine)
    assert fine.final.finish_reason == "length" and fine.text
    deadline = time.monotonic() + 30
    while worker.load()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.load()["active"] == 0  # the broken one was cancelled, not left running
    after = Collector()
    worker.submit(request(worker, "Hello", max_tokens=3), after)
    assert after.final.finish_reason in ("stop", "length")


def test_a_request_the_engine_refuses_is_rejected_and_the_worker_goes_on(worker):
    bad = Collector()
    vocab = worker.tokenizer.vocab_size
    worker.submit(GenerationRequest(prompt=[1, vocab + 5], params=GREEDY, max_tokens=4), bad)
    assert bad.final.finish_reason == "error" and bad.final.rejected
    good = Collector()
    worker.submit(request(worker, "Hello", max_tokens=3), good)
    assert good.final.finish_reason in ("stop", "length")


def test_cancel_frees_the_slot_and_sends_nothing_more(worker):
    c = Collector()
    cancel = worker.submit(request(worker, "Count to a thousand:", max_tokens=3000, ignore_eos=True), c)
    deadline = time.monotonic() + 60
    while not c.text and time.monotonic() < deadline:
        time.sleep(0.01)
    cancel()
    deadline = time.monotonic() + 30
    while worker.load()["active"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.load()["active"] == 0
    assert not c.done.is_set()  # a cancelled request gets no final chunk: nobody is listening
    assert len(c.chunks) < 3000


def test_a_full_queue_refuses_at_once():
    w = make_worker(max_batch=1, max_queue=1, step_s=0.01)
    try:
        running, waiting = Collector(), Collector()
        w.submit(request(w, "Once upon a time", max_tokens=200, ignore_eos=True), running)
        deadline = time.monotonic() + 60
        while not running.chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        w.submit(request(w, "Hello", max_tokens=2), waiting)  # waits: the batch is full
        with pytest.raises(QueueFull) as info:
            w.submit(request(w, "Hi", max_tokens=2), Collector())
        assert info.value.retry_after >= 1
    finally:
        w.stop()
    # stopping answered both: the running one and the waiting one
    assert running.final.error == SHUTDOWN_MESSAGE
    assert waiting.final.error == SHUTDOWN_MESSAGE
    assert not w.ready
    with pytest.raises(WorkerNotReady):
        w.submit(GenerationRequest([1, 2], GREEDY, 2), Collector())


def test_with_max_queue_0_a_burst_as_large_as_the_batch_is_all_served_and_one_more_refused():
    w = make_worker(max_batch=4, max_queue=0, step_s=0.005)
    try:
        collectors = [Collector() for _ in range(4)]
        for i, c in enumerate(collectors):  # all at once: none has a slot yet when the next comes
            w.submit(request(w, f"Story {i}:", max_tokens=40, ignore_eos=True), c)
        with pytest.raises(QueueFull):
            w.submit(request(w, "One too many", max_tokens=2), Collector())
        for c in collectors:
            assert c.final.finish_reason == "length" and c.final.usage.completion_tokens == 40
    finally:
        w.stop()


def test_retry_after_grows_with_the_requests_ahead():
    waits = {}
    for max_queue in (1, 3):
        w = make_worker(max_batch=1, max_queue=max_queue, step_s=0.01)
        try:
            for i in range(1 + max_queue):  # one running, the rest waiting
                w.submit(request(w, f"Story {i}:", max_tokens=500, ignore_eos=True), Collector())
            with pytest.raises(QueueFull) as info:
                w.submit(request(w, "Hi", max_tokens=2), Collector())
            waits[max_queue] = info.value.retry_after
        finally:
            w.stop()
    assert 1 <= waits[1] < waits[3]


def test_a_model_that_fails_to_load_reports_why(tmp_path):
    from mesh_llm.engines.llama.engine import LlamaEngine

    missing = tmp_path / "missing.gguf"
    w = ModelWorker("broken", lambda: LlamaEngine.load(missing, EngineOptions()))
    w.start()
    assert w.wait_ready(30)
    assert not w.ready and "not found" in str(w.load_error)
    with pytest.raises(WorkerNotReady):
        w.submit(GenerationRequest([1, 2], GREEDY, 2), Collector())


def test_a_step_over_the_slow_limit_is_logged(worker, monkeypatch, caplog):
    """A limit of 0 s makes every step slow: the worker says so (how many sequences were reading and
    decoding) where streams were decoding, not for the prompt's read alone (on a CPU a long prompt
    takes seconds and stalls nobody)."""
    import mesh_llm.runtime.worker as worker_module

    monkeypatch.setattr(worker_module, "SLOW_STEP_S", 0.0)
    c = Collector()
    with caplog.at_level("WARNING", logger="mesh_llm.worker"):
        worker.submit(request(worker, "Count to three:", max_tokens=2, ignore_eos=True), c)
        assert c.final.finish_reason == "length"
    slow = [r.getMessage() for r in caplog.records if "one engine step took" in r.getMessage()]
    assert slow and all("0 decoding" not in m for m in slow), slow


def test_each_admission_and_step_is_logged_at_debug_level(worker, caplog):
    """At debug level the worker logs how long each prompt waited in the queue and each step's time,
    budget and sequences: a run's timeline (``MESH_LLM_LOG_LEVEL=debug`` for a server the bench
    starts)."""
    c = Collector()
    with caplog.at_level("DEBUG", logger="mesh_llm.worker"):
        worker.submit(request(worker, "Count to three:", max_tokens=3, ignore_eos=True), c)
        assert c.final.finish_reason == "length"
    messages = [r.getMessage() for r in caplog.records]
    assert any("prompt admitted after" in m for m in messages), messages
    assert sum(" decoding, " in m and "ms, budget" in m for m in messages) >= 3, messages


def _steps(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "ms, budget" in r.getMessage()]


def test_an_idle_worker_holds_its_first_step_for_requests_still_arriving(worker, caplog, monkeypatch):
    """Three requests arrive together; the first is queued while the other two are still being
    prepared (``arriving``), as when a client sends several at once and each is tokenized in turn.
    The worker holds its first step until they are queued, so one pass reads all three prompts;
    before, it read the first alone and the others behind it."""
    import mesh_llm.runtime.worker as worker_module

    monkeypatch.setattr(worker_module, "GATHER_S", 60.0)  # so only the arrivals can end the hold
    collectors = [Collector() for _ in range(3)]
    with caplog.at_level("DEBUG", logger="mesh_llm.worker"):
        with worker.arriving() as a, worker.arriving() as b, worker.arriving() as c:
            for arrival, collector, text in zip((a, b, c), collectors, ("One,", "Two,", "Three,")):
                worker.submit(request(worker, text, max_tokens=2, ignore_eos=True), collector)
                arrival.done()
                time.sleep(0.05)
        assert all(x.final.finish_reason == "length" for x in collectors)
    held = [r.getMessage() for r in caplog.records if "first step held" in r.getMessage()]
    assert len(held) == 1 and "(3 admitted, 0 still arriving)" in held[0], held
    assert " 3 reading, 0 decoding" in _steps(caplog)[0], _steps(caplog)


def test_the_hold_waits_for_a_request_whose_body_is_still_read(caplog, monkeypatch):
    """The API reads and validates a body (in a thread) before it knows the model: such a request
    counts too (``Incoming``). Before, 32 requests sent at once reached the worker one by one, and
    its first step held for none of those still in the parsing threads."""
    import mesh_llm.runtime.worker as worker_module

    monkeypatch.setattr(worker_module, "GATHER_S", 60.0)  # so only the arrivals can end the hold
    incoming = Incoming()
    worker = ModelWorker("test", lambda: FakeEngine(max_batch=4, step_s=0.001), incoming=incoming)
    worker.start()
    try:
        assert worker.wait_ready(120)
        first, second = Collector(), Collector()
        with caplog.at_level("DEBUG", logger="mesh_llm.worker"):
            body = incoming.counted()
            body.__enter__()  # the second request's body, being read
            worker.submit(request(worker, "One,", max_tokens=2, ignore_eos=True), first)
            time.sleep(0.1)
            with worker.arriving() as arrival:  # parsed: its handler takes over, then queues it
                body.__exit__(None, None, None)
                worker.submit(request(worker, "Two,", max_tokens=2, ignore_eos=True), second)
                arrival.done()
            assert first.final.finish_reason == second.final.finish_reason == "length"
        held = [r.getMessage() for r in caplog.records if "first step held" in r.getMessage()]
        assert len(held) == 1 and "(2 admitted, 0 still arriving)" in held[0], held
        assert " 2 reading, 0 decoding" in _steps(caplog)[0], _steps(caplog)
    finally:
        worker.stop()


def test_the_hold_is_bounded_and_a_lone_request_is_not_held(worker, caplog, monkeypatch):
    """A request still being prepared when the limit passes (a long prompt tokenizing) is not waited
    for further; a request with none arriving beside it is stepped at once."""
    import mesh_llm.runtime.worker as worker_module

    monkeypatch.setattr(worker_module, "GATHER_S", 0.05)
    with caplog.at_level("DEBUG", logger="mesh_llm.worker"):
        with worker.arriving():
            first = Collector()
            worker.submit(request(worker, "One,", max_tokens=2, ignore_eos=True), first)
            assert first.final.finish_reason == "length"  # while the other is still arriving
        lone = Collector()
        worker.submit(request(worker, "Two,", max_tokens=2, ignore_eos=True), lone)
        assert lone.final.finish_reason == "length"
    held = [r.getMessage() for r in caplog.records if "first step held" in r.getMessage()]
    assert len(held) == 1 and "(1 admitted, 1 still arriving)" in held[0], held
    assert len(_steps(caplog)) == 4, _steps(caplog)  # two steps each, none held for the lone


def test_the_engine_is_loaded_warmed_up_and_stepped_on_one_thread():
    """The worker's own thread loads the engine (its warm-up included) and runs every step: MLX's
    CUDA backend keeps its command encoders (each with its CUDA graph cache) and cuBLAS handles per
    thread (``thread_local`` in mlx 0.32), so a warm-up on another thread would warm nothing that
    serving uses."""
    seen: dict[str, set[int]] = {"load": set(), "step": set()}

    def load():
        seen["load"].add(threading.get_ident())
        engine = FakeEngine(max_batch=2)
        run = engine.run

        def recorded(plan):  # the engine's own step, wrapped in place
            seen["step"].add(threading.get_ident())
            return run(plan)

        engine.run = recorded
        return engine

    w = ModelWorker("one-thread", load)
    w.start()
    try:
        assert w.wait_ready(120) and w.ready, w.load_error
        c = Collector()
        w.submit(request(w, "Count to three:", max_tokens=3, ignore_eos=True), c)
        assert c.final.finish_reason == "length"
    finally:
        w.stop()
    assert seen["step"] and seen["step"] == seen["load"], seen
    assert threading.get_ident() not in seen["load"]


def test_the_prompt_budget_is_the_engine_s_own_prefill_step(caplog):
    """Without a budget of its own the worker reads as many prompt tokens a step as the engine's
    chunk (``EngineInfo.prefill_step``, which an engine may choose: 1,024 tokens for MLX on a GPU),
    four chunks where nothing decodes yet."""
    w = ModelWorker("chunks", lambda: FakeEngine(max_batch=2, prefill_step=48))
    w.start()
    try:
        assert w.wait_ready(120) and w.ready, w.load_error
        assert w.info.prefill_step == 48
        c = Collector()
        with caplog.at_level("DEBUG", logger="mesh_llm.worker"):
            w.submit(request(w, "Count to three:", max_tokens=3, ignore_eos=True), c)
            assert c.final.finish_reason == "length"
    finally:
        w.stop()
    budgets = {int(m.split("budget ")[1].split(":")[0]) for m in (r.getMessage() for r in caplog.records)
               if "ms, budget" in m}
    assert budgets == {48, 4 * 48}, budgets


def hand_overs(worker: ModelWorker, caplog, patience: float) -> list[tuple[int, int]]:
    """A 4-token request beside a 30-token stream, its consumer counting each chunk it has passed on
    (``Handover``, as ``Generation`` does) and holding its first and its last until the worker steps
    on or ``patience`` seconds pass: for each of those, the worker's steps when it was delivered and
    once it was taken."""
    import queue

    from mesh_llm.runtime.worker import Handover

    def steps() -> int:
        return sum("ms, budget" in r.getMessage() for r in caplog.records)

    delivered: queue.Queue = queue.Queue()
    handover = Handover()
    at_hand_over = []

    def consume() -> None:
        first = True
        while True:
            chunk, at = delivered.get()
            if (chunk.text and first) or chunk.finish_reason:
                first = False
                deadline = time.monotonic() + patience
                while steps() == at and time.monotonic() < deadline:
                    time.sleep(0.01)
                at_hand_over.append((at, steps()))
            handover.took()
            if chunk.finish_reason:
                return

    with caplog.at_level("DEBUG", logger="mesh_llm.worker"):
        beside = Collector()
        worker.submit(request(worker, "Once upon a time", max_tokens=30, ignore_eos=True), beside)
        consumer = threading.Thread(target=consume)
        consumer.start()
        worker.submit(request(worker, "The sky is", max_tokens=4, ignore_eos=True),
                      lambda c: delivered.put((c, steps())), handover)
        consumer.join(60)
        assert not consumer.is_alive()
        assert beside.final.finish_reason == "length" and beside.final.usage.completion_tokens == 30
    return at_hand_over


def test_a_first_and_a_last_chunk_are_taken_by_their_consumer_before_the_next_step(worker, monkeypatch,
                                                                                   caplog):
    """The first and last chunks of a consumer that counts what it passes on are handed over before
    the worker's next step, so that the event loop sending them never waits for the GIL behind that
    step's build; a stream beside it goes on afterwards. The wait is bounded (``HANDOVER_S``): a
    consumer that never counts still gets every chunk."""
    from mesh_llm.runtime import worker as worker_module
    from mesh_llm.runtime.worker import Handover

    monkeypatch.setattr(worker_module, "HANDOVER_S", 60)  # only the consumer ends the wait
    at_hand_over = hand_overs(worker, caplog, patience=1.0)
    assert len(at_hand_over) == 2 and all(a == b for a, b in at_hand_over), at_hand_over
    monkeypatch.setattr(worker_module, "HANDOVER_S", 0.005)
    never, after = Collector(), Collector()
    worker.submit(request(worker, "Hello", max_tokens=5, ignore_eos=True), never, Handover())
    assert never.final.finish_reason == "length" and never.final.usage.completion_tokens == 5
    # the worker is past that wait once a later request ends (else a later test's HANDOVER_S is its)
    worker.submit(request(worker, "Hi", max_tokens=2, ignore_eos=True), after)
    assert after.final.finish_reason == "length"


def test_after_a_step_of_many_tokens_the_worker_does_not_wait_for_a_consumer(worker, monkeypatch, caplog):
    """Past ``HANDOVER_TOKENS`` tokens a step (here 1, so that two streams pass it) the event loop has
    many chunks to take before the waited one: the worker steps on."""
    from mesh_llm.runtime import worker as worker_module

    monkeypatch.setattr(worker_module, "HANDOVER_S", 60)
    monkeypatch.setattr(worker_module, "HANDOVER_TOKENS", 1)
    first, _ = hand_overs(worker, caplog, patience=30.0)
    assert first[1] > first[0], first  # it stepped on while the first chunk waited to be taken


class _SlowPrompts(FakeEngine):
    """Reads prompt tokens at 2 ms each, as a CPU that other work shares."""

    def run(self, plan):
        time.sleep(0.002 * sum(c.end - c.start for c in plan.chunks))
        return super().run(plan)


def test_prompt_steps_beside_decoding_streams_are_sized_by_time(caplog, monkeypatch):
    """A long prompt arriving beside a stream: each step that reads it and takes over the target has
    its prompt budget halved (128 → 64 → 32 → 16), so the stream's next token is never a whole
    128-token read away; the prompt is still read whole and answered."""
    import mesh_llm.runtime.worker as worker_module
    monkeypatch.setattr(worker_module, "PROMPT_STEP_TARGET_S", 0.05)
    w = ModelWorker("paced", lambda: _SlowPrompts(max_batch=2, prefill_step=128))
    w.start()
    try:
        assert w.wait_ready(120) and w.ready, w.load_error
        stream, long = Collector(), Collector()
        with caplog.at_level("DEBUG", logger="mesh_llm.worker"):
            w.submit(request(w, "Hi", max_tokens=400, ignore_eos=True), stream)
            while not stream.chunks:
                time.sleep(0.01)
            w.submit(request(w, "x" * 600, max_tokens=2, ignore_eos=True), long)
            assert long.final.finish_reason == "length" and long.final.usage.prompt_tokens > 600
        assert stream.final.finish_reason == "length"
    finally:
        w.stop()
    steps = [re.search(r"budget (\d+): (\d+) reading, (\d+) decoding", r.getMessage()) for r in caplog.records]
    beside = [int(m[1]) for m in steps if m and int(m[2]) and int(m[3])]  # prompts read beside a stream
    assert beside[:4] == [128, 64, 32, 16], beside
