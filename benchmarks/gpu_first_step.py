"""Where a short prompt's time to first token goes in the MLX engine on a GPU (issue 11's fixed cost
per request): each request's ``add``, the wall time of every ``step`` until its first token, and its
``remove``, for fresh random prompts of a few lengths; then ten 64-token requests under cProfile.
Last, 64-token requests alternated between this thread and a second one, as the server's worker
steps the engine on a thread of its own (the server's step measured 1.2 ms longer than this
process's on an H100).

    python3 benchmarks/gpu_first_step.py MODEL_FOLDER

The engine is stepped as the worker steps a newcomer with nothing else running
(``IDLE_PREFILL_STEPS`` x ``prefill_budget``), the prompt cache off. Not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import queue
import random
import statistics
import threading
import time
from pathlib import Path

from mesh_llm.engines.base import EngineOptions, SamplingParams
from mesh_llm.runtime.worker import IDLE_PREFILL_STEPS, prefill_budget


def first_token(engine, prompt: list[int], budget: int) -> tuple[float, list[float], float]:
    """One greedy token for ``prompt``, as the worker reads a newcomer's prompt with nothing else
    running (steps of ``budget`` prompt tokens): the seconds ``add`` took, each step's, and
    ``remove``'s (also ``server_ttft.py``'s engine side)."""
    started = time.perf_counter()
    engine.add(0, prompt, SamplingParams(temperature=0), 1)
    added, steps = time.perf_counter(), []
    while True:
        before = time.perf_counter()
        out = engine.step(budget)
        steps.append(time.perf_counter() - before)
        if out:
            break
    before = time.perf_counter()
    engine.remove(0)
    return added - started, steps, time.perf_counter() - before


def main() -> None:
    # imported here: server_ttft.py imports this module for first_token, on the llama engine too
    from mesh_llm.engines.mlx import MLXEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    args = parser.parse_args()
    engine = MLXEngine.load(Path(args.model), EngineOptions(ctx_size=2048, cache_bytes=0))
    budget = IDLE_PREFILL_STEPS * prefill_budget(engine.info())
    vocab, rng = engine.tokenizer.vocab_size, random.Random(3)

    def request(n: int) -> tuple[float, list[float], float]:
        """``first_token`` of a fresh n-token prompt, in ms."""
        add, steps, remove = first_token(engine, [rng.randrange(3, vocab) for _ in range(n)], budget)
        return 1000 * add, [1000 * s for s in steps], 1000 * remove

    for n in (64, 64, 640, 64, 256, 64):
        add, steps, remove = request(n)
        print(f"{n:5} tokens: add {add:.2f} ms, steps {', '.join(f'{s:.1f}' for s in steps)} ms, "
              f"remove {remove:.2f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(10):
        request(64)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(20)
    pstats.Stats(profile).sort_stats("tottime").print_stats(10)
    where: dict[str, list[float]] = {"main thread": [], "a new thread each": [], "one other thread": []}
    asks: queue.Queue = queue.Queue()
    answers: queue.Queue = queue.Queue()
    other = threading.Thread(target=lambda: [answers.put(sum(request(n)[1])) for n in iter(asks.get, None)],
                             daemon=True)
    other.start()
    for k in range(60):
        name = list(where)[k % 3]
        if name == "main thread":
            where[name].append(sum(request(64)[1]))
        elif name == "one other thread":  # as the server's worker: a thread that lives on
            asks.put(64)
            where[name].append(answers.get())
        else:
            thread = threading.Thread(target=lambda t=where[name]: t.append(sum(request(64)[1])))
            thread.start()
            thread.join()
    asks.put(None)
    print("64 tokens, steps' median ms: " + ", ".join(f"{name} {statistics.median(t):.2f}"
                                                     for name, t in where.items()))


if __name__ == "__main__":
    main()
