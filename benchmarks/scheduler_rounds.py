"""Rounds of N requests sent at once through the real scheduler (``runtime.worker.ModelWorker``), no
HTTP: time to first token and summed rate per round, every engine step timed, the slow steps listed.

    python3 benchmarks/scheduler_rounds.py MODEL [--engine mlx] [--streams 8] [--rounds 3]
        [--prompt 640[,2048...]] [--tokens 256] [--probe] [--profile] [--keep-buffers] [--load-here]
        [--idle SECONDS]

It separates what the engine and the scheduler cost from what HTTP adds (compare with
``mesh-llm bench --concurrency`` on the same model), and finds stalls: a step that takes many times
the median (a kernel compiled on first use of a shape, a copy, a collection) shows with what the
step carried. The prompts of a round share a 6-token prefix, as chat prompts share their template's,
so later rounds start from the prompt cache as they would behind the server. ``--profile`` runs
cProfile around every engine step and prints the functions that took the most time in the steps
that took longest. ``--probe`` sends first what ``mesh-llm bench`` sends a fresh server before its cases
(a 19-token prompt, one token out), so that round 0 is the bench's first request (issue 11: a fresh
server's first 128-token request took 2.3-4.7x later ones). Where MLX keeps its compiled kernels
(``MLX_PTX_CACHE_DIR``), each round counts the files it added: a kernel compiled on first use.
``--keep-buffers`` makes ``mx.clear_cache`` do nothing in this process (the warm-up's last call
included), to see whether a first request pays for buffers allocated afresh. The engine loads (and
warms up) on the worker's thread, as behind the server: MLX's CUDA backend keeps its graph caches and
cuBLAS handles per thread, and ``--load-here`` (the main thread) shows what a warm-up on another
thread leaves cold. ``--idle`` waits before the probe and before each round, as a server idles
between a benchmark's start and its requests: a GPU left idle lowers its clocks, and a first request
that pays for that would show in every round. Prints a table; JSON to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import mesh_llm  # noqa: F401  (loads a CUDA llama.cpp before other native libraries)
from mesh_llm.engines import engine_class
from mesh_llm.engines.base import EngineOptions, SamplingParams
from mesh_llm.runtime.worker import GenerationRequest, ModelWorker


class TimedEngine:
    """The engine, with each ``step`` timed (and profiled when asked); everything else passes through."""

    def __init__(self, engine, profile: bool):
        self._engine = engine
        self.steps: list[dict] = []
        self.profiles: list[tuple[float, cProfile.Profile]] = []
        self._profile = profile

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, budget: int):
        profiler = cProfile.Profile() if self._profile else None
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        out = self._engine.step(budget)
        if profiler:
            profiler.disable()
        dt = time.perf_counter() - t0
        self.steps.append({"t": t0, "ms": 1000 * dt, "tokens": len(out), "budget": budget})
        if profiler:
            self.profiles.append((dt, profiler))
            self.profiles.sort(key=lambda p: -p[0])
            del self.profiles[3:]
        return out


def prompts_for(round_: int, streams: int, length: int, vocab: int) -> list[list[int]]:
    shared = [11, 12, 13, 14, 15, 16]
    return [shared + [(round_ * 7919 + i * 104729 + j * 31) % (vocab - 100) + 50 for j in range(length - 6)]
            for i in range(streams)]


def kernel_files() -> int | None:
    folder = os.environ.get("MLX_PTX_CACHE_DIR")
    return sum(len(files) for _, _, files in os.walk(folder)) if folder else None


def run_round(worker: ModelWorker, engine: TimedEngine, prompts, tokens: int) -> dict:
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()
    first: dict[int, float] = {}
    ends: dict[int, float] = {}
    counts: dict[int, int] = {}

    def deliver_for(i: int):
        def deliver(chunk):
            now = time.perf_counter()
            if chunk.error:
                raise SystemExit(f"request {i} failed: {chunk.error}")
            first.setdefault(i, now)
            if chunk.finish_reason is not None:
                ends[i], counts[i] = now, chunk.usage.completion_tokens
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        return deliver

    steps_before, kernels_before = len(engine.steps), kernel_files()
    sent = time.perf_counter()
    for i, prompt in enumerate(prompts):
        worker.submit(GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0.0),
                                        max_tokens=tokens, ignore_eos=True), deliver_for(i))
    if not done.wait(600):
        raise SystemExit("a round did not finish in 600 s")
    wall = max(ends.values()) - sent
    ttft = sorted(first[i] - sent for i in range(len(prompts)))
    steps = engine.steps[steps_before:]
    median = statistics.median(s["ms"] for s in steps)
    slow = [{"at_ms": round(1000 * (s["t"] - sent), 1), "ms": round(s["ms"], 1), "tokens": s["tokens"],
             "budget": s["budget"]} for s in steps if s["ms"] > max(5 * median, median + 20)]
    decode_steps = [s["ms"] for s in steps if s["tokens"] == len(prompts)]
    kernels = kernel_files()
    return {
        "streams": len(prompts), "wall_s": wall, "summed_tok_s": sum(counts.values()) / wall,
        "ttft_p50_ms": 1000 * ttft[len(ttft) // 2], "ttft_max_ms": 1000 * ttft[-1],
        "steps": len(steps), "step_median_ms": median,
        "full_step_median_ms": statistics.median(decode_steps) if decode_steps else None,
        "slow_steps": slow[:20],
        "first_steps_ms": [round(s["ms"], 1) for s in steps[:4]],
        "kernels_added": None if kernels is None else kernels - kernels_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--engine", default="mlx")
    parser.add_argument("--streams", default="1,8", help="comma-separated: requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", default="640", help="comma-separated: prompt tokens, rounds of each "
                        "in turn")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--prefill-step", type=int, help="default: the engine's, as the server's")
    parser.add_argument("--max-batch", type=int, help="default: the most streams of a round")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--probe", action="store_true", help="first, a 19-token prompt, one token out")
    parser.add_argument("--keep-buffers", action="store_true", help="mx.clear_cache does nothing")
    parser.add_argument("--load-here", action="store_true", help="load (and warm up) on the main thread, "
                        "not the worker's")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds idle before the probe and each round")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false", default=None)
    parser.add_argument("--warm-up", dest="warm_up", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="the llama engine's bfloat16 KV cells")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    levels = [int(n) for n in args.streams.split(",")]
    options = EngineOptions(ctx_size=args.ctx_size, max_batch=args.max_batch or max(levels),
                            prefill_step=args.prefill_step, warm_up=args.warm_up,
                            deterministic=args.deterministic, threads=args.threads)
    cls = engine_class(args.engine)
    if args.keep_buffers:
        import mlx.core as mx  # after the engine's module, which readies MLX's BLAS first
        mx.clear_cache = lambda: None
    started = time.perf_counter()
    held: list[TimedEngine] = []

    def load() -> TimedEngine:
        held.append(TimedEngine(cls.load(args.model, options), args.profile))
        return held[0]

    if args.load_here:
        load()
    worker = ModelWorker("bench", (lambda: held[0]) if args.load_here else load,
                         prefill_budget=args.prefill_step)
    worker.start()
    worker.wait_ready()
    if worker.load_error:
        raise worker.load_error
    engine, loaded = held[0], time.perf_counter() - started
    vocab = engine.tokenizer.vocab_size
    details = engine.info().details
    rows = []
    print(f"loaded in {loaded:.1f} s: {details}")
    print("| streams | prompt | round | TTFT p50 ms | TTFT max ms | summed tok/s | steps | median step ms | "
          "all-rows step ms | first steps ms | kernels added | slow steps (at ms: ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    if args.probe:
        time.sleep(args.idle)
        probe = run_round(worker, engine, prompts_for(99, 1, 19, vocab), 1)
        print(f"| probe | 19 | - | {probe['ttft_p50_ms']:.0f} | | | {probe['steps']} | | | "
              f"{probe['first_steps_ms']} | {probe['kernels_added']} | |", flush=True)
    for n, length in [(n, int(p)) for n in levels for p in args.prompt.split(",")]:
        for r in range(args.rounds):
            time.sleep(args.idle)
            row = run_round(worker, engine, prompts_for(len(rows), n, length, vocab), args.tokens)
            row["round"], row["prompt"] = r, length
            rows.append(row)
            slow = ", ".join(f"{s['at_ms']:.0f}: {s['ms']:.0f}" for s in row["slow_steps"][:6])
            full = row["full_step_median_ms"]
            print(f"| {n} | {length} | {r} | {row['ttft_p50_ms']:.0f} | {row['ttft_max_ms']:.0f} | "
                  f"{row['summed_tok_s']:.1f} | {row['steps']} | {row['step_median_ms']:.2f} | "
                  f"{'' if full is None else f'{full:.2f}'} | {row['first_steps_ms']} | "
                  f"{row['kernels_added']} | {slow} |", flush=True)
    worker.stop()
    if args.profile:
        for dt, profiler in engine.profiles:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(18)
            print(f"\n## a step of {1000 * dt:.0f} ms\n" + text.getvalue()[-3500:])
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "engine": args.engine,
                                        "details": details, "load_s": loaded,
                                        "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as `mesh-llm serve` does: MLX can abort in exit-time destructors (an engine loaded
    # on the worker's thread left a stream thread that outlived them: "terminate called", exit 134)
