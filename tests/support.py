"""Test helpers shared by several folders: real `mesh-llm serve` processes on free loopback ports, which
die with the test process however it ends (``mesh_llm.children``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mesh_llm import children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A real `mesh-llm serve` process; ``log`` holds everything it printed."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_errors(*args: str) -> list[str]:
    """The ``error:`` lines of a `mesh-llm serve ARGS` that must refuse to start (exit status 2)."""
    result = children.run([sys.executable, "-m", "mesh_llm", "serve", *args, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def start_server(args: list[str], log: Path, env: dict | None = None, timeout: float = 300,
                 port: int | None = None) -> Server:
    port = port or free_port()
    cmd = [sys.executable, "-m", "mesh_llm", "serve", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = children.popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(proc, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{server.output()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server not healthy after {timeout}s:\n{server.output()}")


def live_children(parent: int) -> dict[int, str]:
    """Processes whose parent is ``parent`` and that still run (zombies excluded): pid -> command line."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent and fields[0] != "Z":
                cmdline = (stat.parent / "cmdline").read_bytes()
                found[int(stat.parent.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            pass  # it exited while we looked
    return found


def run_until_eos(engine, prompt, limit=40) -> tuple[list[int], int]:
    """Greedy answer without its end-of-turn token, and the first step's cached_tokens."""
    from mesh_llm.engines.base import SamplingParams

    gen = engine.generate(prompt, SamplingParams(temperature=0.0))
    tokens, cached = [], None
    for step in gen:
        cached = step.cached_tokens if cached is None else cached
        if step.token in engine.tokenizer.eos_token_ids:
            break
        tokens.append(step.token)
        assert len(tokens) < limit, "no end-of-turn token"
    gen.close()
    return tokens, cached


def processes_using(path: Path) -> list[str]:
    """The command lines of running processes that name ``path`` (servers a test should have stopped)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in text:
            found.append(text)
    return found
