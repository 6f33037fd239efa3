"""The network layer under the node's HTTP client (httpx, httpcore, h11: unchanged above it) on
asyncio's own transports and a plain protocol, in place of httpcore's default, which goes through
anyio.

Why: every streamed token a peer serves is one read on the entry node, and anyio's read enters a
cancel scope and two generator-based context managers, then resumes and pauses the transport's
reading (two ``epoll_ctl``, batched through ``io_uring`` under uvloop) for a few hundred bytes. Here
a read takes what the protocol has buffered, or waits on one future. What it saved is in README's
"The mesh" (``benchmarks/hop_ab.py``)."""

from __future__ import annotations

import asyncio
import ssl
import typing

import httpcore

READ_LIMIT = 256 * 1024  # bytes buffered before the transport stops reading (flow control)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.eof = False
        self.error: BaseException | None = None
        self.reader: asyncio.Future | None = None  # a read waiting for data
        self.drainer: asyncio.Future | None = None  # a write waiting for the buffer to drain
        self.reading_paused = False
        self.writing_paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > READ_LIMIT and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> None:
        self.eof = True
        self._wake_reader()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof = True
        self.error = exc
        self._wake_reader()
        self.writing_paused = False
        self._wake_drainer()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_drainer()

    def _wake_reader(self) -> None:
        waiter, self.reader = self.reader, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drainer(self) -> None:
        waiter, self.drainer = self.drainer, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def _wait(waiter: asyncio.Future, timeout: float | None, timeout_error: type[Exception]) -> None:
    if timeout is None:
        await waiter
        return
    try:
        await asyncio.wait_for(waiter, timeout)
    except asyncio.TimeoutError:
        raise timeout_error(f"timed out after {timeout:g}s") from None


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, protocol: _Protocol):
        self._transport, self._protocol = transport, protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        protocol = self._protocol
        if not protocol.chunks and not protocol.eof:
            protocol.reader = asyncio.get_running_loop().create_future()
            await _wait(protocol.reader, timeout, httpcore.ReadTimeout)
        chunks = protocol.chunks
        if not chunks:
            if protocol.error is not None:
                raise httpcore.ReadError(str(protocol.error) or type(protocol.error).__name__)
            return b""  # the end: h11 says what a short answer means
        data = chunks[0]
        if len(data) <= max_bytes:
            del chunks[0]
        else:
            data, chunks[0] = data[:max_bytes], data[max_bytes:]
        protocol.size -= len(data)
        if protocol.reading_paused and protocol.size <= READ_LIMIT // 2:
            protocol.reading_paused = False
            self._transport.resume_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        protocol = self._protocol
        if protocol.eof and protocol.error is not None or self._transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self._transport.write(buffer)
        if protocol.writing_paused:
            protocol.drainer = asyncio.get_running_loop().create_future()
            await _wait(protocol.drainer, timeout, httpcore.WriteTimeout)

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> AsyncioStream:
        loop = asyncio.get_running_loop()
        try:
            transport = await asyncio.wait_for(
                loop.start_tls(self._transport, self._protocol, ssl_context, server_hostname=server_hostname),
                timeout)
        except asyncio.TimeoutError:
            self._transport.close()
            raise httpcore.ConnectTimeout(f"TLS handshake timed out after {timeout:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            self._transport.close()
            raise httpcore.ConnectError(str(exc)) from exc
        self._protocol.transport = transport
        return AsyncioStream(transport, self._protocol)

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        if info == "socket":
            return self._transport.get_extra_info("socket")
        if info == "is_readable":  # an idle pooled connection the peer closed, or that has stray bytes
            return bool(self._protocol.chunks) or self._protocol.eof or self._transport.is_closing()
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> AsyncioStream:
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, host, port,
                                       local_addr=(local_address, 0) if local_address else None),
                timeout)
        except asyncio.TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting timed out after {timeout:g}s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from exc
        sock = transport.get_extra_info("socket")
        for option in socket_options or ():  # asyncio turns Nagle off (TCP_NODELAY) itself
            sock.setsockopt(*option)
        return AsyncioStream(transport, protocol)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options=None) -> AsyncioStream:
        raise httpcore.ConnectError("unix sockets are not used between mesh nodes")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def use_asyncio_streams(transport) -> bool:
    """Put :class:`AsyncioBackend` under an ``httpx.AsyncHTTPTransport``'s connection pool; False
    (the transport left as it was) where this httpx/httpcore keeps it elsewhere."""
    pool = getattr(transport, "_pool", None)
    if not isinstance(pool, httpcore.AsyncConnectionPool) or not hasattr(pool, "_network_backend"):
        return False
    pool._network_backend = AsyncioBackend()
    return True
