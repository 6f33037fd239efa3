"""What a first request costs on the MLX engine, against the same request warm, in one fresh process.

    python3 benchmarks/gpu_mlx_warm.py MODEL_FOLDER [--warm-up] [--tokens 32] [--label NAME]

Times the import of mlx, the load (with the engine's warm-up when asked), then solo requests of
several prompt lengths, each new length and its repeat (TTFT and decode rate), then the first decode
steps at new batch sizes against later ones. Run it twice with the same MLX_PTX_CACHE_DIR to see what
the on-disk kernel cache saves, with ``--warm-up`` to see what warming up before ready saves, and with
MLX_CUDA_USE_CUDNN_SDPA=0 to see what cuDNN's attention planning costs per new prompt length.
Prints one JSON line; appends it to $OUT/mlx-warm.jsonl when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

started = time.perf_counter()

from mesh_llm.engines.mlx_blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from mesh_llm.engines.base import EngineOptions, SamplingParams  # noqa: E402
from mesh_llm.engines.mlx import MLXEngine  # noqa: E402

LENGTHS = [640, 640, 641, 512, 1000, 2048, 2048, 100]


def solo(engine: MLXEngine, length: int, tokens: int, salt: int) -> dict:
    prompt = [(31 * i + 7 * salt) % 30000 + 10 for i in range(length)]
    t0 = time.perf_counter()
    stamps = []
    for _ in engine.generate(prompt, SamplingParams(temperature=0.0), tokens):
        stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"prompt": length, "ttft_ms": round(1000 * ttft, 1), "decode_tok_s": round(rate, 1)}


def batch_steps(engine: MLXEngine, size: int, salt: int) -> dict:
    """``size`` rows decoding together: the first three steps' times and the median of the next 16."""
    for row in range(size):
        prompt = [(17 * i + 5 * row + salt) % 30000 + 10 for i in range(64)]
        engine.add(row, prompt, SamplingParams(temperature=0.0), 64)
    while engine._reading:  # noqa: SLF001 - until every row decodes
        engine.step(4096)
    times = []
    for _ in range(19):
        t0 = time.perf_counter()
        engine.step(4096)
        times.append(1000 * (time.perf_counter() - t0))
    for row in range(size):
        engine.remove(row)
    return {"batch": size, "first_steps_ms": [round(t, 1) for t in times[:3]],
            "later_step_ms": round(statistics.median(times[3:]), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="solo prompt lengths, in order")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    imported = time.perf_counter()
    t0 = time.perf_counter()
    engine = MLXEngine.load(args.model, EngineOptions(ctx_size=4096, cache_bytes=0, max_batch=args.max_batch,
                                                       warm_up=args.warm_up))
    loaded = time.perf_counter() - t0
    lengths = [int(n) for n in args.lengths.split(",")]
    requests = [solo(engine, n, args.tokens, salt=i) for i, n in enumerate(lengths)]
    sizes = [n for n in (2, 3, 8, 2, 8) if n <= args.max_batch]
    batches = [batch_steps(engine, n, salt=n) for n in sizes]
    info = {k: v for k, v in engine.info().details.items() if k in ("warm_up", "dtype", "max_batch")}
    record = {"label": args.label, "warm_up": args.warm_up, "import_s": round(imported - started, 2),
              "load_s": round(loaded, 2), "details": info, "requests": requests, "batches": batches,
              "ptx_cache": os.environ.get("MLX_PTX_CACHE_DIR", "(mlx default)"),
              "cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1"),
              "device": str(mx.default_device())}
    try:
        record["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int))}
    except Exception as exc:  # noqa: BLE001 - only a description
        record["device_info"] = repr(exc)
    line = json.dumps(record)
    print(line)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"], "mlx-warm.jsonl"), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
