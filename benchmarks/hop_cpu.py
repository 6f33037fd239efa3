"""What each streamed token costs the serving node and an API-only node relaying it, in CPU time.

    .venv/bin/python benchmarks/hop_cpu.py GGUF [--seconds 12] [--threads 1]

Starts a serving node on GGUF (``--alias bench``) and an API-only node joined to it (``--client``),
then streams chat completions of 400 tokens (EOS ignored), back to back for ``--seconds``, first
straight to the serving node, then through the other one: tokens a second, and each process's CPU
time (user + system, from /proc) per token. A tiny GGUF (``tests/tiny_gguf.py``) makes the server's
own per-token work show; the figures in README's "API" came from it with one llama.cpp thread.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

MESH_LLM = str(Path(sys.executable).with_name("mesh-llm"))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(check, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not come up")


def stream_for(url: str, seconds: float) -> int:
    """Streams back to back until ``seconds`` have passed; the tokens received."""
    body = {"model": "bench", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    until, tokens = time.perf_counter() + seconds, 0
    while time.perf_counter() < until:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as reply:
            tokens += sum(1 for line in reply.iter_lines() if line.startswith("data:") and "content" in line)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--seconds", type=float, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=9501)
    args = parser.parse_args()
    token = secrets.token_hex(16)
    serving_url, entry_url = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    procs = []
    try:
        serving = subprocess.Popen([MESH_LLM, "serve", "-m", args.gguf, "--alias", "bench", "--port", str(args.port),
                                    "--threads", str(args.threads), "--node-name", "serving", "--mesh-token", token],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(serving)
        wait_for(lambda: httpx.get(serving_url + "/health").status_code == 200, "the serving node")
        entry = subprocess.Popen([MESH_LLM, "serve", "--client", "--join", serving_url, "--port", str(args.port + 1),
                                  "--node-name", "entry", "--mesh-token", token], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(entry)
        wait_for(lambda: any(m["id"] == "bench" for m in httpx.get(entry_url + "/v1/models").json()["data"]),
                 "the API-only node")
        stream_for(entry_url, 2)  # warm: caches, connections
        for label, url in (("direct", serving_url), ("one hop", entry_url)):
            cpu = (cpu_seconds(serving.pid), cpu_seconds(entry.pid))
            start = time.perf_counter()
            tokens = stream_for(url, args.seconds)
            elapsed = time.perf_counter() - start
            used = (cpu_seconds(serving.pid) - cpu[0], cpu_seconds(entry.pid) - cpu[1])
            print(f"{label:8} {tokens / elapsed:7.0f} tokens/s; CPU a token: serving node {1e6 * used[0] / tokens:5.0f} µs, "
                  f"API-only node {1e6 * used[1] / tokens:4.0f} µs")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            proc.wait(30)


if __name__ == "__main__":
    main()
