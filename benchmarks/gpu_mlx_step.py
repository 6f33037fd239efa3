"""Where a decode step's time goes in the MLX engine, against a bare mlx-lm loop on the same model.

    python3 benchmarks/gpu_mlx_step.py MODEL_FOLDER [--tokens 256] [--prompt 640] [--kernels]

In one process, on one model: (1) a hand loop, ``model(y[:, None], cache)`` + argmax with the next
step queued before the last is read (the loop NOTES.md measured at 218-251 tok/s on the Qwen2.5-0.5B
shape), and the same through the traced step (``engines/mlx_compiled.py``), each step split into
building its graph, handing it to MLX and waiting for the last step's tokens; (2) the engine with 1, 2
and 8 sequences, its decode steps traced and not, each step split into building and queuing the
graph (launch) and waiting for the tokens (read); (3) with ``--kernels``, the GPU kernels a step
runs and their time (PyTorch's profiler). Prints a table; JSON to $OUT/mlx-step-<model>.json.
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
from mesh_llm.engines import mlx_attention  # noqa: E402
from mesh_llm.engines.mlx import MLXEngine  # noqa: E402
from mesh_llm.engines.mlx_compiled import CompiledDecode  # noqa: E402


def one_stream(model, prompt: list[int], traced: CompiledDecode | None):
    """A prompt read into fresh caches; returns a greedy decode step (the model as the engine loaded
    it, or ``traced``) and its first input."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])

    def forward(y):
        logits = traced.step(y, cache) if traced else model(y[:, None], cache=cache)[:, -1, :]
        return mx.argmax(logits, axis=-1)

    return forward, mx.array(prompt[-1:])


def hand_loop(model, prompt: list[int], tokens: int, traced: CompiledDecode | None = None) -> dict:
    split = pipelined_steps(*one_stream(model, prompt, traced), tokens)
    name = "traced step" if traced else "model step"
    return {"case": f"hand loop ({name}, argmax, pipelined)", **split}


def pipelined_steps(forward, y, tokens: int) -> dict:
    """``forward`` run ``tokens`` times, each step queued before the last one's tokens are read (as
    the engine runs on a GPU). Median ms a step, and of its parts: building the graph, handing it
    to MLX (``async_eval``), waiting for the last step's tokens."""
    pending = forward(y)
    mx.async_eval(pending)
    parts: dict[str, list[float]] = {"step_ms": [], "build_ms": [], "submit_ms": [], "read_ms": []}
    last = time.perf_counter()
    for _ in range(tokens):
        t0 = time.perf_counter()
        nxt = forward(pending)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        pending.tolist()
        t3 = time.perf_counter()
        pending = nxt
        for key, value in (("build_ms", t1 - t0), ("submit_ms", t2 - t1), ("read_ms", t3 - t2),
                           ("step_ms", t3 - last)):
            parts[key].append(1000 * value)
        last = t3
    pending.tolist()
    return {key: statistics.median(values) for key, values in parts.items()}


def kernels(model, prompt: list[int], tokens: int, traced: CompiledDecode | None) -> dict:
    """GPU kernels a decode step runs and their summed time, read by PyTorch's profiler (CUPTI sees
    every kernel in the process, MLX's included): synchronous steps, so nothing else overlaps."""
    found = profile_steps(*one_stream(model, prompt, traced), tokens, top=12)
    name = "traced step" if traced else "model step"
    return {"case": f"kernels ({name})", "kernels_per_step": found["kernels"] / tokens,
            "gpu_ms_per_step": found["gpu_ms"] / tokens,
            "top": [(n, t / tokens) for n, t in found["top"]]}


def profile_steps(forward, y, tokens: int, top: int = 8) -> dict:
    """``forward`` run synchronously (nothing overlaps) 8 times, then ``tokens`` times under
    PyTorch's profiler; :func:`kernel_times` of those, summed over the steps."""
    import torch  # noqa: PLC0415

    for _ in range(8):
        y = forward(y)
        mx.eval(y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(tokens):
            y = forward(y)
            mx.eval(y)
    return kernel_times(prof, top=top)


def kernel_times(prof, top: int = 8) -> dict:
    """A PyTorch profile's CUDA kernels (MLX's, through CUPTI): how many, their summed ms, and the
    ``top`` names (cut to 60 characters) by summed µs; and the same for the host's CUDA driver and
    runtime calls (``api_ms``, ``api_top``: launching graphs, building them, waiting)."""
    import torch  # noqa: PLC0415

    by_name: dict[str, float] = {}
    api: dict[str, float] = {}
    kernels = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.time_range.elapsed_us()
        elif e.name.startswith("cu"):
            api[e.name] = api.get(e.name, 0.0) + e.time_range.elapsed_us()
    return {"kernels": kernels, "gpu_ms": sum(by_name.values()) / 1000,
            "top": sorted(by_name.items(), key=lambda p: -p[1])[:top],
            "api_ms": sum(api.values()) / 1000, "api_top": sorted(api.items(), key=lambda p: -p[1])[:top]}


def hand_loop_on_engine_caches(engine: MLXEngine, prompt: list[int], tokens: int) -> dict:
    """The hand loop's forward pass over the layer caches the engine made for one sequence (its
    chunked prompt read): tells a slow cache from a slow engine step."""
    engine.add(0, prompt, SamplingParams(temperature=0.0), tokens + 4)
    while not engine.step(4096):
        pass
    group = engine._groups[0]  # noqa: SLF001
    cache, model = group._caches, engine._model  # noqa: SLF001

    def forward(y):
        return mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)

    split = pipelined_steps(forward, group._inputs, tokens)  # noqa: SLF001
    engine.remove(0)
    return {"case": "hand loop on the engine's caches", **split}


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
    parser.add_argument("--kernels", action="store_true", help="also count kernels with torch's profiler")
    parser.add_argument("--only", choices=["hand", "engine"],
                        help="only this one-stream loop, twice (for a sampling profiler)")
    args = parser.parse_args()
    engine = MLXEngine.load(args.model, EngineOptions(ctx_size=4096, cache_bytes=0, max_batch=8))
    model = engine._model  # noqa: SLF001
    mlx_attention.install(model, traced=True)
    traced = engine._compiled or CompiledDecode(model)  # noqa: SLF001
    prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(args.prompt)] for i in range(8)]
    engine._compiled = None  # noqa: SLF001
    if args.only:
        for _ in range(2):
            row = (hand_loop(model, prompts[0], args.tokens) if args.only == "hand" else
                   engine_steps(engine, prompts[:1], args.tokens, "engine, 1 seq"))
            print(f"{row['case']}: {row['step_ms']:.2f} ms a step")
        return
    rows = []
    for repeat in range(2):  # the first pass compiles kernels
        rows = [hand_loop(model, prompts[0], args.tokens), hand_loop(model, prompts[0], args.tokens, traced),
                hand_loop_on_engine_caches(engine, prompts[0], args.tokens)]
        for compiled in (None, traced):
            engine._compiled = compiled  # noqa: SLF001 - groups made from now on take it
            for n in (1, 2, 8):
                label = f"engine, {n} seq{'s' if n > 1 else ''}, {'traced' if compiled else 'model step'}"
                rows.append(engine_steps(engine, prompts[:n], args.tokens, label))
    print("| case | step ms | build or launch ms | submit ms | read ms | tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    nan = float("nan")
    for r in rows:
        print(f"| {r['case']} | {r['step_ms']:.2f} | {r.get('build_ms', r.get('launch_ms', nan)):.2f} | "
              f"{r.get('submit_ms', nan):.2f} | {r.get('read_ms', nan):.2f} | "
              f"{r.get('tok_s', 1000 / r['step_ms']):.0f} |")
    if args.kernels:
        for compiled in (None, traced):
            try:
                k = kernels(model, prompts[0], 32, compiled)
            except Exception as e:  # noqa: BLE001 - a profiler that cannot run costs only this row
                print(f"kernels: {type(e).__name__}: {e}")
                continue
            rows.append(k)
            print(f"{k['case']}: {k['kernels_per_step']:.0f} kernels, {k['gpu_ms_per_step']:.2f} ms of "
                  f"kernels a step; top: " + "; ".join(f"{n} {t:.0f} us" for n, t in k["top"][:6]))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"mlx-step-{args.model.name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
