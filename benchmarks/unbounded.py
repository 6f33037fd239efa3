"""Requests without ``max_tokens`` sent together, where the memory holds one whole context's KV (twice)
but not two: decoded together, or one after the other?

    .venv/bin/python benchmarks/unbounded.py [--requests 4] [--ctx-size 131072] [--rounds 2]
        [--against SRC] [--out FILE]

A server on the MLX engine (the embedded SmolLM2, float32 on a CPU) with a context so large that
one sequence's whole KV, counted twice as the engine counts it, takes most of the engine's memory
share: on a machine with 24 GB free, 131,072 tokens at 46 KB a token (12.1 GB of the 18.5 GB
share). That is where ``fit_context`` puts the context of a large model on a small Mac. Sends
``--requests`` streamed chat completions at once, none with ``max_tokens``, greedy, each answered
until the model's end of turn. Reports each request's first token and end, the summed completion
tokens over the wall time, and how many streams were ever decoding at once. ``--against SRC``
alternates with a server on another ``src/`` folder (a copy from before a change). Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx
from alternate import add_arguments, compare  # benchmarks/, the script's own folder

from mesh_llm.bench.backends import Server
from mesh_llm.models import default_mlx_folder

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colours.",
    "What does a compiler do? Keep it brief.",
    "Why is the sky blue? Two sentences.",
    "Write a haiku about autumn.",
    "List five prime numbers.",
    "What is photosynthesis? One sentence.",
    "Give one tip for learning a new language.",
]


def stream(server: Server, question: str, start: float, out: dict) -> None:
    """One streamed chat completion without max_tokens; its first token's and its end's times (s
    after ``start``) and its completion tokens."""
    body = {"model": "bench", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first = None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=1200) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
    out.update(first_s=first, end_s=time.perf_counter() - start)


def together(server: Server, n: int) -> dict:
    """``n`` requests sent at once."""
    results = [{} for _ in range(n)]
    start = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(server, QUESTIONS[i % len(QUESTIONS)], start, out))
               for i, out in enumerate(results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end_s"] for r in results)
    events = sorted([(r["first_s"], 1) for r in results] + [(r["end_s"], -1) for r in results])
    running, most = 0, 0
    for _, change in events:
        running += change
        most = max(most, running)
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "summed_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_s": statistics.median(r["first_s"] for r in results),
            "ttft_max_s": max(r["first_s"] for r in results), "most_at_once": most, "requests": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--ctx-size", type=int, default=131072)
    add_arguments(parser, rounds=2)
    args = parser.parse_args()
    compare(args, str(default_mlx_folder()), ["--engine", "mlx", "--ctx-size", str(args.ctx_size)],
            lambda server: together(server, args.requests),
            lambda m: f"{m['tokens']} tokens in {m['wall_s']:.1f} s ({m['summed_tok_s']:.1f} tok/s), first "
                      f"token p50 {m['ttft_p50_s']:.2f} s, last {m['ttft_max_s']:.2f} s, at most "
                      f"{m['most_at_once']} at once")


if __name__ == "__main__":
    main()
