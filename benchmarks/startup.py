"""How long `mesh-llm serve` takes to start, as a user sees it: from the command to the port
answering, to `/health` ok, and to the first streamed token and the end of a first short request
(and to the notice of a restart for MLX, where there is one: ``mesh_llm/system/native.py``).

    .venv/bin/python benchmarks/startup.py [--runs 3] [--label NAME] [--out FILE.jsonl] -- SERVE ARGS
        (e.g. -- --engine mlx --model DIR --max-batch 8)

Each run is a fresh process (SIGINT at the end), so on a GPU the second and later runs find MLX's
compiled kernels on disk, as a restart does. `mesh-llm bench` reports the port answering and the
first completion too, but only for the settings of its concurrency levels; this isolates the start.
Prints a table; ``--out`` appends one JSON line a run (``benchmarks/history.py add`` reads it).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(serve_args: list[str], timeout: float) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mesh_llm", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *serve_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marks: dict = {}
    lines: list[str] = []

    def read_log() -> None:  # the log as it comes, so that the restart's notice gets its time
        for line in proc.stderr:
            if "starting again" in line:
                marks.setdefault("restart_notice_s", time.perf_counter() - started)
            lines.append(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        with httpx.Client(timeout=5) as client:
            while "ok_s" not in marks:
                if proc.poll() is not None:
                    reader.join(5)
                    raise RuntimeError(f"serve exited with {proc.returncode}: {''.join(lines)[-2000:]}")
                if time.perf_counter() - started > timeout:
                    raise RuntimeError(f"not ready within {timeout:.0f} s")
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        marks["ok_s"] = time.perf_counter() - started
                    marks.setdefault("listening_s", time.perf_counter() - started)
                except httpx.TransportError:
                    time.sleep(0.01)
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8, "temperature": 0, "stream": True}
            sent = time.perf_counter()
            with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and "first_token_s" not in marks:
                        marks["first_token_s"] = time.perf_counter() - started
                        marks["first_ttft_ms"] = 1000 * (time.perf_counter() - sent)
            marks["first_done_s"] = time.perf_counter() - started
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(5)
    phases = [line.split("warm-up phases:", 1)[1].strip() for line in lines if "warm-up phases:" in line]
    return {**{k: round(v, 3 if k.endswith("_s") else 1) for k, v in marks.items()},
            "warm_up_phases": phases[0] if phases else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, help="append one JSON line a run to this file")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    label = args.label or " ".join(serve_args)
    print(f"| {label} | restart's notice s | port answers s | /health ok s | first token s | first request ends s "
          f"| its TTFT ms | warm-up phases |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in range(1, args.runs + 1):
        m = one_start(serve_args, args.timeout)
        print(f"| run {run} | {m.get('restart_notice_s', '-')} | {m['listening_s']} | {m['ok_s']} | {m['first_token_s']} | {m['first_done_s']} "
              f"| {m['first_ttft_ms']} | {m['warm_up_phases']} |", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps({"label": label, "run": run, "serve_args": serve_args, **m}) + "\n")


if __name__ == "__main__":
    main()
