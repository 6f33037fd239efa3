"""What a batch size the warm-up did not run costs when serving first reaches it, in one process.

    python3 benchmarks/gpu_warm_sizes.py MODEL_FOLDER [--max-batch 16] [--prompt 640] [--label NAME]

The engine loads with its warm-up (``--no-warm-up``: without), then grows a batch one row at a time,
as arrivals do: each new row's prompt read and joined (``join_ms``, the steps until it decodes) and
the next three decode steps of the grown batch (``steps_ms``). All rows then leave and the same ramp runs again, every size now seen once: the first ramp's excess over the
second is what an unwarmed size costs, once per process. Prints one JSON line; appends it to
$OUT/warm-sizes.jsonl when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from mesh_llm.engines.mlx_blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from mesh_llm.engines.base import EngineOptions, SamplingParams  # noqa: E402
from mesh_llm.engines.mlx import MLXEngine  # noqa: E402


def ramp(engine: MLXEngine, rows: int, prompt: int, salt: int) -> list[dict]:
    """Rows join one at a time; each size's join and its first three steps, synchronized."""
    greedy, sizes = SamplingParams(temperature=0.0), []
    for row in range(rows):
        engine.add(row, [(31 * i + 7 * row + salt) % 30000 + 10 for i in range(prompt)], greedy, 4 * rows + 8)
        t0 = time.perf_counter()
        while engine._reading:  # noqa: SLF001 - until the new row decodes
            engine.step(4 * 2048)
        mx.synchronize()
        join = time.perf_counter() - t0
        steps = []
        for _ in range(3):
            t0 = time.perf_counter()
            engine.step(4 * 2048)
            mx.synchronize()
            steps.append(time.perf_counter() - t0)
        sizes.append({"batch": row + 1, "join_ms": round(1000 * join, 1),
                      "steps_ms": [round(1000 * t, 1) for t in steps]})
    for row in range(rows):
        engine.remove(row)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=640)
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    t0 = time.perf_counter()
    engine = MLXEngine.load(args.model, EngineOptions(ctx_size=4096, cache_bytes=0, max_batch=args.max_batch,
                                                       warm_up=not args.no_warm_up))
    loaded = time.perf_counter() - t0
    first = ramp(engine, args.max_batch, args.prompt, salt=1)
    again = ramp(engine, args.max_batch, args.prompt, salt=2)
    excess = [round(a["join_ms"] + a["steps_ms"][0] - b["join_ms"] - b["steps_ms"][0], 1)
              for a, b in zip(first, again)]
    record = {"label": args.label, "warm_up": engine.info().details.get("warm_up", "off"),
              "load_s": round(loaded, 2), "prompt": args.prompt, "first": first, "again": again,
              "excess_ms": excess, "excess_total_ms": round(sum(excess), 1)}
    line = json.dumps(record)
    print(line)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"], "warm-sizes.jsonl"), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
