"""The socket `mesh-llm serve` listens on. asyncio (and so uvicorn) turns Nagle's algorithm off only
on sockets whose protocol says TCP, and accepted sockets inherit the listening socket's: with a plain
``socket.socket()`` every response after a connection's first waited ~40 ms for the client's delayed
ACK (measured: GET /v1/models 43-45 ms on a keep-alive connection against under 1 ms; a streamed
chat's first token 48 ms against 25-28 ms; and the mesh's proxy hop, which keeps its connections)."""

from __future__ import annotations

import asyncio
import socket

from mesh_llm.serve import bind


def test_connections_accepted_on_the_serving_socket_have_nagle_off():
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

    asyncio.run(main())
    assert seen and seen[0] != 0
