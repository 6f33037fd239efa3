"""Where a prompt read's time goes on a GPU, against its compute floor; and what the warm-up costs a
second time in the same process (what is left once kernels are loaded and products planned).

    python3 benchmarks/gpu_prefill.py MODEL_FOLDER [--repeats 5] [--attempts 1] [--newcomers-only]

Prints, for prompt reads of 1 x 640, 1 x 2,048 and 4 x 512 tokens into fresh caches (the engine's
own forward pass, only the KV evaluated, as ``_read_chunk`` / ``_read_together`` do): the median
wall time, the summed GPU kernel time and the largest kernels (PyTorch's profiler, which sees MLX's
kernels through CUPTI), and tokens/s against 2 x parameters FLOPs per token. Before it, ``warm_up()``
run twice more (the load ran it on a GPU); after it, eight 640-token prompts added at once to the
engine, stepped with a prompt budget of 8,192 (the worker's while nothing decodes) and 2,048 tokens
(while streams decode) until each has its first token, then removed one by one (each removal
timed): ``--attempts`` times each, then once under the profiler, which also sums the host's CUDA
calls. ``--newcomers-only`` skips the reads' table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from gpu_mlx_step import kernel_times  # benchmarks/, the script's own folder; sets up MLX first

from mesh_llm.engines.base import EngineOptions, SamplingParams  # noqa: E402
from mesh_llm.engines.mlx import MLXEngine  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402


def read(model, rows: int, length: int, vocab: int):
    """One forward pass of ``rows`` prompts of ``length`` tokens into fresh caches; returns the KV."""
    cache = make_prompt_cache(model)
    tokens = mx.array([[(13 * j + 7 * r) % vocab for j in range(length)] for r in range(rows)])
    model(tokens, cache=cache)
    return [a for c in cache for a in (c.keys, c.values)]


def profile(fn, repeats: int) -> dict:
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    try:
        import torch  # noqa: PLC0415 - only here: a profiler, imported after MLX has its kernels
    except ImportError:
        return {"wall_ms": 1000 * statistics.median(times), "kernels": 0, "gpu_ms": 0.0, "top": []}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        mx.eval(fn())
    return {"wall_ms": 1000 * statistics.median(times), **kernel_times(prof)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--newcomers-only", action="store_true", help="skip the prompt reads' table")
    parser.add_argument("--attempts", type=int, default=1, help="unprofiled newcomer attempts a budget")
    args = parser.parse_args()
    engine = MLXEngine.load(args.model, EngineOptions(ctx_size=4096, cache_bytes=0, max_batch=8))
    model = engine._model  # noqa: SLF001 - the engine's model, projections fused as it serves
    vocab = min(1000, engine.tokenizer.vocab_size)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{params / 1e6:.0f} M parameters; the warm-up again after the load's (on a GPU): "
          f"{engine.warm_up():.2f} s, {engine.warm_up():.2f} s")
    if not args.newcomers_only:
        reads(model, params, vocab, args.repeats)
    attempt = 0
    for budget in (8192, 2048):
        for profiled in [False] * args.attempts + [True]:
            steps, first, gpu, leaves = newcomers(engine, vocab, budget, attempt, profiled)
            attempt += 1
            ms = ", ".join(f"{x:.0f}" for x in steps)
            line = (f"8 x 640 added at once, {budget} prompt tokens a step: first tokens after "
                    f"{min(first):.0f}-{max(first):.0f} ms, steps (ms): {ms}; removals (ms): "
                    + ", ".join(f"{x:.1f}" for x in leaves))
            if gpu:
                line += (f"; GPU kernels {gpu['gpu_ms']:.1f} ms ({gpu['kernels']}): {named(gpu['top'])}"
                         f"; CUDA calls {gpu['api_ms']:.1f} ms: {named(gpu['api_top'])}")
            print(line)


def named(top: list[tuple[str, float]]) -> str:
    return "; ".join(f"{n} {us / 1000:.2f} ms" for n, us in top)


def reads(model, params: int, vocab: int, repeats: int) -> None:
    """The table of prompt reads into fresh caches, and their largest kernels."""
    print("| read | wall ms | GPU kernel ms | kernels | tok/s | TFLOP/s (2 x params) |")
    print("| --- | --- | --- | --- | --- | --- |")
    tops = []
    for rows, length in ((1, 640), (1, 2048), (4, 512)):
        r = profile(lambda: read(model, rows, length, vocab), repeats)
        tokens = rows * length
        print(f"| {rows} x {length} | {r['wall_ms']:.1f} | {r['gpu_ms']:.1f} | {r['kernels']} | "
              f"{tokens / r['wall_ms'] * 1000:,.0f} | {2 * params * tokens / r['wall_ms'] / 1e9:.1f} |")
        tops.append((f"{rows} x {length}", r["top"]))
    for name, top in tops:
        print(f"{name}: {named(top)}")


def newcomers(engine: MLXEngine, vocab: int, budget: int, attempt: int, profiled: bool):
    """Eight 640-token prompts added at once and stepped until each has its first token, then
    removed: each step's wall ms, each first token's ms, (``profiled``) the kernels the steps and
    removals ran, and each removal's ms."""
    greedy = SamplingParams(temperature=0.0)
    prompts = [[(7 * i + 13 * j + attempt) % vocab for j in range(640)] for i in range(8)]

    leaves: list[float] = []  # each removal's ms, the rows still decoding (a stream that ends)

    def run():
        t, first, steps = time.perf_counter(), {}, []
        for i, p in enumerate(prompts):
            engine.add(i, p, greedy, 4)
        while len(first) < 8:
            s = time.perf_counter()
            for seq, _ in engine.step(budget):
                first.setdefault(seq, 1000 * (time.perf_counter() - t))
            steps.append(1000 * (time.perf_counter() - s))
        for i in range(8):
            s = time.perf_counter()
            engine.remove(i)
            leaves.append(1000 * (time.perf_counter() - s))
        return steps, list(first.values())

    try:
        import torch  # noqa: PLC0415
    except ImportError:
        profiled = False
    if not profiled:
        return (*run(), None, leaves)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        steps, first = run()
    return steps, first, kernel_times(prof), leaves


if __name__ == "__main__":
    main()
