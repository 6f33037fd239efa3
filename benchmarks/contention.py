"""mesh-llm on a CPU that other work shares: streams' speed and token gaps with and without a busy
loop on every core, and what a long prompt arriving does to streams already running.

    .venv/bin/python benchmarks/contention.py [--engine llama|mlx] [--threads 1,2] [--load none,busy]
        [--streams 4] [--tokens 64] [--long-prompt 1500] [--src DIR] [--out FILE.json]

Each (threads, load) pair is a fresh `mesh-llm serve` on the embedded model (``--src DIR``: run the
mesh_llm package found under DIR instead, to compare an older tree). Two measurements a server:
``streams``: N streams at once, summed tok/s and the median and longest gap between tokens;
``long prompt``: two streams running when a prompt of ``--long-prompt`` words arrives, the streams'
longest gap while it is read and its time to first token.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spin() -> None:
    while True:
        pass


def serve(engine: str, threads: int, src: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, **({"PYTHONPATH": src} if src else {}))
    proc = subprocess.Popen([sys.executable, "-m", "mesh_llm", "serve", "--engine", engine, "--threads",
                             str(threads), "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("not ready in 300 s")


def stream(url: str, model: str, prompt: str, tokens: int, out: dict) -> None:
    """One streamed completion: the arrival time of each chunk that carries text."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    out["sent"], times = time.perf_counter(), []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    out["times"] = times


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def run_streams(url: str, model: str, n: int, tokens: int) -> dict:
    outs = [{} for _ in range(n)]
    threads = [threading.Thread(target=stream, args=(url, model, f"Story {i}: once upon a time", tokens, o))
               for i, o in enumerate(outs)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    all_gaps = [g for o in outs for g in gaps(o["times"])]
    return {"tok_s": sum(len(o["times"]) for o in outs) / wall, "gap_p50_ms": 1000 * statistics.median(all_gaps),
            "gap_max_ms": 1000 * max(all_gaps)}


def run_long_prompt(url: str, model: str, words: int, tokens: int) -> dict:
    running = [{} for _ in range(2)]
    threads = [threading.Thread(target=stream, args=(url, model, f"Tale {i}: it was", 4 * tokens, o))
               for i, o in enumerate(running)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    long: dict = {}
    stream(url, model, "word " * words, 1, long)
    reading = (long["sent"], long["times"][0] if long["times"] else time.perf_counter())
    for t in threads:
        t.join()
    during = [b - a for o in running for a, b in itertools.pairwise(o["times"]) if b > reading[0] and a < reading[1]]
    return {"long_ttft_s": reading[1] - reading[0], "gap_max_during_ms": 1000 * max(during, default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="llama", choices=["llama", "mlx"])
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}", help="comma-separated --threads values")
    ap.add_argument("--load", default="none,busy", help="none, busy (a spinning process a core), or both")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=1500, help="words of the prompt that arrives (0: skip)")
    ap.add_argument("--src", help="a source tree whose mesh_llm package to serve (PYTHONPATH)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for load in args.load.split(","):
            proc, url = serve(args.engine, threads, args.src)
            spinners = [multiprocessing.Process(target=spin, daemon=True)
                        for _ in range(os.cpu_count() if load == "busy" else 0)]
            try:
                model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                run_streams(url, model, 1, 8)  # warm
                for p in spinners:
                    p.start()
                row = {"engine": args.engine, "threads": threads, "load": load, "src": args.src or "this tree",
                       **run_streams(url, model, args.streams, args.tokens),
                       **(run_long_prompt(url, model, args.long_prompt, args.tokens) if args.long_prompt
                          else {"long_ttft_s": 0.0, "gap_max_during_ms": 0.0})}
            finally:
                for p in spinners:
                    p.kill()
                proc.terminate()
                proc.wait(30)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| engine | threads | load | {args.streams} streams tok/s | gap p50 ms | gap max ms | long prompt TTFT s "
          "| streams' longest gap meanwhile ms |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['engine']} | {r['threads']} | {r['load']} | {r['tok_s']:.1f} | {r['gap_p50_ms']:.0f} | "
              f"{r['gap_max_ms']:.0f} | {r['long_ttft_s']:.1f} | {r['gap_max_during_ms']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
