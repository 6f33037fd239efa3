"""The entry node's side of a forwarded answer, against small servers on loopback: the loop that
passes a streamed body on (``Upstream.pipe`` in ``mesh/relay.py``)."""

from __future__ import annotations

import asyncio
import json

import httpx

from mesh_llm.mesh.relay import RELAY_HEADER, PeerSilent, Stopped, Upstream


class ChunkedServer:
    """Answers every request on a connection with ``parts`` sent as chunks, ``gap`` seconds apart,
    then either ends the body or, with ``stall``, holds the connection open sending nothing."""

    def __init__(self, parts: list[bytes], gap: float = 0.0, stall: bool = False, relay: bool = False,
                 close_after: bool = False):
        self.parts, self.gap, self.stall, self.relay, self.close_after = parts, gap, stall, relay, close_after
        self.connections = 0
        self.requests = 0

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while (await reader.readuntil(b"\r\n\r\n")):
                self.requests += 1
                head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
                if self.relay:
                    head += RELAY_HEADER.encode() + b": 1\r\n"
                writer.write(head + b"\r\n")
                parts = self.parts
                if self.relay:
                    status = json.dumps({"status": 200, "headers": [["content-type", "text/event-stream"]]})
                    parts = [status.encode() + b"\n", *parts]
                for part in parts:
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    await writer.drain()
                    if self.gap:
                        await asyncio.sleep(self.gap)
                if self.stall:
                    await asyncio.sleep(3600)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(5, read=None))


async def _piped(server: ChunkedServer, idle_timeout: float | None, stop: asyncio.Event,
                 deliver_delay: float = 0.0, set_stop_in_deliver: bool = False):
    """Open a relayed answer and pipe it; (chunks delivered, what was raised, task still cancelling)."""
    delivered: list[bytes] = []

    async def deliver(chunk: bytes) -> None:
        if set_stop_in_deliver:
            stop.set()
        await asyncio.sleep(deliver_delay)
        delivered.append(chunk)

    async with server as url, client() as http:
        response = await http.send(http.build_request("GET", url), stream=True)
        upstream = Upstream(response)
        await upstream.read_head(5)
        raised = None
        try:
            await upstream.pipe(deliver, idle_timeout, stop)
        except Exception as exc:
            raised = exc
        finally:
            await upstream.aclose()
        task = asyncio.current_task()
        return delivered, raised, (task.cancelling() if hasattr(task, "cancelling") else 0)


def test_pipe_passes_every_chunk_and_returns_at_the_end():
    parts = [b"data: %d\n\n" % i for i in range(20)]

    async def run():
        return await _piped(ChunkedServer(parts, relay=True, gap=0.001), 5, asyncio.Event())

    delivered, raised, cancelling = asyncio.run(run())
    assert raised is None and b"".join(delivered) == b"".join(parts) and cancelling == 0


def test_pipe_raises_peer_silent_after_the_idle_timeout_with_what_came_delivered():
    parts = [b"data: 1\n\n", b"data: 2\n\n"]

    async def run():
        return await _piped(ChunkedServer(parts, relay=True, stall=True), 0.3, asyncio.Event())

    delivered, raised, cancelling = asyncio.run(run())
    assert isinstance(raised, PeerSilent) and b"".join(delivered) == b"".join(parts) and cancelling == 0


def test_pipe_stops_a_waiting_read_when_stop_is_set():
    async def run():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        return await _piped(ChunkedServer([b"data: 1\n\n"], relay=True, stall=True), None, stop)

    delivered, raised, cancelling = asyncio.run(run())
    assert isinstance(raised, Stopped) and delivered == [b"data: 1\n\n"] and cancelling == 0


def test_pipe_finishes_delivering_a_chunk_when_stop_comes_during_it():
    """The stop interrupts reads only: a chunk half-way to the client is never cut."""
    async def run():
        server = ChunkedServer([b"data: 1\n\n", b"data: 2\n\n"], relay=True, stall=True)
        return await _piped(server, None, asyncio.Event(), deliver_delay=0.2, set_stop_in_deliver=True)

    delivered, raised, cancelling = asyncio.run(run())
    assert isinstance(raised, Stopped) and cancelling == 0
    assert len(delivered) == 1 and delivered[0].startswith(b"data: 1\n\n")
