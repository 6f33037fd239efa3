"""The node's front door when it is in a mesh: an ASGI app in front of the server's own app that
decides, before the local routes run, whether a request is served here or by a peer.

- ``/mesh/*``, ``/api/status``, ``/api/mesh``: the mesh's own routes (``mesh/api.py``).
- A request a peer forwarded (``x-mesh-forwarded`` with the mesh token) is served here, never sent
  on, and answered through the relay (``mesh/relay.py``); the API key is the entry node's business.
- ``GET /v1/models`` lists every model in the mesh.
- ``POST /v1/...`` with a ``model``: the candidates in routing order (``mesh/routing.py``), each tried
  until one serves it; none: a 503 saying the model is not available now.
- Everything else goes to the local app as it came. Every response says who served it
  (``x-mesh-served-by``)."""

from __future__ import annotations

import json
import logging

import httpx
from starlette.datastructures import Headers

from mesh_llm.api.app import PEER_SCOPE_KEY, key_matches, key_refused
from mesh_llm.api.errors import error_response
from mesh_llm.mesh.api import control_app, is_control
from mesh_llm.mesh.node import MeshNode
from mesh_llm.mesh.proxy import Answer, ClientGone, Failure, attempt, forward_headers, verdict
from mesh_llm.mesh.relay import serve_relayed
from mesh_llm.mesh.security import ADDRESS_HEADER, AUTH_HEADER

log = logging.getLogger("mesh_llm.mesh")


class Gateway:
    def __init__(self, app, node: MeshNode, api_key: str | None, max_body_bytes: int):
        self.app, self.node, self.api_key, self.max_body_bytes = app, node, api_key, max_body_bytes
        self.control = control_app(node, api_key)
        self._served_by = (b"x-mesh-served-by", node.id.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._http(scope, receive, watched)
        except Exception:
            if started:
                raise
            log.exception("mesh: unhandled error")
            await error_response(500, "internal server error", code="internal_error")(scope, receive, send)

    async def _http(self, scope, receive, send) -> None:
        path, headers = scope["path"], Headers(scope=scope)
        node_to_node = path.startswith("/mesh/") or "x-mesh-forwarded" in headers
        if node_to_node and self.node.off_channel(scope):  # a node with a mesh port takes it there
            return await error_response(421, f"node-to-node traffic to this node goes to its mesh port, "
                                        f"{self.node.url}, encrypted", code="mesh_address",
                                        headers={ADDRESS_HEADER: self.node.url})(scope, receive, send)
        if is_control(path):
            return await self.control(scope, receive, send)
        if "x-mesh-forwarded" in headers:
            body = await _read_body(receive, self.max_body_bytes)
            if body is None or self.node.auth.check(headers.get(AUTH_HEADER), scope["method"], path, body,
                                                    self.node.channel_key(scope)) is None:
                return await error_response(401, "a forwarded request needs a mesh token signature",
                                            code="invalid_mesh_token")(scope, receive, send)
            scope[PEER_SCOPE_KEY] = headers["x-mesh-forwarded"]
            return await self._counted(serve_relayed(self._local, scope, _replayed(body, receive), send))
        if not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.api_key is not None and not key_matches(headers, self.api_key):
            return await key_refused()(scope, receive, send)
        if scope["method"] == "GET" and path == "/v1/models":
            body = {"object": "list", "data": self.node.model_list()}
            return await _json(200, body, [self._served_by])(scope, receive, send)
        if scope["method"] == "GET" and path.startswith("/v1/models/"):  # any model the mesh lists
            listed, wanted = {m["id"]: m for m in self.node.model_list()}, path.removeprefix("/v1/models/")
            model = listed.get(wanted)
            if model is None:
                message = (f"the model '{wanted}' does not exist in this mesh; "
                           f"available: {', '.join(listed) or 'none'}")
                return await error_response(404, message, param="model", code="model_not_found")(scope, receive, send)
            return await _json(200, model, [self._served_by])(scope, receive, send)
        if scope["method"] != "POST":
            return await self._local(scope, receive, send)
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            return await error_response(413, f"the request body is over {self.max_body_bytes} bytes",
                                        code="request_too_large")(scope, receive, send)
        await self._counted(self._route(scope, receive, send, body, headers))

    async def _counted(self, work) -> None:
        self.node.streams += 1
        try:
            await work
        finally:
            self.node.streams -= 1

    async def _local(self, scope, receive, send) -> None:
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._served_by]}
            await send(message)

        await self.app(scope, receive, tagged)

    # -- routing -----------------------------------------------------------------------------------------

    async def _route(self, scope, receive, send, body: bytes, headers: Headers) -> None:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        model = payload.get("model") if isinstance(payload, dict) else None
        if isinstance(payload, dict) and model is None:  # the mesh's one model, as a server's own
            listed = [m["id"] for m in self.node.model_list()]
            if len(listed) != 1:
                return await error_response(400, f"name a model: this mesh serves {', '.join(listed) or 'none'}",
                                            param="model", code="missing_required_parameter")(scope, receive, send)
            model, body = listed[0], json.dumps({**payload, "model": listed[0]}).encode()
            payload["model"] = model
        if not isinstance(model, str):  # the local app words the 400 as it does for any bad body
            return await self._local(scope, _replay(body, receive), send)
        exclude = frozenset(n.strip() for n in headers.get("x-mesh-exclude", "").split(",") if n.strip())
        ranked, prefix = self.node.candidates(model, payload, headers.get("x-mesh-target"), exclude)
        if not ranked:
            if model in self.node.local and "x-mesh-exclude" not in headers:  # loading: let it say so
                return await self._local(scope, _replay(body, receive), send)
            return await self._unavailable(model, [], send, scope, receive)
        failures: list[tuple[str, Failure]] = []
        for candidate in ranked:
            extra = _failed_header(failures)
            try:
                if candidate.local:
                    failure = await self._try_local(scope, _replay(body, receive), send, extra)
                else:
                    failure = await self._try_peer(candidate.id, model, scope, body, receive, send, extra)
            except ClientGone:
                return
            if failure is None:
                self.node.affinity.record(prefix, candidate.id)
                if not candidate.local:
                    self.node.served(candidate.id, model)
                return
            log.warning("mesh: %s could not serve %s: %s", candidate.id, model, failure.reason)
            if not candidate.local and failure.at_fault:
                self.node.demote(candidate.id, model, failure.reason)
            failures.append((candidate.id, failure))
        await self._unavailable(model, failures, send, scope, receive)

    async def _try_local(self, scope, receive, send, extra) -> Failure | None:
        """Run the local app; an answer that sends the request elsewhere is held back, not sent."""
        held: Answer | None = None

        async def hold(message):
            nonlocal held
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), self._served_by]
                if message["status"] >= 400:
                    held = Answer(message["status"], headers, b"")
                    return
                message = {**message, "headers": [*headers, *extra]}
            elif held is not None:
                held.body += message.get("body", b"")
                return
            await send(message)

        await self.app(scope, receive, hold)
        if held is None:
            return None
        reason = verdict(held)
        if reason is None:
            await held.send(send, extra)
            return None
        return Failure(reason, held)

    async def _try_peer(self, member_id: str, model: str, scope, body: bytes, receive, send, extra):
        member = self.node.membership.get(member_id)
        if member is None:
            return Failure("left the mesh")
        try:
            http, peer = await self.node.peers.client(member.record.url, member.signed.key)
        except httpx.ConnectError as exc:
            return Failure(f"cannot be reached ({exc})")
        signature = self.node.auth.sign(scope["method"], scope["path"], body, peer)
        headers = forward_headers(scope["headers"], signature, self.node.id)
        with self.node.watch(member_id, model) as lost:
            return await attempt(http, member.record.url, scope, body, headers,
                                 self.node.config.first_byte_timeout, lost, receive, send, extra,
                                 idle_timeout=self.node.config.stream_idle_timeout, served_by=member_id)

    async def _unavailable(self, model: str, failures: list[tuple[str, Failure]], send, scope, receive):
        """No node served it: a node's own client-side answer if one gave one (a full queue, a prompt
        over every context), else 503 (or 404 for a model the mesh has never had)."""
        extra = _failed_header(failures)
        answers = [f.answer for _, f in failures if f.answer is not None and f.answer.status < 500]
        if answers:
            return await answers[-1].send(send, extra)
        if not failures and not self.node.known(model):
            available = ", ".join(m["id"] for m in self.node.model_list()) or "none"
            response = error_response(404, f"the model '{model}' does not exist in this mesh; available: "
                                      f"{available}", param="model", code="model_not_found")
        else:
            why = "; ".join(f"{node}: {f.reason}" for node, f in failures) or "no node serving it is up"
            response = error_response(503, f"the model '{model}' is not available now ({why})",
                                      param="model", code="model_unavailable")
        response.headers.update({k.decode(): v.decode("latin-1") for k, v in [self._served_by, *extra]})
        await response(scope, receive, send)

    # -- lifespan ----------------------------------------------------------------------------------------

    async def _lifespan(self, scope, receive, send) -> None:
        async def hooked():
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.node.start()
            elif message["type"] == "lifespan.shutdown":
                await self.node.stop()
            return message

        await self.app(scope, hooked, send)


def _replay(body: bytes, receive):
    """A ``receive`` that gives the body already read, then the client's own (for its disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _replayed(body: bytes, receive):
    """``receive`` for an app, once the body was read: the body, then what the client sends next
    (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again():
        return pending.pop() if pending else await receive()

    return again


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes ``limit`` bytes."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _failed_header(failures: list[tuple[str, Failure]]) -> list[tuple[bytes, bytes]]:
    if not failures:
        return []
    text = "; ".join(f"{node}: {f.reason}" for node, f in failures)
    return [(b"x-mesh-failed", text.encode("latin-1", "replace")[:2000])]


def _json(status: int, body: dict, headers: list[tuple[bytes, bytes]]):
    from fastapi.responses import JSONResponse

    response = JSONResponse(body, status_code=status)
    response.raw_headers.extend(headers)
    return response
