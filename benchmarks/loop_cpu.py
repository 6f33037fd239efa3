"""What each streamed token costs the server's event loop, in CPU time, with many streams at once.

    .venv/bin/python benchmarks/loop_cpu.py [GGUF] [--streams 8] [--seconds 10] [--rounds 3]
                                            [--against SRC] [--out FILE]

On the H200 the event loop held the GIL for about 1.2 s of an 8-stream run (~6,000 tokens, some
200 us a token; benchmarks/results/h200-20261204f/gil/), time in which the worker cannot build its
next decode step. This counts the CPU time of the server's main thread (uvicorn's event loop: the
API layer, the SSE framing, the sockets) per streamed token, and of the rest of the process (the
worker and llama.cpp), on a tiny random-weight GGUF whose own compute is small so the server's work
shows. ``--against SRC`` starts a second server on another ``src/`` folder (a copy from before a
change) and alternates the two, round by round, so both see the same machine. Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from alternate import add_arguments, alternate, servers, write  # benchmarks/, the script's own folder
from hop_cpu import tiny_model

from mesh_llm.bench.backends import Server

BODY = {"model": "bench", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": "Tell me a story."}]}


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of the process's main thread, and of all its threads."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    return of(Path(f"/proc/{pid}/task/{pid}/stat")), of(Path(f"/proc/{pid}/stat"))


def streams(server: Server, n: int, seconds: float) -> int:
    """``n`` clients streaming back to back until ``seconds`` have passed; the SSE events received
    with content (one per token for this model and prompt)."""
    counts, until = [0] * n, time.perf_counter() + seconds

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            while time.perf_counter() < until:
                with http.stream("POST", server.url + "/v1/chat/completions", json=BODY) as reply:
                    reply.raise_for_status()
                    for line in reply.iter_lines():
                        if line.startswith('data: {"id"') and '"content":"' in line:
                            counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def measure(server: Server, n: int, seconds: float) -> dict:
    main0, all0 = thread_cpu(server.proc.pid)
    started = time.perf_counter()
    tokens = streams(server, n, seconds)
    elapsed = time.perf_counter() - started
    main1, all1 = thread_cpu(server.proc.pid)
    return {"tokens": tokens, "tokens_per_s": tokens / elapsed, "loop_us": 1e6 * (main1 - main0) / tokens,
            "rest_us": 1e6 * ((all1 - all0) - (main1 - main0)) / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", help="default: a tiny random-weight llama")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10)
    add_arguments(parser, rounds=3)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="loop-cpu-"))
    gguf = args.gguf or str(tiny_model(logs))
    with ExitStack() as stack:
        started = servers(stack, gguf, logs, ["--engine", "llama", "--threads", "1", "--ctx-size", "2048"],
                          args.against)
        for server in started.values():
            streams(server, args.streams, 2)  # warm: connections, caches
        results = alternate(started, args.rounds, lambda server: measure(server, args.streams, args.seconds),
                            lambda m: f"{m['tokens_per_s']:7.0f} tokens/s; CPU a token: event loop "
                                      f"{m['loop_us']:5.1f} us, rest {m['rest_us']:5.1f} us")
    print()
    for name, runs in results.items():
        print(f"{name:8} median: event loop {statistics.median(r['loop_us'] for r in runs):5.1f} us a token, "
              f"rest {statistics.median(r['rest_us'] for r in runs):5.1f} us, "
              f"{statistics.median(r['tokens_per_s'] for r in runs):6.0f} tokens/s")
    write(args.out, args, results=results)


if __name__ == "__main__":
    main()
