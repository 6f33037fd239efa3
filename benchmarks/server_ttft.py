"""What the server adds to a request's time to first token, against the raw engine (issue 11's
"<= 2 ms of TTFT").

    .venv/bin/python benchmarks/server_ttft.py [MODEL] [--engine llama|mlx] [--requests 40]
                                               [--prompt-tokens 64] [--against SRC] [--out FILE]

The same token-id prompts (each a fresh one, the prompt cache off) sent two ways, alternated
request by request: to the engine loaded in this process (``add`` and ``step`` until the first
token, in steps of the budget the worker gives a newcomer's prompt when nothing else runs), and as
streamed ``/v1/completions`` to ``mesh-llm serve`` on the same model with the same settings (time
to the first streamed token, as a client sees it). On the llama engine a tiny random-weight GGUF
(``tests/tiny_gguf.py``) by default, so the engine's own time is small and the server's shows; on
the MLX engine the embedded SmolLM2's folder. Reports each way's median and the difference. One
token is asked for, so that no step of a request is still running when the next one comes (a CPU's
MLX decode step takes ~70 ms). ``--against SRC``: a third way, a server on the ``src/`` folder SRC
(an earlier copy of the code), in the same rotation. Each round takes the ways in the next of their
orders, so that each way comes first, between the others and last equally often (with ``--against``,
give a multiple of 6 requests; before 2026-12-06 the rounds alternated one order and its reverse, so
this code's server was always measured between the other two ways). Not a test.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from alternate import serve, write  # benchmarks/, the script's own folder
from gpu_first_step import first_token
from hop_cpu import tiny_model

from mesh_llm.bench.backends import Server
from mesh_llm.engines import engine_class
from mesh_llm.engines.base import EngineOptions
from mesh_llm.runtime.worker import IDLE_PREFILL_STEPS, prefill_budget

CONTEXT = 2048


def raw_ttft(engine, prompt: list[int], budget: int) -> tuple[float, list[float]]:
    """The time to the first token in the engine alone (its ``add`` and steps), and each step's."""
    add, steps, _ = first_token(engine, prompt, budget)
    return add + sum(steps), steps


def round_trips(http: httpx.Client, server: Server, prompt: list[int], n: int = 20) -> dict[str, float]:
    """Medians of two requests that queue nothing: ``GET /health`` (the client and HTTP alone) and
    the same completion body for a model that does not exist (its body read and validated, then a
    404), to split what comes before a generation's response headers."""
    body = {"model": "no-such-model", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    times: dict[str, list[float]] = {"health": [], "refused": []}
    for _ in range(n):
        for name, send in (("health", lambda: http.get(server.url + "/health")),
                           ("refused", lambda: http.post(server.url + "/v1/completions", json=body))):
            started = time.perf_counter()
            send()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def http_ttft(http: httpx.Client, server: Server, prompt: list[int]) -> tuple[float, list[float]]:
    """The time to the first streamed token, and to the response's headers (the request read and
    queued: the server sends them before the first token)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    with http.stream("POST", server.url + "/v1/completions", json=body) as reply:
        headers = time.perf_counter() - started
        for line in reply.iter_lines():
            if line.startswith('data: {"id"'):
                return time.perf_counter() - started, [headers]
    raise RuntimeError("no token came")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="default: a tiny random-weight llama GGUF (llama "
                        "engine), the embedded SmolLM2's folder (MLX engine)")
    parser.add_argument("--engine", choices=["llama", "mlx"], default="llama")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--against", type=Path, help="a src/ folder whose server joins the rotation")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="server-ttft-"))
    if args.model:
        model = args.model
    elif args.engine == "llama":
        model = str(tiny_model(logs))
    else:
        from mesh_llm.models import default_mlx_folder

        model = str(default_mlx_folder())
    rng = random.Random(7)
    times: dict[str, list[float]] = {"engine": [], "server": []}
    parts: dict[str, list[list[float]]] = {"engine": [], "server": []}  # steps' times; headers' time
    flags = ["--engine", args.engine, "--threads", "1", "--ctx-size", str(CONTEXT), "--cache-bytes", "0"]
    with ExitStack() as stack:
        servers = {"server": serve(stack, "server", model, logs, flags)}
        if args.against:
            servers["against"] = serve(stack, "against", model, logs, flags, args.against.resolve())
            times["against"], parts["against"] = [], []
        engine = engine_class(args.engine).load(Path(model), EngineOptions(ctx_size=CONTEXT, threads=1,
                                                                          cache_bytes=0))
        stack.callback(engine.close)
        vocab = engine.tokenizer.vocab_size
        budget = IDLE_PREFILL_STEPS * prefill_budget(engine.info())
        http = stack.enter_context(httpx.Client(timeout=120))
        ways = [("engine", lambda p: raw_ttft(engine, p, budget))]
        ways += [(name, lambda p, s=s: http_ttft(http, s, p)) for name, s in servers.items()]
        orders = list(itertools.permutations(ways))  # each way in each place as often
        for k in range(args.requests + 2):  # the first two rounds warm every way up
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            for name, measure in orders[k % len(orders)]:
                ttft, part = measure(prompt)
                if k >= 2:
                    times[name].append(ttft)
                    parts[name].append(part)
        trips = {name: round_trips(http, s, prompt) for name, s in servers.items()}
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    adds = ", ".join(f"{name} {medians[name]:.2f} ms (adds {medians[name] - medians['engine']:.2f})"
                     for name in servers)
    print(f"{args.engine}: TTFT median over {args.requests} requests of {args.prompt_tokens} tokens: engine "
          f"{medians['engine']:.2f} ms, {adds}")
    steps = [f"{1000 * statistics.median(p[i] for p in parts['engine'] if len(p) > i):.2f}"
             for i in range(max(map(len, parts["engine"])))]
    headers = ", ".join(f"{name} {1000 * statistics.median(p[0] for p in parts[name]):.2f}" for name in servers)
    print(f"  engine steps (median ms): {' + '.join(steps)}; response headers (median ms): {headers}")
    print("  round trips (median ms): " + ", ".join(
        f"{name} GET /health {1000 * t['health']:.2f}, refused completion {1000 * t['refused']:.2f}"
        for name, t in trips.items()))
    write(args.out, args, medians_ms=medians, ttft_s=times, parts_s=parts, round_trips_s=trips)
    if args.out:  # the servers' logs (MESH_LLM_LOG_LEVEL=debug: each request's queue wait and steps)
        shutil.copytree(logs, args.out.with_suffix(".logs"), dirs_exist_ok=True)


if __name__ == "__main__":
    main()
