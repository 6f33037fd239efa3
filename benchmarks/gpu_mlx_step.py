"""Where a decode step's time goes in the MLX engine, against a bare mlx-lm loop on the same model.

    python3 benchmarks/gpu_mlx_step.py MODEL_FOLDER [--tokens 256] [--prompt 640]

In one process, on one model: (1) a hand loop, ``model(y[:, None], cache)`` + argmax with the next
step queued before the last is read (the loop NOTES.md measured at 218-251 tok/s on the Qwen2.5-0.5B
shape); (2) the engine with one sequence, pipelined (its GPU default) and not; (3) the engine with 2
and 8 sequences. For the engine it splits each step into building and queuing the graph (launch) and
waiting for the tokens (read). Prints a table; JSON to $OUT/mlx-step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from mesh_llm.engines.mlx_blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mesh_llm.engines.base import EngineOptions, SamplingParams  # noqa: E402
from mesh_llm.engines.mlx import MLXEngine  # noqa: E402


def hand_loop(model, prompt: list[int], tokens: int) -> dict:
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array(prompt[-1:])

    def forward(y):
        return mx.argmax(model(y[:, None] if y.ndim == 1 else y, cache=cache)[:, -1, :], axis=-1)

    times = pipelined_steps(forward, y, tokens)
    return {"case": "hand loop (mlx-lm model, argmax, pipelined)", "step_ms": 1000 * statistics.median(times)}


def pipelined_steps(forward, y, tokens: int) -> list[float]:
    """Seconds between tokens of ``forward`` run ``tokens`` times, each step queued before the last
    one's tokens are read (as the engine runs on a GPU)."""
    pending = forward(y)
    mx.async_eval(pending)
    times, last = [], time.perf_counter()
    for _ in range(tokens):
        nxt = forward(pending)
        mx.async_eval(nxt)
        pending.tolist()
        pending = nxt
        now = time.perf_counter()
        times.append(now - last)
        last = now
    pending.tolist()
    return times


def engine_steps(engine: MLXEngine, prompts: list[list[int]], tokens: int, label: str) -> dict:
    for seq, prompt in enumerate(prompts):
        engine.add(seq, prompt, SamplingParams(temperature=0.0), tokens + 2)
    while len(engine.step(4096)) < len(prompts):  # until every sequence decodes
        pass
    groups = engine._groups  # noqa: SLF001 - a profiler may look inside
    launch_t, read_t, step_t = [], [], []
    for _ in range(tokens):
        t0 = time.perf_counter()
        launches = [(g, g.launch()) for g in groups]
        t1 = time.perf_counter()
        for g, launch in launches:
            if engine._pipelined:  # noqa: SLF001
                if g.unread is not None:
                    g.read(g.unread)
                g.unread = launch
            else:
                g.read(launch)
        t2 = time.perf_counter()
        launch_t.append(t1 - t0)
        read_t.append(t2 - t1)
        step_t.append(t2 - t0)
    for seq in range(len(prompts)):
        engine.remove(seq)
    step = statistics.median(step_t)
    return {"case": label, "step_ms": 1000 * step, "launch_ms": 1000 * statistics.median(launch_t),
            "read_ms": 1000 * statistics.median(read_t), "tok_s": len(prompts) / step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=640)
    args = parser.parse_args()
    engine = MLXEngine.load(args.model, EngineOptions(ctx_size=4096, cache_bytes=0, max_batch=8))
    prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(args.prompt)] for i in range(8)]
    rows = []
    for repeat in range(2):  # the first pass compiles kernels
        rows = [hand_loop(engine._model, prompts[0], args.tokens)]  # noqa: SLF001
        for pipelined in (True, False):
            engine._pipelined = pipelined  # noqa: SLF001
            rows.append(engine_steps(engine, prompts[:1], args.tokens, f"engine, 1 seq, pipelined={pipelined}"))
        engine._pipelined = True  # noqa: SLF001
        for n in (2, 8):
            rows.append(engine_steps(engine, prompts[:n], args.tokens, f"engine, {n} seqs, pipelined"))
    print("| case | step ms | launch ms | read ms | tok/s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['step_ms']:.2f} | {r.get('launch_ms', float('nan')):.2f} | "
              f"{r.get('read_ms', float('nan')):.2f} | {r.get('tok_s', 1000 / r['step_ms']):.0f} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "mlx-step.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
