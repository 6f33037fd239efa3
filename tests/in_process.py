"""The API served in-process: the real FastAPI app and uvicorn on a loopback port, in a thread of the
test process, over workers of the scripted engine (tests/fake_engine.py). Real HTTP, real streaming,
the official client; no model to load, so a server starts in milliseconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn

from fake_engine import FakeEngine
from mesh_llm.api.app import ServedModel, create_app
from mesh_llm.runtime.worker import ModelWorker

MODEL = "fake"


class InProcessServer:
    """uvicorn serving ``app`` on a free loopback port from a thread; stopped on exit."""

    def __init__(self, app, workers: list[ModelWorker]):
        self.workers = workers
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> InProcessServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not (self._server.started and self._server.servers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self._server.started, "the in-process server did not start"
        return self

    @property
    def url(self) -> str:
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        for worker in self.workers:
            worker.stop()


@contextmanager
def serve_fake(make_engine: Callable[[], FakeEngine] = FakeEngine, api_key: str | None = None,
               max_queue: int = 64, request_timeout: float | None = None, aliases: tuple[str, ...] = (),
               wrap: Callable = lambda app: app, **app_options) -> Iterator[InProcessServer]:
    """``aliases``: more ids the same worker is served under; ``wrap``: what serve puts around the
    app (CORS)."""
    worker = ModelWorker(MODEL, make_engine, max_queue=max_queue, request_timeout=request_timeout)
    worker.start()
    assert worker.wait_ready(10) and worker.ready, worker.load_error
    served = [ServedModel(name, worker, "fake", 0) for name in (MODEL, *aliases)]
    app = wrap(create_app(served, api_key=api_key, **app_options))
    server = InProcessServer(app, [worker]).start()
    try:
        yield server
    finally:
        server.stop()

