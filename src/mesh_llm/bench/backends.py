"""The servers under test: how each is started on the same model files, probed, and stopped.

Every backend is its own process (a new session, so a Ctrl-C at the harness does not reach it, and
killed with the harness if the harness dies: ``mesh_llm.children``), started on a free loopback port
with the same thread count and context size, and stopped by its own process id: SIGINT, then SIGKILL
after a grace period. Flags are those of the installed packages:
``mlx_lm/server.py`` (mlx-lm 0.32), ``llama_cpp/server/settings.py`` (llama-cpp-python 0.3) and
llama.cpp's ``llama-server`` (``common/arg.cpp``).

With ``Settings.concurrency`` set (``mesh-llm bench --concurrency``), a server that has a setting
for how many requests it decodes at once is configured for that many: llama-server ``-np N`` with
``-c`` = N x the context (each slot gets the context), mlx_lm.server ``--decode-concurrency N``,
mesh-llm ``--max-batch N`` where this mesh-llm has it. llama_cpp.server has none (one request at a
time) and is started with ``--interrupt_requests false``: by default it ends a stream early whenever
another request is waiting.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mesh_llm import children
from mesh_llm.system import native

# mlx_lm.server with OpenBLAS interposed the way mesh-llm does it on Linux, so that the comparison
# is of servers, not of BLAS libraries. Elsewhere (macOS, CUDA) ensure_fast_blas() changes nothing.
_MLX_LM_FAST_BLAS = (
    "import runpy, sys\n"
    "from mesh_llm.system.blas import ensure_fast_blas\n"
    "print('bench: mlx blas =', ensure_fast_blas(), file=sys.stderr, flush=True)\n"
    "sys.argv = ['mlx_lm.server', *sys.argv[1:]]\n"
    "runpy.run_module('mlx_lm.server', run_name='__main__')\n"
)


@dataclass(frozen=True)
class Settings:
    """What every backend gets alike."""

    threads: int
    ctx_size: int
    llama_server: Path | None = None  # llama.cpp's own server binary, when given
    startup_timeout: float = 900.0
    concurrency: int | None = None  # streams at once (--concurrency); None: the single-stream matrix


@dataclass(frozen=True)
class Backend:
    """``serves``: which file of a model pair it loads ("mlx" folder or "gguf"). ``eos``: how a
    request asks it for exactly ``max_tokens`` tokens (None: it cannot; the count is what it gave)."""

    name: str
    serves: str
    eos: str | None
    argv: Callable[[Path, int, Settings], list[str]]
    model_id: str | None = None  # the request's "model"; None: the first id /v1/models lists

    def command(self, settings: Settings) -> str:
        """The command line, for the report: MODEL and PORT stand for the model file and the port."""
        argv = self.argv(Path("MODEL"), 0, settings)
        shown = {sys.executable: "python", _MLX_LM_FAST_BLAS: "'<ensure_fast_blas(); run mlx_lm.server>'"}
        words = [shown.get(a, a) for a in argv]
        words[argv.index("--port") + 1] = "PORT"
        return " ".join(words)

    def restarts_per_level(self, settings: Settings) -> bool:
        """Whether its command line depends on the number of streams: then ``--concurrency`` starts it
        anew for each level, configured for it; otherwise once for all levels."""
        def argv(n: int) -> list[str]:
            return self.argv(Path("MODEL"), 0, replace(settings, concurrency=n))
        return argv(1) != argv(2)

    def eos_fields(self, max_tokens: int, eos_ids: list[int]) -> dict:
        if self.eos == "ignore_eos":
            return {"ignore_eos": True}
        if self.eos == "min_tokens":
            return {"min_tokens": max_tokens}
        if self.eos == "logit_bias":
            return {"logit_bias": {str(i): -1e9 for i in eos_ids}}
        return {}


def _mesh(engine: str):
    def argv(model: Path, port: int, s: Settings) -> list[str]:
        batch = ["--max-batch", str(s.concurrency)] if s.concurrency and mesh_takes_max_batch() else []
        return [sys.executable, "-m", "mesh_llm", "serve", "--model", str(model), "--engine", engine,
                "--host", "127.0.0.1", "--port", str(port), "--threads", str(s.threads),
                "--ctx-size", str(s.ctx_size), *batch]
    return argv


@functools.cache
def mesh_takes_max_batch() -> bool:
    """Whether this mesh-llm's ``serve`` has ``--max-batch`` (continuous batching); without it, it
    decodes one request at a time. Asked of the command itself, as the harness imports nothing of it."""
    done = subprocess.run([sys.executable, "-m", "mesh_llm", "serve", "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}, timeout=120, check=False)
    return "--max-batch" in done.stdout


def _mlx_lm(fast_blas: bool):
    def argv(model: Path, port: int, s: Settings) -> list[str]:
        launcher = ["-c", _MLX_LM_FAST_BLAS] if fast_blas else ["-m", "mlx_lm.server"]
        # Its prompt batch (default 8) also raises its decode batch to at least that: cap it at N.
        batch = (["--decode-concurrency", str(s.concurrency), "--prompt-concurrency", str(min(s.concurrency, 8))]
                 if s.concurrency else [])
        return [sys.executable, *launcher, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                *batch]
    return argv


def _llama_cpp_python(model: Path, port: int, s: Settings) -> list[str]:
    queue = ["--interrupt_requests", "false"] if s.concurrency else []
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(s.threads), "--n_threads_batch", str(s.threads),
            "--n_ctx", str(s.ctx_size), "--n_gpu_layers", "-1", *queue]


def _llama_server(model: Path, port: int, s: Settings) -> list[str]:
    if s.llama_server is None:
        raise ValueError("llama-server needs --llama-server PATH")
    slots = s.concurrency or 1  # without --kv-unified, -c is shared out among the slots
    return [str(s.llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(s.threads), "-tb", str(s.threads), "-c", str(s.ctx_size * slots), "-np", str(slots),
            "-ngl", "999"]


BACKENDS = {b.name: b for b in [
    Backend("mesh-mlx", "mlx", "ignore_eos", _mesh("mlx")),
    Backend("mesh-llama", "gguf", "ignore_eos", _mesh("llama")),
    Backend("mlx-lm", "mlx", "logit_bias", _mlx_lm(fast_blas=True), model_id="default_model"),
    Backend("mlx-lm-plain", "mlx", "logit_bias", _mlx_lm(fast_blas=False), model_id="default_model"),
    Backend("llama-cpp-python", "gguf", "min_tokens", _llama_cpp_python),
    Backend("llama-server", "gguf", "ignore_eos", _llama_server),
]}
DEFAULT_BACKENDS = ["mesh-mlx", "mesh-llama", "mlx-lm", "llama-cpp-python"]  # + llama-server if given


class BackendError(RuntimeError):
    """The backend did not start or stopped answering; the message ends with its log's last lines."""


class Server:
    """One running backend process; ``url`` once started."""

    def __init__(self, backend: Backend, model: Path, settings: Settings, log: Path):
        self.backend, self.model, self.settings, self.log = backend, model, settings, log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.started = 0.0  # time.perf_counter() at the last start
        self.model_id = backend.model_id

    def start(self) -> float:
        """Start the process and wait until ``/v1/models`` answers; return milliseconds taken."""
        given = os.environ if self.backend.name.startswith("mesh-") else native.environ_as_given()
        env = {**given, "OPENBLAS_NUM_THREADS": str(self.settings.threads),
               "OMP_NUM_THREADS": str(self.settings.threads), "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        argv = self.backend.argv(self.model, self.port, self.settings)
        with open(self.log, "ab") as log:
            log.write(f"\n$ {' '.join(argv)}\n".encode())
            log.flush()
            self.started = time.perf_counter()
            self.proc = children.popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env)
        return self._until(self._models_listed, "/v1/models to answer")

    def wait_ready(self) -> float:
        """Wait until a one-token chat completion succeeds (the model is loaded: some servers answer
        /v1/models before); return milliseconds since the process started."""
        return self._until(self._completes, "a first completion")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        """SIGINT to this server's own process id, then SIGKILL if it is still there after ``grace``."""
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            how = f"exited with code {self.proc.wait(grace)} on SIGINT"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            how = f"still running {grace:.0f} s after SIGINT: killed"
        with open(self.log, "a") as log:
            log.write(f"[bench] pid {self.proc.pid} {how}\n")

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _until(self, probe, what: str) -> float:
        import httpx  # here, not at the top: `mesh-llm` imports this module for --help, and serve never needs it

        last, timeout = "", self.settings.startup_timeout
        while time.perf_counter() - self.started < timeout:
            if not self.alive():
                raise BackendError(f"exited with code {self.proc.returncode} before {what}:\n{self.log_tail()}")
            try:
                if probe():
                    return (time.perf_counter() - self.started) * 1000
            except (httpx.HTTPError, ValueError) as exc:
                last = str(exc)
            time.sleep(0.05)
        raise BackendError(f"no {what} within {timeout:.0f} s ({last}):\n{self.log_tail()}")

    def _models_listed(self) -> bool:
        import httpx

        r = httpx.get(self.url + "/v1/models", timeout=5)
        if r.status_code != 200:
            return False
        if self.model_id is None:
            self.model_id = r.json()["data"][0]["id"]
        return True

    def _completes(self) -> bool:
        import httpx

        body = {"model": self.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                "temperature": 0}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600).status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
