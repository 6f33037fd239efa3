"""Servers of this checkout and of another ``src/`` folder, measured round by round in alternating
order, and the results written as JSON: what ``loop_cpu.py``, ``tokenize_stall.py`` and
``server_ttft.py`` share. Not a benchmark itself."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from mesh_llm.bench.backends import Backend, Server, Settings
from mesh_llm.bench.environment import describe


def add_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--against", type=Path, help="a src/ folder to compare with, alternated")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")


def serve(stack: ExitStack, name: str, model: str, logs: Path, flags: list[str],
          pythonpath: Path | None = None) -> Server:
    """``mesh-llm serve -m MODEL --alias bench FLAGS`` on this checkout's code or on ``pythonpath``
    (ahead of the caller's path, which may hold the server's dependencies), stopped with ``stack``."""
    def argv(_model: Path, port: int, _settings: Settings) -> list[str]:
        path = os.pathsep.join(p for p in (str(pythonpath), os.environ.get("PYTHONPATH")) if p)
        python = [sys.executable] if pythonpath is None else ["env", f"PYTHONPATH={path}", sys.executable]
        return [*python, "-m", "mesh_llm", "serve", "-m", model, "--alias", "bench", *flags,
                "--port", str(port)]

    server = Server(Backend(name, "gguf", "ignore_eos", argv, model_id="bench"), Path(model),
                    Settings(threads=1, ctx_size=2048, startup_timeout=600), logs / f"{name}.log")
    server.start()
    stack.callback(server.stop)
    server.wait_ready()
    return server


def servers(stack: ExitStack, model: str, logs: Path, flags: list[str],
            against: Path | None) -> dict[str, Server]:
    """"this" checkout's server, and "against" one on the ``src/`` folder ``against`` if given."""
    started = {"this": serve(stack, "this", model, logs, flags)}
    if against:
        started["against"] = serve(stack, "against", model, logs, flags, against.resolve())
    return started


def alternate(started: dict[str, Server], rounds: int, measure: Callable[[Server], dict],
              show: Callable[[dict], str]) -> dict[str, list[dict]]:
    """``rounds`` rounds of ``measure`` on each server, the order reversed every other round."""
    results: dict[str, list[dict]] = {}
    for r in range(rounds):
        for name in list(started)[::1 if r % 2 == 0 else -1]:
            m = measure(started[name])
            results.setdefault(name, []).append(m)
            print(f"round {r + 1} {name:8} {show(m)}", flush=True)
    return results


def compare(args: argparse.Namespace, model: str, flags: list[str], measure: Callable[[Server], dict],
            show: Callable[[dict], str]) -> None:
    """This checkout's server (and ``--against``'s) on ``model`` with ``flags``, measured in
    ``--rounds`` alternating rounds, the results written to ``--out``."""
    logs = Path(tempfile.mkdtemp(prefix="alternate-"))
    with ExitStack() as stack:
        results = alternate(servers(stack, model, logs, flags, args.against), args.rounds, measure, show)
    write(args.out, args, results=results)


def write(path: Path | None, args: argparse.Namespace, **payload) -> None:
    """The run's settings, this machine and ``payload`` as JSON at ``path`` (None: nowhere)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"settings": {k: str(v) for k, v in vars(args).items()}, "environment": describe(None), **payload}
    path.write_text(json.dumps(body, indent=2) + "\n")
