"""Why a prompt of a length not read before takes longer than one of a length read before (MLX on CUDA).

    python3 benchmarks/gpu_new_lengths.py MODEL_FOLDER [--profile]

On the H200 (2026-12-04, ``gpu_mlx_warm.py``) a 640-token prompt after the engine's warm-up got its
first token in 42-63 ms, another 640-token prompt right after in 20-31 ms, and a 641-token one in
40-59 ms again: the cost follows the length, not the first request. This loads the model as the
engine does (its warm-up included) and reads prompts through ``generate`` (one token each): every
length of ``--lengths`` twice, the second time with other tokens, so nothing comes from the prompt
cache. With ``--profile`` it reads one more new length and its repeat under PyTorch's profiler
(CUPTI: CUDA runtime and driver calls on the host, kernels on the GPU) and prints the calls whose
time differs most between the two.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mesh_llm.engines.mlx_blas import ensure_fast_blas

ensure_fast_blas()

from mesh_llm.engines.base import EngineOptions, SamplingParams  # noqa: E402
from mesh_llm.engines.mlx import MLXEngine  # noqa: E402


def ttft_ms(engine: MLXEngine, length: int, salt: int) -> float:
    prompt = [(31 * i + 7 * salt) % 30000 + 10 for i in range(length)]
    started = time.perf_counter()
    for _ in engine.generate(prompt, SamplingParams(temperature=0.0), 1):
        break
    return 1000 * (time.perf_counter() - started)


def profiled(engine: MLXEngine, length: int, salt: int) -> dict[str, tuple[int, float]]:
    """Each host call's and kernel's count and summed µs while one prompt is read."""
    import torch  # noqa: PLC0415 - a profiler, imported after MLX has its kernels

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        ttft_ms(engine, length, salt)
    totals: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        key = f"{'gpu' if e.device_type == torch.autograd.DeviceType.CUDA else 'host'} {e.name[:70]}"
        count, us = totals.get(key, (0, 0.0))
        totals[key] = (count + 1, us + e.time_range.elapsed_us())
    return totals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--lengths", default="640,700,641,1000,1500,100,300")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    engine = MLXEngine.load(args.model, EngineOptions(ctx_size=4096))
    print(f"{engine.info().details}")
    print("| prompt tokens | TTFT new length ms | TTFT same length again ms |\n| --- | --- | --- |")
    for salt, length in enumerate(int(n) for n in args.lengths.split(",")):
        new, again = ttft_ms(engine, length, 2 * salt), ttft_ms(engine, length, 2 * salt + 1)
        print(f"| {length} | {new:.1f} | {again:.1f} |")
    if args.profile:
        new, again = profiled(engine, 777, 100), profiled(engine, 777, 101)
        print("| call or kernel | count new | µs new | count again | µs again |\n| --- | --- | --- | --- | --- |")
        keys = sorted(new.keys() | again.keys(), key=lambda k: -abs(new.get(k, (0, 0))[1] - again.get(k, (0, 0))[1]))
        for key in keys[:25]:
            (n1, t1), (n2, t2) = new.get(key, (0, 0.0)), again.get(key, (0, 0.0))
            print(f"| {key} | {n1} | {t1:.0f} | {n2} | {t2:.0f} |")
    engine.close()


if __name__ == "__main__":
    main()
