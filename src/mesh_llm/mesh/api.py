"""The mesh's own routes: node-to-node (``POST /mesh/heartbeat``, ``POST /mesh/leave``), which need
a request signed with the mesh token (``mesh/security.py``) and, on a node with a mesh port, come
there (the gateway answers them a 421 on the API port), and the management API (``GET
/api/status``, ``GET /api/mesh``), which needs such a signature or the API key. Peers' bodies are
bounded and validated; bad ones get a 4xx in OpenAI's error format and change nothing. A heartbeat's
reply is signed back, bound to the request."""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mesh_llm.api.app import key_matches
from mesh_llm.api.errors import APIError, error_response
from mesh_llm.mesh.identity import BadSignature, opened
from mesh_llm.mesh.records import Heartbeat, NodeRecord, Signed
from mesh_llm.mesh.security import AUTH_HEADER

MAX_PEER_BODY = 1024 * 1024
log = logging.getLogger("mesh_llm.mesh")

CONTROL_PATHS = ("/mesh/", "/api/status", "/api/mesh")


def is_control(path: str) -> bool:
    return path.startswith(CONTROL_PATHS[0]) or path in CONTROL_PATHS[1:]


def control_app(node, api_key: str | None) -> FastAPI:
    app = FastAPI(title="mesh-llm mesh", docs_url=None, redoc_url=None, openapi_url=None)
    _errors(app)

    def signed(request: Request, body: bytes) -> str | None:
        return node.auth.check(request.headers.get(AUTH_HEADER), request.method, request.url.path, body,
                               node.channel_key(request.scope))

    async def peer(request: Request) -> tuple[bytes, str]:
        """The request's body and nonce, once its signature holds."""
        body = await _body(request)
        nonce = signed(request, body)
        if nonce is None:
            raise APIError(401, f"this route needs a request signed with the mesh token in '{AUTH_HEADER}'",
                           code="invalid_mesh_token")
        return body, nonce

    async def reader(request: Request) -> None:
        if api_key is not None and key_matches(request.headers, api_key):
            return
        if signed(request, await _body(request)) is None:
            raise APIError(401, f"send a request signed with the mesh token in '{AUTH_HEADER}' (mesh-llm mesh "
                           "status does)" + (" or 'Authorization: Bearer <API key>'" if api_key else ""),
                           code="invalid_mesh_token")

    @app.post("/mesh/heartbeat")
    async def heartbeat(signed_body: tuple[bytes, str] = Depends(peer)) -> Response:
        body, nonce = signed_body
        beat = _parse(body, Heartbeat)
        sender = _opened(beat.sender, NodeRecord, "sender")
        if sender.id == node.id:
            raise APIError(409, f"a node with the id '{node.id}' is already in this mesh at {node.url}",
                           param="sender.id", code="node_id_taken")
        reply = node.take_heartbeat(beat, sender).model_dump_json().encode()
        return Response(reply, media_type="application/json", headers={AUTH_HEADER: node.auth.answer(nonce, reply)})

    @app.post("/mesh/leave")
    async def leave(signed_body: tuple[bytes, str] = Depends(peer)) -> dict:
        notice = _parse(signed_body[0], Signed)
        try:
            node.take_leave(notice)
        except BadSignature as exc:
            raise APIError(400, f"invalid leave: {exc}", param="body", code="invalid_value") from None
        return {"ok": True}

    @app.get("/api/status", dependencies=[Depends(reader)])
    async def status() -> dict:
        record = node.record()
        return {**record.model_dump(mode="json"), "key": node.key.public, "uptime_s": round(node.uptime(), 1),
                "members_up": len(node.membership.up()), "members_down": len(node.membership.members())
                - len(node.membership.up())}

    @app.get("/api/mesh", dependencies=[Depends(reader)])
    async def mesh() -> dict:
        own = {**node.record().model_dump(mode="json"), "key": node.key.public, "state": "self",
               "last_heartbeat_s": 0.0}
        members = [{**m.record.model_dump(mode="json"), "key": m.signed.key, "state": "up" if m.up else "down",
                    "demoted": node.demoted(m.id),
                    "last_heartbeat_s": round(node.membership.age(m), 2)}
                   for m in sorted(node.membership.members(), key=lambda m: m.id)]
        return {"node": node.id, "members": [own, *members], "models": node.model_list()}

    return app


async def _body(request: Request) -> bytes:
    """The body, at most ``MAX_PEER_BODY`` bytes (read once: a second call gets the same bytes)."""
    if (kept := getattr(request.state, "peer_body", None)) is not None:
        return kept
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_PEER_BODY:
        raise APIError(413, f"the body is over {MAX_PEER_BODY} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_PEER_BODY:
            raise APIError(413, f"the body is over {MAX_PEER_BODY} bytes", code="request_too_large")
    request.state.peer_body = bytes(body)
    return request.state.peer_body


def _opened(signed: Signed, shape: type[BaseModel], param: str):
    try:
        return opened(signed, shape)
    except BadSignature as exc:
        raise APIError(400, f"invalid heartbeat: {exc}", param=param, code="invalid_value") from None


def _parse(body: bytes, shape: type[BaseModel]):
    try:
        return shape.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        if first.get("type") == "json_invalid":
            raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
        raise APIError(400, f"invalid {shape.__name__.lower()}: {first.get('msg', 'bad value')}", param=where,
                       code="invalid_value") from None


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ClientDisconnect)
    async def _left(request: Request, exc: ClientDisconnect) -> JSONResponse:
        log.info("a peer left before its request's body arrived (%s)", request.url.path)
        return error_response(400, "the request's body did not arrive", code="client_left")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, "invalid request", code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "no such route" if exc.status_code == 404 else str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a mesh route")
        return error_response(500, "internal server error", code="internal_error")
