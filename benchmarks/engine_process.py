"""The bound on an engine in its own process (GPU.md, "Next on a GPU (twenty-third session's end)"):
8 streams through the server as it is (the worker a thread beside the event loop, one GIL), and
through the same app whose model worker runs in a child process (chunks pickled across a pipe),
alternated round by round. An experiment, not the feature: the child serves streamed
``/v1/completions`` on token ids only (no constraints, no chat), enough to measure the streams.

    .venv/bin/python benchmarks/engine_process.py MLX_FOLDER [--rounds 4] [--streams 8]
        [--prompt-tokens 640] [--tokens 256]

Reports each round's chunks a second (the clients' view) for both ways, and their medians. Not a
test.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import random
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import uvicorn
from alternate import alternate  # benchmarks/, the script's own folder

from mesh_llm.api.app import ServedModel, create_app
from mesh_llm.engines.base import EngineOptions
from mesh_llm.engines.hf_tokenizer import HFTokenizer
from mesh_llm.engines.mlx import MLXEngine
from mesh_llm.runtime.worker import Generation, ModelWorker
from mesh_llm.serve import bind


def _load(folder: str, threads: int) -> MLXEngine:
    options = EngineOptions(ctx_size=2048, max_batch=8, cache_bytes=0, threads=threads or None)
    return MLXEngine.load(Path(folder), options)


def _child(conn, folder: str, threads: int) -> None:
    """The engine's process: a real ModelWorker; jobs come down the pipe, chunks go back up."""
    worker = ModelWorker("child", lambda: _load(folder, threads))
    worker.start()
    worker.wait_ready()
    conn.send(worker.info)
    cancels = {}
    while (msg := conn.recv()) is not None:
        kind, job = msg[0], msg[1]
        if kind == "submit":
            cancels[job] = worker.submit(msg[2], lambda chunk, job=job: conn.send((job, chunk)))
        elif job in cancels:
            cancels.pop(job)()
    worker.stop()
    os._exit(0)  # as `mesh-llm serve` does: MLX can abort in exit-time destructors


class ProcessWorker:
    """What the API asks of a worker, with the worker in a child process."""

    def __init__(self, folder: str, threads: int):
        self.name = "process"
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, folder, threads), daemon=True)
        self._proc.start()
        self.info = self._conn.recv()
        self.tokenizer = HFTokenizer.from_folder(Path(folder))
        self.ready = True
        self._ids = itertools.count()
        self._delivers: dict[int, object] = {}
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                job, chunk = self._conn.recv()
            except EOFError:  # the child has stopped
                return
            deliver = self._delivers.get(job)
            if deliver is not None:
                deliver(chunk)
                if chunk.finish_reason is not None:
                    self._delivers.pop(job, None)

    def submit(self, request, deliver, handover=None):
        job = next(self._ids)
        self._delivers[job] = deliver
        with self._send_lock:
            self._conn.send(("submit", job, request))

        def cancel() -> None:
            if self._delivers.pop(job, None) is not None:
                with self._send_lock:
                    self._conn.send(("cancel", job))

        return cancel

    def open(self, request) -> Generation:
        return Generation(self, request)

    def load(self) -> dict:
        return {"active": 0, "waiting": 0, "max_batch": 8}

    def cache_stats(self) -> dict:
        return {}

    def stop(self) -> None:
        with self._send_lock:
            self._conn.send(None)
        self._proc.join(10)


def _serve(worker) -> tuple[uvicorn.Server, str]:
    app = create_app([ServedModel("bench", worker, "safetensors", int(time.time()))])
    sock = bind("127.0.0.1", 0)  # as the server binds: a TCP socket, so asyncio turns Nagle off
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"


def _round(url: str, streams: int, prompt_tokens: int, tokens: int, vocab: int, seed: int) -> float:
    counts = [0] * streams

    def one(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        body = {"model": "bench", "prompt": [rng.randrange(3, vocab) for _ in range(prompt_tokens)],
                "max_tokens": tokens, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=300) as client, client.stream("POST", url, json=body) as r:
            counts[i] = sum(line.startswith("data: {") for line in r.iter_lines())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=640)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="the engine's threads (0: physical cores)")
    args = parser.parse_args()
    thread_worker = ModelWorker("thread", lambda: _load(args.folder, args.threads))
    thread_worker.start()
    thread_worker.wait_ready()
    process_worker = ProcessWorker(args.folder, args.threads)
    ways = {"thread": _serve(thread_worker), "process": _serve(process_worker)}
    urls = {name: url for name, (_, url) in ways.items()}
    vocab = process_worker.tokenizer.vocab_size
    # the clients in a process of their own: in this one they would share the servers' GIL
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    calls = itertools.count()

    def measure(url: str) -> dict:
        seed = next(calls) // len(urls)  # both ways of a round get the same prompts
        return {"chunks_s": clients.submit(_round, url, args.streams, args.prompt_tokens, args.tokens,
                                           vocab, seed).result()}

    for url in urls.values():  # warm both up
        measure(url)
    results = alternate(urls, args.rounds, measure, lambda m: f"{m['chunks_s']:.0f} chunks/s")
    for name, runs in results.items():
        r = [m["chunks_s"] for m in runs]
        print(f"{name}: median {statistics.median(r):.0f} chunks/s over {len(r)} rounds "
              f"({', '.join(f'{x:.0f}' for x in r)})")
    clients.shutdown()
    for server, _ in ways.values():
        server.should_exit = True
    thread_worker.stop()
    process_worker.stop()
    os._exit(0)  # as `mesh-llm serve` does: MLX can abort in exit-time destructors


if __name__ == "__main__":
    main()
