"""`mesh-llm serve`: resolve the models, pick an engine for each, start one worker per model and run
the HTTP server. Every startup problem becomes :class:`StartupError`: one line, exit code 2."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mesh_llm.engines import choose_engine, engine_class
from mesh_llm.engines.base import Engine, EngineError, EngineOptions
from mesh_llm.system import native

if TYPE_CHECKING:
    from mesh_llm.api.app import ServedModel
    from mesh_llm.mesh import MeshConfig
    from mesh_llm.runtime.worker import Incoming, ModelWorker

log = logging.getLogger("mesh_llm.serve")
SHUTDOWN_GRACE_S = 5  # on SIGTERM or SIGINT, running requests may finish for this long


class StartupError(Exception):
    """A problem that stops the server from starting, told in one line."""


@dataclass
class ServeConfig:
    models: list[str] = field(default_factory=list)  # references; empty: the embedded default
    aliases: list[str] = field(default_factory=list)  # ids to serve the models under, in order
    engine: str = "auto"
    host: str = "127.0.0.1"
    port: int = 9337
    api_key: str | None = None
    options: EngineOptions = field(default_factory=EngineOptions)  # how every model is loaded
    max_queue: int = 64
    max_body_bytes: int | None = None  # largest request body; None: the API's (8 MiB)
    read_timeout: float = 30.0  # seconds a request's headers and body may take to arrive
    request_timeout: float | None = None  # seconds a generation may take, arrival to last token
    tls_cert: str | None = None  # serve HTTPS (uvicorn's TLS) with this certificate and key
    tls_key: str | None = None
    mesh: MeshConfig | None = None  # take part in a mesh (mesh/); None: a standalone server
    cors_origins: list[str] | None = None  # browser origins allowed; None: localhost's; []: none


@dataclass
class Plan:
    """One model to serve: where it is, which engine loads it, and why."""

    id: str
    path: Path
    format: str
    engine: str
    reason: str
    engine_class: type[Engine]


def plan_models(config: ServeConfig, progress=None) -> list[Plan]:
    from mesh_llm.models import BadModel, ModelNotFound, model_path, resolve

    refs = config.models or ["default"]
    if len(config.aliases) > len(refs):
        raise StartupError(f"{len(config.aliases)} --alias flags for {len(refs)} models")
    try:
        chosen = [(spec, *choose_engine(spec.formats, config.engine)) for spec in map(resolve, refs)]
    except (ModelNotFound, BadModel, EngineError) as exc:
        raise StartupError(str(exc)) from None
    check_load_order({engine for _, engine, _, _ in chosen})  # before MLX runs, even to import a model
    plans = []
    for i, (spec, engine, fmt, why) in enumerate(chosen):
        try:
            cls = engine_class(engine)  # imported now: a broken install stops the start here, in one line
            path = model_path(spec, fmt, progress, engine, config.options.deterministic)  # the default's forms: once
        except (ModelNotFound, BadModel, EngineError) as exc:
            raise StartupError(str(exc)) from None
        model_id = config.aliases[i] if i < len(config.aliases) else spec.name
        if Path(path) != spec.path:  # a form made for this engine (the default model's): say which
            why = f"{why}; from {path}"
        plans.append(Plan(model_id, Path(path), fmt, engine, why, cls))
    ids = [p.id for p in plans]
    if len(set(ids)) != len(ids):
        raise StartupError(f"two models would be served under the same id: {ids}; use --alias")
    return plans


class Relaunch(StartupError):
    """This process cannot run MLX (system/native.py), but the same command in a fresh one can: the CLI
    starts it again with ``native.relaunch_without_llama``."""


def check_load_order(engines: set[str]) -> None:
    """MLX cannot run in a process that loaded a libstdc++-carrying llama.cpp build first, and such a
    build cannot load after MLX: one process serves one of the two."""
    problem = native.mlx_load_problem() if "mlx" in engines else None
    if problem is None:
        return
    if "llama" in engines:
        raise StartupError("this llama.cpp build cannot share a process with MLX (it carries its own "
                           "libstdc++, and whichever of the two loads second crashes): serve the GGUF "
                           "models and the MLX ones from two mesh-llm serve processes (join them with "
                           "--mesh to serve them under one API)")
    raise Relaunch(problem)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # sockets that say they are TCP, and accepted sockets inherit this one's protocol. With Nagle on,
    # every response after a connection's first waited ~40 ms for the client's delayed ACK between
    # its header and body writes (keep-alive clients, such as the openai client and mesh peers).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def start_workers(plans: list[Plan], config: ServeConfig, incoming: Incoming,
                  progress_factory=None) -> list[ModelWorker]:
    from mesh_llm.runtime.worker import ModelWorker

    options = config.options
    workers = []
    for plan in plans:
        progress = progress_factory(plan) if progress_factory else None
        worker = ModelWorker(plan.id, lambda plan=plan, progress=progress:
                             plan.engine_class.load(plan.path, options, progress), max_queue=config.max_queue,
                             request_timeout=config.request_timeout, incoming=incoming)
        worker.start()
        workers.append(worker)
    return workers


def serve(config: ServeConfig, progress_factory=None) -> int:
    """Run until interrupted; returns the process exit code. The server's modules (uvicorn, the
    worker, the API) are imported once the models are planned: a plan may start the process again
    (``Relaunch``), and with the CLI's they took 0.38-0.42 s of that restart's first process on
    an H100."""
    client_only = config.mesh is not None and config.mesh.client
    plans = [] if client_only else plan_models(config, progress=progress_factory("import") if progress_factory
                                               else None)
    import uvicorn

    check_tls(config)
    sock = bind(config.host, config.port)
    from mesh_llm.runtime.worker import Incoming

    incoming = Incoming()  # bodies being read, which every worker's first step waits for
    workers = start_workers(plans, config, incoming, progress_factory)
    # imported while the engines load on their threads: FastAPI's import alone took 0.2 s of a
    # 2-core machine's start and 0.8 s on the H200's host (2026-12-05)
    from mesh_llm.api.app import DEFAULT_MAX_BODY_BYTES, ServedModel, create_app

    body_limit = config.max_body_bytes or DEFAULT_MAX_BODY_BYTES
    created = int(time.time())
    served = [ServedModel(p.id, w, p.format, created) for p, w in zip(plans, workers)]
    app = create_app(served, api_key=config.api_key, max_body_bytes=body_limit, incoming=incoming)
    mesh_listener = None
    if config.mesh is not None:
        try:
            app, mesh_listener = join_mesh(app, served, config, body_limit)
        except StartupError:
            for worker in workers:
                worker.stop(timeout=5)
            raise
    from mesh_llm.api.messages_api import AnthropicErrors

    app = with_cors(AnthropicErrors(app) if config.mesh is not None else app, config.cors_origins)
    server = _graceful_server(uvicorn)(
        uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5,
                       http=timed_protocol(config.read_timeout), ssl_certfile=config.tls_cert,
                       ssl_keyfile=config.tls_key), workers, mesh_listener)
    failed: list[str] = []

    def watch() -> None:
        for plan, worker in zip(plans, workers):
            worker.wait_ready()
            if worker.load_error is not None:
                failed.append(f"{plan.id}: {worker.load_error}")
                server.should_exit = True
                return
            info = worker.info
            log.info("ready: %s on %s (%s, %s), context %d, batch %d, %.0f MB: %s", plan.id,
                     info.engine, info.device, info.backend, info.context_length,
                     worker.load()["max_batch"], info.memory_bytes / 1e6, plan.reason)
        log.info("serving on %s://%s:%d/v1", "https" if config.tls_cert else "http", config.host, config.port)

    threading.Thread(target=watch, name="startup-watch", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        for worker in workers:
            worker.stop(timeout=5)
    if failed:
        raise StartupError(failed[0])
    return 130 if server.signalled == signal.SIGINT else 0


LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def with_cors(app, origins: list[str] | None):
    """Browsers' cross-origin calls (a web app on another port): allowed from this machine's own
    pages by default, or from ``origins`` ('*': any). The preflight is answered
    here, before the API key is asked for; credentials (cookies) are never allowed, and the API key
    goes in a header the preflight allows."""
    if origins == []:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(app, allow_origins=origins or [], allow_origin_regex=None if origins else LOCAL_ORIGINS,
                          allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
                          allow_credentials=False, max_age=600,
                          expose_headers=["x-mesh-served-by", "x-mesh-failed", "retry-after"])


def _graceful_server(uvicorn):
    """uvicorn's server, shutting down as the README promises: on SIGTERM or SIGINT it stops
    accepting, lets running requests finish for ``SHUTDOWN_GRACE_S``, then ends every one still
    running or waiting properly (the workers answer each with a ``server_shutting_down`` error: a
    final SSE error event and ``[DONE]``, or a 503), and returns instead of dying by the signal, so
    that serve()'s cleanup runs and the exit status is 0 (130 after Ctrl-C). A second Ctrl-C quits at
    once."""

    class GracefulServer(uvicorn.Server):
        def __init__(self, config, workers: list, mesh_listener=None):
            """``mesh_listener``: (socket, TLS context) of the mesh port, served by the same app."""
            super().__init__(config)
            self._workers = workers
            self._mesh_listener = mesh_listener
            self.signalled: int | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self._mesh_listener is None or self.should_exit:
                return
            sock, context = self._mesh_listener
            config = self.config
            self.servers.append(await asyncio.get_running_loop().create_server(
                lambda: config.http_protocol_class(config=config, server_state=self.server_state,
                                                   app_state=self.lifespan.state),
                sock=sock, ssl=context, backlog=config.backlog))

        def handle_exit(self, sig: int, frame) -> None:
            self.signalled = self.signalled or sig
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            loop = asyncio.get_running_loop()

            async def end_the_rest() -> None:
                await asyncio.sleep(SHUTDOWN_GRACE_S)
                await loop.run_in_executor(None, lambda: [w.stop(timeout=5) for w in self._workers])

            ender = asyncio.create_task(end_the_rest())
            try:
                await super().shutdown(sockets)
            finally:
                ender.cancel()
            self._captured_signals.clear()  # uvicorn would raise them again once it returns

    return GracefulServer


def timed_protocol(read_timeout: float):
    """uvicorn's HTTP protocol (httptools) with a read deadline: a request's headers and body must
    arrive within ``read_timeout`` seconds of its first byte (of the connection, for the first), or
    it is answered 408 ``request_timeout`` and the connection closed, so a client that sends a byte
    now and then (slowloris) cannot hold a connection. Answers and idle keep-alive are not timed
    here (uvicorn closes idle connections itself)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from mesh_llm.api.errors import error_body

    message = f"the request was not received within {read_timeout:g} s"
    body = json.dumps(error_body(408, message, code="request_timeout")).encode()
    response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)

    class TimedProtocol(HttpToolsProtocol):
        _read_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(read_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(response)
            log.info("closed a connection whose request was not received within %g s", read_timeout)
            self.transport.close()

    return TimedProtocol


def check_tls(config: ServeConfig) -> None:
    """--tls-cert and --tls-key come together and load, or the start-up stops with one line."""
    if (config.tls_cert is None) != (config.tls_key is None):
        raise StartupError("--tls-cert and --tls-key go together")
    if config.tls_cert is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"cannot use the TLS certificate {config.tls_cert} with key {config.tls_key}: "
                           f"{exc.strerror or exc}") from None


def join_mesh(app, served: list[ServedModel], config: ServeConfig, body_limit: int):
    """Put the mesh gateway in front of ``app``, joining the mesh first when told to; returns it and
    the mesh port's (socket, TLS context), or None when peers use the API port."""
    from mesh_llm.mesh import MeshError, attach
    from mesh_llm.mesh.node import api_url

    mesh = config.mesh
    if mesh.tls_ca is not None and not Path(mesh.tls_ca).is_file():
        raise StartupError(f"--tls-ca {mesh.tls_ca}: no such file")
    port = mesh_port(config)
    if port is None:
        url, sock = api_url(config.host, config.port, tls=config.tls_cert is not None), None
    else:
        if mesh.advertise_url is not None and not mesh.advertise_url.startswith("https://"):
            raise StartupError(f"--advertise-url {mesh.advertise_url}: this node's mesh port is encrypted; "
                               "advertise it as https://HOST:MESH_PORT")
        sock = bind(config.host, port)
        url = api_url(config.host, sock.getsockname()[1], tls=True)
    try:
        gateway = attach(app, served, mesh, url, api_key=config.api_key, max_body_bytes=body_limit,
                         mesh_port=None if sock is None else sock.getsockname()[1])
    except MeshError as exc:
        if sock is not None:
            sock.close()
        raise StartupError(str(exc)) from None
    return gateway, None if sock is None else (sock, gateway.node.server_tls())


def mesh_port(config: ServeConfig) -> int | None:
    """The port node-to-node traffic comes to, encrypted with the node's key: ``--mesh-port``, or
    by default the API port + 1 on a node that listens beyond this machine. None: peers use the
    API port (a node on loopback only, whose traffic never leaves the machine, or one whose
    peers verify a CA's certificates, ``--tls-ca``)."""
    if config.mesh.tls_ca is not None:
        if config.mesh.port is not None:
            raise StartupError("--mesh-port and --tls-ca do not go together: with a CA, peers use the API port")
        return None
    if config.mesh.port is not None:
        return config.mesh.port
    return None if is_loopback(config.host) else config.port + 1


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
