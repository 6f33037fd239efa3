"""What each streamed token costs the serving node and an API-only node relaying it, in CPU time.

    .venv/bin/python benchmarks/hop_cpu.py [GGUF] [--seconds 12] [--threads 1]

Starts a serving node on GGUF (``--alias bench``; default: a tiny random-weight llama written by
``tests/tiny_gguf.py``, with a chat template) and an API-only node joined to it (``--client``),
as ``benchmarks/mesh.py`` does, then streams chat completions of 400 tokens (EOS ignored), back to
back for ``--seconds``, first straight to the serving node, then through the other one: tokens a
second, and each process's CPU time per token. The tiny model makes the server's own per-token
work show; the figures in README's "API" came from it with one llama.cpp thread.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from mesh import cpu_seconds, node, stream  # benchmarks/, the script's own folder

from mesh_llm.bench.backends import Server, Settings

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def tiny_model(folder: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(folder / "tiny.gguf", "llama", chat_template=TEMPLATE)


def stream_for(server: Server, seconds: float) -> int:
    """Streams back to back until ``seconds`` have passed; the tokens received."""
    body = {"model": "bench", "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    until, tokens = time.perf_counter() + seconds, 0
    while time.perf_counter() < until:
        tokens += stream(server, body)["completion_tokens"]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", help="default: a tiny random-weight llama")
    parser.add_argument("--seconds", type=float, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    settings = Settings(threads=args.threads, ctx_size=2048, startup_timeout=600)
    token, logs = secrets.token_urlsafe(24), Path(tempfile.mkdtemp(prefix="hop-cpu-"))
    gguf = args.gguf or str(tiny_model(logs))
    with ExitStack() as stack:
        serving = node(stack, settings, logs, token, "serving", ["-m", gguf, "--alias", "bench"])
        entry = node(stack, settings, logs, token, "entry", ["--client", "--join", serving.url], "bench")
        stream_for(entry, 2)  # warm: caches, connections
        for label, server in (("direct", serving), ("one hop", entry)):
            cpu = (cpu_seconds(serving), cpu_seconds(entry))
            start = time.perf_counter()
            tokens = stream_for(server, args.seconds)
            elapsed = time.perf_counter() - start
            used = (cpu_seconds(serving) - cpu[0], cpu_seconds(entry) - cpu[1])
            print(f"{label:8} {tokens / elapsed:7.0f} tokens/s; CPU a token: serving node "
                  f"{1e6 * used[0] / tokens:5.0f} µs, API-only node {1e6 * used[1] / tokens:4.0f} µs")


if __name__ == "__main__":
    main()
