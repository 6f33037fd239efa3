"""Request bodies read and validated in a worker thread rather than on the event loop, which carries
every stream's tokens: FastAPI parses and validates a body inline, so one 3 MB chat of 100,000 short
messages held every running stream for a second, and one with 60,000 invalid parts for 3.6 s. In a
thread, pure-Python work (pydantic's error list, our validators) yields the interpreter every few
milliseconds; what stays is the C JSON parser's own share (about 40 ms per MB of tiny values, see
docs/api.md). While a body is read, the request counts as on its way to the workers
(``app.state.incoming``), so an idle worker's first step waits for it as for one being tokenized.
Bodies are declared in the OpenAPI document as FastAPI declares its own."""

from __future__ import annotations

import json
from contextlib import nullcontext
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

M = TypeVar("M", bound=BaseModel)

COMPONENTS = "#/components/schemas/{model}"


class UnreadableBody(ValueError):
    """Bytes that are not UTF-8, or JSON nested past the parser's depth."""


def json_body(model: type[M]) -> Any:
    """The annotation for a route's body: ``body: json_body(ChatCompletionRequest)``."""

    async def parse(request: Request) -> M:
        incoming = request.app.state.incoming  # set by create_app
        with incoming.counted() if incoming is not None else nullcontext():
            return await run_in_threadpool(_validated, model, await request.body())

    return Annotated[model, Depends(parse)]


def _validated(model: type[M], raw: bytes) -> M:
    # json.loads, as FastAPI parses: it keeps a lone surrogate ("\ud800"), which the API refuses
    # later by name, where pydantic's own parser would only say the JSON is invalid
    if not raw.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": exc.msg}]) from None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise UnreadableBody(str(exc)) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        # the handler names the first error, or the one that got deepest into a union: only those
        # two go back to the event loop, not a list as long as the body
        deepest = max(errors, key=lambda e: len(e.get("loc", ())))
        raise RequestValidationError([errors[0], deepest]) from None


def body_schema(model: type[BaseModel]) -> dict:
    """``openapi_extra=`` for a route whose body is ``json_body(model)``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": COMPONENTS.format(model=model.__name__)}}}}}


def with_body_schemas(schema: dict, models: list[type[BaseModel]]) -> dict:
    """Adds the body models (and the models they use) to the document's components."""
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=COMPONENTS)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in top.get("$defs", {}).items():
        components.setdefault(name, definition)
    return schema
