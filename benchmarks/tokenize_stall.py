"""How long a running stream stands still while another client's long prompt is tokenized.

    .venv/bin/python benchmarks/tokenize_stall.py [--kb 600] [--rounds 3] [--against SRC] [--out FILE]

A server on the MLX engine (the embedded SmolLM2 imported as a safetensors folder, so the Hugging
Face tokenizer) streams a 160-token answer; halfway, another client sends a completion whose prompt
is ``--kb`` KB of text (over the context once tokenized, so it is refused after tokenizing, as a
too-long paste would be). Reports the stream's longest gap between two tokens against its median
gap. ``--against SRC`` starts a second server on another ``src/`` folder (a copy from before a
change) and alternates the two. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx
from alternate import add_arguments, compare  # benchmarks/, the script's own folder

from mesh_llm.bench.backends import Server
from mesh_llm.models import default_mlx_folder


def round_trip(server: Server, text: str) -> dict:
    """One stream, and the long prompt sent once it has 40 tokens; the stream's token times."""
    times: list[float] = []
    sent = threading.Event()
    refused: dict = {}

    def paste() -> None:
        sent.wait()
        started = time.perf_counter()
        reply = httpx.post(server.url + "/v1/completions", timeout=600,
                           json={"model": "bench", "prompt": text, "max_tokens": 4})
        refused.update(status=reply.status_code, seconds=time.perf_counter() - started)

    other = threading.Thread(target=paste)
    other.start()
    body = {"model": "bench", "prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith('data: {"id"'):
                times.append(time.perf_counter())
                if len(times) == 40:
                    sent.set()
    sent.set()
    other.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"longest_gap_ms": 1000 * max(gaps), "median_gap_ms": 1000 * statistics.median(gaps),
            "paste_status": refused.get("status"), "paste_s": refused.get("seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kb", type=int, default=600)
    add_arguments(parser, rounds=3)
    args = parser.parse_args()
    sentence = "The quick brown fox jumps over the lazy dog; the compiler reads every token. "
    text = sentence * (args.kb * 1000 // len(sentence))
    compare(args, str(default_mlx_folder()), ["--engine", "mlx"], lambda server: round_trip(server, text),
            lambda m: f"longest gap {m['longest_gap_ms']:6.0f} ms, median {m['median_gap_ms']:5.0f} ms; "
                      f"the paste: {m['paste_status']} after {m['paste_s']:.2f} s")


if __name__ == "__main__":
    main()
