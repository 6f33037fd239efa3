"""The socket `mesh-llm serve` listens on. asyncio (and so uvicorn) turns Nagle's algorithm off only
on sockets whose protocol says TCP, and accepted sockets inherit the listening socket's: with a plain
``socket.socket()`` every response after a connection's first waited ~40 ms for the client's delayed
ACK (measured: GET /v1/models 43-45 ms on a keep-alive connection against under 1 ms; a streamed
chat's first token 48 ms against 25-28 ms; and the mesh's proxy hop, which keeps its connections).
Checked under asyncio's own loop and under the one uvicorn serves with (uvloop where installed)."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest
from uvicorn.config import Config

from mesh_llm.serve import bind


def _serving_loop():
    return Config(lambda scope, receive, send: None).get_loop_factory()


@pytest.mark.parametrize("loop", ["asyncio", "uvicorn's"])
def test_connections_accepted_on_the_serving_socket_have_nagle_off(loop):
    factory = asyncio.new_event_loop if loop == "asyncio" else _serving_loop() or asyncio.new_event_loop
    sock = bind("127.0.0.1", 0)
    seen: list[int] = []

    async def main() -> None:
        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()

    event_loop = factory()
    try:
        event_loop.run_until_complete(main())
    finally:
        event_loop.close()
    assert seen and seen[0] != 0


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_uvicorn_serves_with_its_c_event_loop_and_http_parser():
    """uvloop and httptools (declared dependencies) are what uvicorn picks, not asyncio's loop and
    the pure-Python h11 it fell back to."""
    config = Config(lambda scope, receive, send: None)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    loop = config.get_loop_factory()()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()
