"""Real mesh nodes on loopback for the mesh tests: `mesh-llm serve` processes (support.py's
start_server), the same over HTTPS, and a stub peer that accepts connections and never answers."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mesh_llm.mesh.identity import NodeKey
from mesh_llm.mesh.security import AUTH_HEADER, MeshAuth
from support import Server, free_port, start_server

TOKEN = "mesh-test-token-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct"
# small contexts and caches: several nodes share this machine's memory
LEAN = ["--engine", "llama", "--ctx-size", "2048", "--cache-bytes", "64M"]


class Nodes:
    """The nodes one test module starts; all stopped at its end."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.started: list[Server] = []

    def start(self, name: str, *args: str, token: str = TOKEN, model: bool = True, port: int | None = None) -> Server:
        flags = [*(LEAN if model else []), "--node-name", name, "--mesh-token", token, *args]
        server = start_server(flags, self.folder / f"{name}-{len(self.started)}.log", port=port)
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout}s: {what}")
        time.sleep(interval)
    return time.monotonic() - start


def served_models(server: Server, headers: dict | None = None) -> dict[str, list[str]]:
    """Model id -> the nodes serving it, as ``server``'s /v1/models lists them."""
    reply = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
    assert reply.status_code == 200, reply.text
    return {m["id"]: m["nodes"] for m in reply.json()["data"]}


def chat(server: Server, model: str, content: str = "Say hi.", headers: dict | None = None,
         max_tokens: int = 4, messages: list | None = None, timeout: float = 120) -> httpx.Response:
    body = {"model": model, "messages": messages or [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def signed(method: str, path: str, body: bytes = b"", token: str = TOKEN) -> dict[str, str]:
    """The headers a node sends with a request: its signature under the mesh token."""
    return {**MeshAuth(token).headers(method, path, body), "content-type": "application/json"}


def sealed(body: dict, key: NodeKey) -> dict:
    """``body`` (a record or a leave notice) signed with ``key``, as a node sends it."""
    return key.signed(json.dumps(body)).model_dump()


def beat(record: dict, key: NodeKey, **rest) -> bytes:
    """A heartbeat whose sender is ``record``, signed with ``key``."""
    return json.dumps({"sender": sealed(record, key), **rest}).encode()


def mesh_view(server: Server, token: str = TOKEN) -> dict[str, str]:
    """Member id -> state, as ``server``'s /api/mesh reports them."""
    reply = httpx.get(server.url + "/api/mesh", headers=signed("GET", "/api/mesh", token=token), timeout=10)
    assert reply.status_code == 200, reply.text
    return {m["id"]: m["state"] for m in reply.json()["members"]}


class Listener:
    """A TCP port on loopback that takes each connection in a thread of its own (``_take``)."""

    scheme = "http"

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._take, args=(conn, time.monotonic()), daemon=True).start()

    def _take(self, conn: socket.socket, accepted: float) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()
        for conn in self._conns:
            conn.close()


class SilentPeer(Listener):
    """Accepts connections, reads what comes and never answers: a hung node. ``held`` lists, per
    connection, the request line and how long the caller waited before it closed the connection."""

    def __init__(self):
        self.held: list[tuple[str, float]] = []
        super().__init__()

    def _take(self, conn: socket.socket, accepted: float) -> None:
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except OSError:
            return
        self.held.append((data.split(b"\r\n", 1)[0].decode(errors="replace"), time.monotonic() - accepted))


class FakeMember:
    """A member that holds the token and keeps its place in the mesh (it answers heartbeats with its
    signed record, each a newer version) but serves nothing it advertises: a request for a model
    hangs (``mode="hang"``) or gets a made-up answer that names another node as its server
    (``mode="claims"``). ``served`` counts the requests that reached it."""

    def __init__(self, name: str, models: list[str], mode: str = "hang", token: str = TOKEN):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.name, self.models, self.mode, self.served = name, models, mode, 0
        self.key, self.token, self.auth, self.seq = NodeKey.generate(), token, MeshAuth(token), 0
        self.started, self.closed = time.time_ns(), threading.Event()
        member = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/mesh/heartbeat":
                    nonce = member.auth.check(self.headers.get(AUTH_HEADER), "POST", self.path, body)
                    if nonce is None:
                        return self._reply(401, b"{}")
                    reply = member.heartbeat()
                    return self._reply(200, reply, {AUTH_HEADER: member.auth.answer(nonce, reply)})
                member.served += 1
                if member.mode == "hang":
                    member.closed.wait()
                    return None
                answer = {"id": "x", "object": "chat.completion", "created": 0, "model": member.models[0],
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": "made up"}}]}
                head = {"status": 200, "headers": [["content-type", "application/json"],
                                                   ["x-mesh-served-by", "someone-else"]]}
                relayed = json.dumps(head).encode() + b"\n" + json.dumps(answer).encode()
                return self._reply(200, relayed, {"x-mesh-relay": "1", "content-type": "application/x-mesh-relay"})

            def _reply(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                for header, value in {"content-type": "application/json", **(headers or {})}.items():
                    self.send_header(header, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def heartbeat(self) -> bytes:
        self.seq += 1
        record = {"id": self.name, "url": self.url, "version": [self.started, self.seq],
                  "models": [{"id": m, "context_length": 8192, "load": {"max_batch": 64}} for m in self.models]}
        return beat(record, self.key)

    def join(self, server: Server) -> None:
        sent = self.heartbeat()
        reply = httpx.post(server.url + "/mesh/heartbeat", content=sent,
                           headers=signed("POST", "/mesh/heartbeat", sent, token=self.token), timeout=10)
        assert reply.status_code == 200, reply.text

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()


@dataclass
class TLSServer(Server):
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


def start_tls_server(args: list[str], log: Path, ca_file: str, timeout: float = 120) -> TLSServer:
    """start_server for a node that serves HTTPS: health is polled over TLS, verified by ``ca_file``."""
    port = free_port()
    cmd = [sys.executable, "-m", "mesh_llm", "serve", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    server = TLSServer(proc, port, log)
    verify = ssl.create_default_context(cafile=ca_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{server.output()}")
        try:
            if httpx.get(server.url + "/health", verify=verify, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server not healthy after {timeout}s:\n{server.output()}")


class Pipe(Listener):
    """Passes each connection on to ``target_port`` (set later if need be) and keeps every byte it
    carries in ``seen``: a listener on the path between two nodes. With ``tls`` (a server context)
    it is a man in the middle instead: it ends the TLS itself with that context, opens its own
    (unverified) TLS to the target, and keeps the plaintext."""

    scheme = "https"

    def __init__(self, target_port: int | None = None, tls: ssl.SSLContext | None = None):
        self.target_port, self.tls = target_port, tls
        self.seen = bytearray()
        self._lock = threading.Lock()
        super().__init__()

    def _take(self, conn: socket.socket, accepted: float) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            upstream.settimeout(None)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
                unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
                upstream = unverified.wrap_socket(upstream)
        except OSError:
            conn.close()
            return
        self._conns += [conn, upstream]
        threading.Thread(target=self._pump, args=(upstream, conn), daemon=True).start()
        self._pump(conn, upstream)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                with self._lock:
                    self.seen += chunk
                sink.sendall(chunk)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
