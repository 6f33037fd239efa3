"""One attempt to have a peer serve a request, from the entry node: forward it with the mesh token,
wait at most the first-byte timeout, then either pass the answer through to the client, unbuffered,
or report why the next candidate should be tried.

An answer means "try another node" when it says this node cannot serve the request now but another
might: a 5xx, a 429 (its queue is full), a 404 (it no longer has the model or route), or a
context-overflow 400. Any other 4xx is the client's own mistake and goes back as it is. A stream that
breaks after it began cannot be moved: it ends with an error event, as a local failure would."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

from mesh_llm.api.errors import error_body
from mesh_llm.mesh.relay import RELAY_HEADER, PeerSilent, Stopped, Upstream, open_relayed
from mesh_llm.mesh.security import AUTH_HEADER

MAX_ERROR_BODY = 1024 * 1024
# request headers that belong to this hop or to the client's relation with the entry node
_NOT_FORWARDED = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                  "trailer", "upgrade", "expect", "authorization", "proxy-authorization"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
# what the entry node says itself: which node served the answer is the one it sent the request to
_NOT_PASSED_BACK = {*_HOP_BY_HOP, "x-mesh-served-by"}


@dataclass
class Answer:
    """A whole response held back while the node decides whether to pass it on."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def error_code(self) -> str | None:
        try:
            error = json.loads(self.body)["error"]
            return error.get("code") if isinstance(error, dict) else None
        except (ValueError, KeyError, TypeError):
            return None

    async def send(self, send, extra: list[tuple[bytes, bytes]] = ()) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": [*self.headers, *extra]})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


@dataclass
class Failure:
    """Why a candidate did not serve the request; ``answer`` is what it said, when that is worth
    giving the client if no other node serves it either (a full queue, a context too small)."""

    reason: str
    answer: Answer | None = None

    @property
    def at_fault(self) -> bool:
        """The node failed (silent, unreachable, broken off, a 5xx, no such model), rather than
        being full or too small for this prompt."""
        return self.answer is None or self.answer.status >= 500 or self.answer.status == 404


class ClientGone(Exception):
    """The client disconnected: stop trying nodes."""


def verdict(answer: Answer) -> str | None:
    """None to pass an answer to the client; otherwise why the next candidate should be tried."""
    status, code = answer.status, answer.error_code()
    if status < 400:
        return None
    if status >= 500:
        return f"answered {status}" + (f" ({code})" if code else "")
    if status == 400 and code == "context_length_exceeded":
        return "the prompt does not fit its context"
    if status in (404, 429):
        return f"answered {status}" + (f" ({code})" if code else "")
    return None


def forward_headers(headers: list[tuple[bytes, bytes]], signature: str, entry_id: str) -> list[tuple[str, str]]:
    """A client's headers as a peer gets them: this node's own signature (``MeshAuth.sign``) and id
    in place of any ``x-mesh-*`` the client sent."""
    kept = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
            if (name := k.decode("latin-1").lower()) not in _NOT_FORWARDED and not name.startswith("x-mesh-")]
    return [*kept, (AUTH_HEADER, signature), ("x-mesh-forwarded", entry_id)]


async def attempt(http: httpx.AsyncClient, url: str, scope: dict, body: bytes, headers: list[tuple[str, str]],
                  first_byte_timeout: float, peer_lost: asyncio.Event, receive, send,
                  extra: list[tuple[bytes, bytes]], idle_timeout: float = 0, served_by: str = ""
                  ) -> Failure | None:
    """Forward to ``url``; None once the answer went to the client, else a :class:`Failure`.
    ``peer_lost`` is set (by the caller) when the peer is marked down meanwhile; a body that stops
    for ``idle_timeout`` seconds once under way is ended (0: never), as if the peer had gone. The
    answer's ``x-mesh-served-by`` is ``served_by``, the member it was sent to, whatever it says."""
    query = scope.get("query_string", b"").decode("latin-1")
    request = http.build_request(scope["method"], url + scope["path"] + (f"?{query}" if query else ""),
                                 headers=headers, content=body)
    stop = asyncio.Event()
    client_gone = asyncio.Event()
    watchers = [asyncio.create_task(_wait_disconnect(receive, client_gone, stop)),
                asyncio.create_task(_relay_event(peer_lost, stop))]
    try:
        try:
            upstream = await open_relayed(http, request, first_byte_timeout, stop)
        except PeerSilent:
            return Failure(f"sent nothing in {first_byte_timeout:g}s")
        except Stopped:
            if client_gone.is_set():
                raise ClientGone() from None
            return Failure("went down")
        except httpx.ConnectError as exc:
            return Failure(f"cannot be reached ({_short(exc)})")
        except httpx.HTTPError as exc:
            return Failure(f"dropped the request ({_short(exc)})")
        try:
            return await _deliver(upstream, first_byte_timeout, idle_timeout, stop, client_gone, send,
                                  extra, served_by)
        finally:
            await upstream.aclose()
    finally:
        for task in watchers:
            task.cancel()


async def _deliver(upstream: Upstream, timeout: float, idle_timeout: float, stop: asyncio.Event,
                   client_gone: asyncio.Event, send, extra, served_by: str) -> Failure | None:
    if upstream.response.headers.get(RELAY_HEADER) != "1":
        return Failure(f"answered {upstream.status} without relaying (a different mesh token?)")
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in upstream.headers
               if k.lower() not in _NOT_PASSED_BACK]
    if served_by:
        headers.append((b"x-mesh-served-by", served_by.encode("latin-1")))
    if upstream.status >= 400:
        try:
            answer = Answer(upstream.status, headers, await upstream.read_all(MAX_ERROR_BODY, timeout))
        except (httpx.HTTPError, PeerSilent) as exc:
            return Failure(f"broke off its answer ({_short(exc)})")
        reason = verdict(answer)
        if reason is not None:
            return Failure(reason, answer)
        await answer.send(send, extra)
        return None
    await send({"type": "http.response.start", "status": upstream.status, "headers": [*headers, *extra]})
    content_type = next((v for k, v in upstream.headers if k.lower() == "content-type"), "")
    await _pipe(upstream, idle_timeout, stop, client_gone, send, content_type.startswith("text/event-stream"))
    return None


async def _pipe(upstream: Upstream, idle_timeout: float, stop: asyncio.Event, client_gone: asyncio.Event,
                send, sse: bool) -> None:
    """Pass the body on as it comes; server-sent events whole, so that an error event can follow
    the last complete one if the peer breaks off or falls silent (a node whose heartbeats go on
    while its engine is stuck would otherwise hold the stream for ever)."""
    pending = b""

    async def deliver(chunk: bytes) -> None:
        nonlocal pending
        if sse:
            pending += chunk
            cut = pending.rfind(b"\n\n") + 2
            if cut < 2:
                return
            chunk, pending = pending[:cut], pending[cut:]
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    try:
        await upstream.pipe(deliver, idle_timeout or None, stop)
    except (httpx.HTTPError, Stopped, PeerSilent) as exc:
        if client_gone.is_set():
            return
        reason = ("the node went down" if isinstance(exc, Stopped) else
                  f"it sent nothing for {idle_timeout:g}s" if isinstance(exc, PeerSilent) else
                  f"the connection broke ({_short(exc)})")
        if not sse:
            raise PeerBrokeOff(reason) from None  # no valid way to end a half-sent JSON body
        event = error_body(502, f"the node serving this stream failed: {reason}", code="peer_failed")
        event["error"]["type"] = "server_error"
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class PeerBrokeOff(Exception):
    """A non-streamed answer broke off midway; the client's connection is closed."""


async def _wait_disconnect(receive, client_gone: asyncio.Event, stop: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    client_gone.set()
    stop.set()


async def _relay_event(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:200]
