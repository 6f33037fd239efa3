"""The HTTP layer: OpenAI routes that validate a request, turn it into token ids and a
:class:`GenerationRequest`, and hand it to the model's worker. Nothing here touches an engine."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mesh_llm.api.body import UnreadableBody, body_schema, json_body, with_body_schemas
from mesh_llm.api.chat_tools import chat_plan
from mesh_llm.api.errors import (
    GENERATION_ERRORS,
    APIError,
    documented,
    error_response,
    unsupported,
    without_validation_errors,
)
from mesh_llm.api.generation import PromptRoom, collect_unless_left, open_generation, stream_response
from mesh_llm.api.messages_api import AnthropicErrors, install_messages
from mesh_llm.api.messages_schemas import CreateMessage, MessagesRequest
from mesh_llm.api.responses import ResponseBuilder
from mesh_llm.api.responses_api import install_responses
from mesh_llm.api.responses_schemas import ResponsesRequest
from mesh_llm.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from mesh_llm.engines.base import SamplingParams
from mesh_llm.runtime.prompt_limit import PromptTooLong, encode_within
from mesh_llm.runtime.tools import ChatPlan
from mesh_llm.runtime.worker import Arrival, Incoming, ModelWorker

log = logging.getLogger("mesh_llm.api")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
PEER_SCOPE_KEY = "mesh_llm.peer"  # set by the mesh gateway on a request a peer forwarded with the mesh token


@dataclass
class ServedModel:
    """A model as the API lists it: the id clients send, the worker that serves it, its format."""

    id: str
    worker: ModelWorker
    format: str
    created: int


def create_app(models: list[ServedModel], api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, incoming: Incoming | None = None) -> FastAPI:
    """``incoming``: the counter the models' workers were given, to count bodies being read."""
    by_id = {m.id: m for m in models}
    # where a key is set the API's schema is not served: that route would answer without the key
    app = FastAPI(title="mesh-llm", docs_url=None, redoc_url=None,
                  openapi_url=None if api_key is not None else "/openapi.json")
    app.state.models = by_id
    app.state.incoming = incoming
    _install_error_handlers(app)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:  # checked before any body is read
        app.add_middleware(_RequireKey, api_key=api_key)
    app.add_middleware(AnthropicErrors)  # outermost: the Messages routes' errors in Anthropic's shape

    def lookup(model_id: str | None) -> ServedModel:
        if model_id is None:
            if len(by_id) != 1:
                raise APIError(400, f"name a model: this server serves {', '.join(by_id) or 'none'}",
                               param="model", code="missing_required_parameter")
            model_id = next(iter(by_id))
        served = by_id.get(model_id)
        if served is None:
            raise APIError(404, f"the model '{model_id}' does not exist; available: {', '.join(by_id)}",
                           param="model", code="model_not_found")
        if not served.worker.ready:
            raise APIError(503, f"the model '{model_id}' is still loading", param="model",
                           code="model_loading")
        return served

    @app.get("/health", responses=documented(503))
    async def health() -> JSONResponse:
        if all(m.worker.ready for m in by_id.values()):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/v1/models", responses=documented(401))
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_json(m) for m in by_id.values()]}

    @app.get("/v1/models/{model_id:path}", responses=documented(401, 404))
    async def get_model(model_id: str) -> dict:
        if model_id not in by_id:
            raise APIError(404, f"the model '{model_id}' does not exist; available: {', '.join(by_id)}",
                           param="model", code="model_not_found")
        return _model_json(by_id[model_id])

    @app.get("/api/cache", responses=documented(401))
    async def cache_stats() -> dict:
        """Each model's prompt cache: entries, bytes, hits, misses, tokens reused, evictions."""
        return {"data": [{"model": m.id, "engine": m.worker.info.engine if m.worker.info else None,
                          **m.worker.cache_stats()} for m in by_id.values()]}

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS, openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(body: json_body(ChatCompletionRequest), request: Request):
        served = lookup(body.model)
        with served.worker.arriving() as arrival:
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
            room = PromptRoom.of(served.worker, body.token_limit(), "messages")
            plan = await chat_plan(served.worker.tokenizer, body, room)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            return await _complete(served, body, plan.prompt, logprobs, "chat", request, arrival, plan)

    @app.post("/v1/completions", responses=GENERATION_ERRORS, openapi_extra=body_schema(CompletionRequest))
    async def completions(body: json_body(CompletionRequest), request: Request):
        served = lookup(body.model)
        if (name := body.refused_field()) is not None:
            raise unsupported(name)
        with served.worker.arriving() as arrival:
            ids = await _prompt_ids(served, body)
            return await _complete(served, body, ids, body.logprobs, "text", request, arrival)

    install_responses(app, lookup)
    install_messages(app, lookup)
    schema = app.openapi
    app.openapi = lambda: with_body_schemas(without_validation_errors(schema()),
                                            [ChatCompletionRequest, CompletionRequest, ResponsesRequest,
                                             CreateMessage, MessagesRequest])
    return app


async def _prompt_ids(served: ServedModel, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        room = PromptRoom.of(served.worker, body.token_limit(), "prompt")
        try:
            ids = await run_in_threadpool(encode_within, served.worker.tokenizer, prompt, True, room.tokens)
        except PromptTooLong as exc:
            raise room.exceeded(exc.at_least) from None
    else:
        ids = list(prompt)
        vocab = served.worker.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _model_json(m: ServedModel) -> dict:
    info = m.worker.info
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "mesh-llm",
            "engine": info.engine if info else None, "format": m.format,
            "context_length": info.context_length if info else None}


async def _complete(served: ServedModel, body: SamplingFields, prompt: list[int], logprobs: int | None,
                    kind: str, request: Request, arrival: Arrival, plan: ChatPlan | None = None):
    if body.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    constraint = plan.constraint if plan is not None else None
    if constraint is not None and body.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with a constrained reply (response_format or a "
                       "required tool call): the grammar ends it", param="ignore_eos")
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            min_p=body.min_p, seed=body.seed, logprobs=logprobs, constraint=constraint)
    generation = open_generation(served.worker, prompt, params, body.token_limit(), body.stop_list(),
                                 body.ignore_eos, "messages" if kind == "chat" else "prompt", arrival)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    builder = ResponseBuilder(kind, served.id, logprobs is not None, include_usage,
                              plan.parser if plan is not None else None)
    if body.stream:
        return stream_response(builder.stream(aiter(generation)), generation)
    return await collect_unless_left(builder.collect(aiter(generation)), request, generation)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", code="invalid_json")
        # a value no branch of a union takes: the branch that got furthest says most ("list[TextPart]",
        # 0, "type": "Input should be 'text'"), named without pydantic's branch tags
        first = max(errors, key=lambda e: len(e.get("loc", ())), default=first)
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_branch(p)]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "missing":
            message = f"the field '{param}' is required" if param else "the request body is empty: send a JSON object"
        elif param:
            message = f"invalid value for '{param}': {message}"
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        code = "request_too_large" if exc.status_code == 413 else None  # a body counted past the limit
        return error_response(exc.status_code, message, code=code, headers=headers)

    @app.exception_handler(UnreadableBody)
    async def _unreadable(_: Request, exc: UnreadableBody):
        return error_response(400, "the request body could not be read as JSON (bytes that are not UTF-8, "
                              "or nesting too deep)", code="invalid_json")

    @app.exception_handler(UnicodeEncodeError)
    async def _not_unicode(_: Request, exc: UnicodeEncodeError):
        # JSON lets a string hold a lone surrogate ("\\ud800"), which no tokenizer can encode
        return error_response(400, f"the request holds text that is not valid Unicode (a lone surrogate "
                              f"at position {exc.start} of a string)", code="invalid_value")

    @app.exception_handler(ClientDisconnect)
    async def _left(request: Request, exc: ClientDisconnect):
        # a client (or a peer that gave up on a frozen node) that closed before its body arrived:
        # nothing to answer, and nothing went wrong here
        log.info("a client left before its request's body arrived (%s %s)", request.method, request.url.path)
        return error_response(400, "the request's body did not arrive", code="client_left")

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError):
        return error_response(400, "the request nests JSON too deeply", code="invalid_value")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal server error", code="internal_error")


def _union_branch(part) -> bool:
    """A location part naming the branch of a union pydantic tried (``str``, ``list[TextPart]``)."""
    return isinstance(part, str) and (part.endswith("]") or part in ("str", "int", "float", "bool", "dict", "list"))


def key_matches(headers: Headers, key: str) -> bool:
    """``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's), compared
    in constant time."""
    header = headers.get("authorization") or ""
    bearer = header[7:] if header.lower().startswith("bearer ") else ""
    given = headers.get("x-api-key") or ""
    return hmac.compare_digest(bearer.encode(), key.encode()) | hmac.compare_digest(given.encode(), key.encode())


def key_refused():
    """The 401 for a request without the API key (the app's and the mesh gateway's)."""
    return error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or "
                          "'x-api-key: <key>')", code="invalid_api_key")


class _RequireKey:
    """Answers 401 from the headers alone, before a body is read or parsed: a client without the key
    costs the server nothing however large its body. ``/health`` stays open; a request a mesh peer
    forwarded (``PEER_SCOPE_KEY``) was checked by the node that took it."""

    OPEN = frozenset({"/health"})

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN or scope.get(PEER_SCOPE_KEY):
            return await self.app(scope, receive, send)
        if not key_matches(Headers(scope=scope), self.api_key):
            return await key_refused()(scope, receive, send)
        await self.app(scope, receive, send)


class _BodyLimit:
    """Answers 413 before reading a body larger than ``max_bytes`` (by header or by counting)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(scope, receive, send)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # FastAPI re-raises HTTP exceptions met while reading
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"the request body is over {self.max_bytes} bytes"

    async def _reject(self, scope, receive, send):
        await error_response(413, self._message(), code="request_too_large")(scope, receive, send)
