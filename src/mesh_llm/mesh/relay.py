"""How a forwarded request's answer travels between two nodes, so that the entry node can tell a
silent peer from a busy one.

A model answers a non-streamed request only when the whole generation is done, and a streamed one
after its prefill: either can take longer than any fair first-byte timeout. So the serving node
answers a forwarded request at once with ``200`` and ``x-mesh-relay: 1``, sends a newline every
second while its app has not started the response, then one JSON line with the app's real status
and headers, then the app's body as it comes; a stream (``text/event-stream``) gets an SSE comment
(``: keep-alive``, which clients skip) every second until its first event, while its prompt is
read, so a long prompt is not taken for a hung node. A peer that sends nothing within the
first-byte timeout, stops sending keep-alives, or falls silent once its stream's events flow, is
hung, whatever its model is doing. It is plain HTTP underneath: only the head is wrapped."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx

from mesh_llm.api.errors import error_body

log = logging.getLogger("mesh_llm.mesh")

RELAY_HEADER = "x-mesh-relay"
KEEPALIVE_S = 1.0
MAX_HEAD_BYTES = 64 * 1024


class PeerSilent(Exception):
    """The peer sent nothing for longer than the first-byte timeout."""


class Stopped(Exception):
    """A watched event (the peer went down, the client left) ended the read."""


# -- the serving node ---------------------------------------------------------------------------------

async def serve_relayed(app, scope, receive, send) -> None:
    """Run ``app`` for a forwarded request, wrapping its response as described above."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/x-mesh-relay"), (RELAY_HEADER.encode(), b"1"),
                            (b"cache-control", b"no-cache")]})
    messages: asyncio.Queue[dict | None] = asyncio.Queue(maxsize=64)

    async def run() -> None:
        try:
            await app(scope, receive, messages.put)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    head_sent = reading = False  # reading: a stream's head is out, its first event not yet (prefill)
    try:
        while True:
            try:
                message = await asyncio.wait_for(messages.get(), KEEPALIVE_S if reading or not head_sent else None)
            except asyncio.TimeoutError:  # an SSE comment while a stream's prompt is read
                await send({"type": "http.response.body", "body": b": keep-alive\n\n" if reading else b"\n",
                            "more_body": True})
                continue
            if message is None:
                break
            if message["type"] == "http.response.start":
                head = {"status": message["status"],
                        "headers": [[k.decode("latin-1"), v.decode("latin-1")]
                                    for k, v in message.get("headers", [])]}
                await send({"type": "http.response.body", "body": json.dumps(head).encode() + b"\n",
                            "more_body": True})
                head_sent = True
                reading = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                              for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body":
                reading = reading and not message.get("body")
                await send({"type": "http.response.body", "body": message.get("body", b""), "more_body": True})
        await task  # re-raises the app's failure
    except Exception:
        if head_sent:
            raise  # the connection drops: the entry node sees a broken stream, not a short one
        log.exception("a forwarded request failed")
        body = json.dumps(error_body(500, "internal server error", code="internal_error")).encode()
        head = {"status": 500, "headers": [["content-type", "application/json"]]}
        await send({"type": "http.response.body", "body": json.dumps(head).encode() + b"\n" + body,
                    "more_body": True})
    finally:
        task.cancel()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- the entry node ------------------------------------------------------------------------------------

class Upstream:
    """A peer's answer being read: its real status and headers, then body chunks."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.status = response.status_code
        self.headers: list[tuple[str, str]] = list(response.headers.multi_items())
        self._chunks = response.aiter_raw()
        self._pending = b""
        self._stop: asyncio.Event | None = None
        self._stopper: asyncio.Future | None = None  # one waiter on ``stop`` for every read

    async def read_head(self, timeout: float, stop: asyncio.Event | None = None) -> None:
        """Skip keep-alives and take the real status and headers (a peer that does not relay, as
        when it refuses the token, is taken as it answered)."""
        if self.response.headers.get(RELAY_HEADER) != "1":
            return
        buffer = b""
        while b"\n" not in buffer.lstrip(b"\n"):
            chunk = await self.next(timeout, stop)
            if chunk is None:
                raise httpx.RemoteProtocolError("the peer closed the relay before its response head")
            buffer += chunk
            if len(buffer) > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("the peer's response head is too long")
        line, self._pending = buffer.lstrip(b"\n").split(b"\n", 1)
        try:
            head = json.loads(line)
            self.status = int(head["status"])
            self.headers = [(str(k), str(v)) for k, v in head["headers"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise httpx.RemoteProtocolError(f"the peer's response head is malformed: {exc}") from None

    async def next(self, timeout: float | None = None, stop: asyncio.Event | None = None) -> bytes | None:
        """The next body bytes, or None at the end. Raises :class:`PeerSilent` after ``timeout``
        seconds without bytes, :class:`Stopped` when ``stop`` is set first, httpx errors on a
        broken connection."""
        if self._pending:
            chunk, self._pending = self._pending, b""
            return chunk
        read = asyncio.ensure_future(anext(self._chunks))
        waits = {read}
        if stop is not None:
            if stop is not self._stop:
                self._cancel_stopper()
                self._stop, self._stopper = stop, asyncio.ensure_future(stop.wait())
            waits.add(self._stopper)
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if read not in done:
            read.cancel()
            if self._stopper is not None and self._stopper in done:
                raise Stopped()
            raise PeerSilent()
        try:
            return read.result()
        except StopAsyncIteration:
            return None

    async def pipe(self, deliver, idle_timeout: float | None, stop: asyncio.Event) -> None:
        """Hand every body chunk to ``await deliver(chunk)`` until the end; raises as :meth:`next`
        does (``idle_timeout``: seconds without bytes, None for never).

        The path every streamed token takes, so it makes no future, task or timer per chunk (as
        :meth:`next` does): ``stop`` and a watchdog on the time of the last chunk cancel the read
        instead. They interrupt a read only: a chunk being delivered is delivered whole first."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        why: type[Exception] | None = None
        reading = False
        last = loop.time()

        def interrupt(reason: type[Exception]) -> None:
            nonlocal why
            if why is None:
                why = reason
                if reading:
                    task.cancel()

        def watchdog() -> None:
            nonlocal timer
            if loop.time() - last >= idle_timeout:
                interrupt(PeerSilent)
            else:
                timer = loop.call_at(last + idle_timeout, watchdog)

        async def watch_stop() -> None:
            await stop.wait()
            interrupt(Stopped)

        timer = loop.call_at(last + idle_timeout, watchdog) if idle_timeout else None
        watcher = asyncio.ensure_future(watch_stop())
        try:
            if self._pending:
                chunk, self._pending = self._pending, b""
                await deliver(chunk)
            while why is None:
                reading = True
                try:
                    chunk = await anext(self._chunks)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    # ours (``why`` set) unless the task itself is being cancelled as well
                    if why is None or (hasattr(task, "uncancel") and task.uncancel() > 0):
                        raise
                    break
                finally:
                    reading = False
                last = loop.time()
                await deliver(chunk)
            raise why()
        finally:
            watcher.cancel()
            if timer is not None:
                timer.cancel()

    async def read_all(self, limit: int, timeout: float) -> bytes:
        """The rest of the body (an error answer: small), at most ``limit`` bytes."""
        parts, size = [], 0
        while (chunk := await self.next(timeout)) is not None:
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise httpx.RemoteProtocolError("the peer's error body is too large")
        return b"".join(parts)

    def _cancel_stopper(self) -> None:
        if self._stopper is not None:
            self._stopper.cancel()
        self._stop = self._stopper = None

    async def aclose(self) -> None:
        self._cancel_stopper()
        await self.response.aclose()


async def open_relayed(client: httpx.AsyncClient, request: httpx.Request, first_byte_timeout: float,
                       stop: asyncio.Event | None = None) -> Upstream:
    """Send a forwarded request; return once the peer's real response head is in."""
    try:
        response = await asyncio.wait_for(client.send(request, stream=True), first_byte_timeout)
    except asyncio.TimeoutError:
        raise PeerSilent() from None
    upstream = Upstream(response)
    try:
        await upstream.read_head(first_byte_timeout, stop)
    except BaseException:
        await upstream.aclose()
        raise
    return upstream
