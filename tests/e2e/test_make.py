"""The README's first command, run as written: `make serve` serves the embedded model on
http://127.0.0.1:9337/v1 (here on a free port through ARGS). It runs in this checkout, whose .venv
`make test` has just set up through the same `install` target: a fresh clone is what CI starts from,
so setting up a second virtualenv here would prove nothing more."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from mesh_llm import children
from support import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_make_serve_answers_on_the_embedded_model(tmp_path):
    port = free_port()
    log = open(tmp_path / "make.log", "wb")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = children.popen(["make", "serve", f"ARGS=--port {port}"], cwd=ROOT, stdout=log,
                          stderr=subprocess.STDOUT, env=env, whole_group=True)  # make starts the server
    try:
        deadline = time.monotonic() + 600  # an install the Makefile finds stale runs first
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "make.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 20,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]})
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        assert (ROOT / ".venv" / "bin" / "mesh-llm").exists()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
