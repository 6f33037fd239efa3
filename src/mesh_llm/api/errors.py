"""OpenAI-format error bodies, so clients see ``{"error": {message, type, param, code}}`` for every failure."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def unsupported(field: str) -> APIError:
    """A field sent that this server would not honour: a 400, never silence."""
    return APIError(400, f"'{field}' is not supported by this server", param=field, code="unsupported_parameter")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": printable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": printable(param), "code": code}}


def printable(text: str | None) -> str | None:
    """``text`` as UTF-8 can carry it: a lone surrogate a client sent (JSON allows ``"\\ud800"``) and
    an error message quotes back is written as its escape, not left to fail the response."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error this server answers, for the OpenAPI document."""

    error: ErrorDetail


_MEANINGS = {
    400: "Invalid request: a malformed body, a refused field, a prompt over the context",
    401: "Missing or wrong API key",
    404: "No such model",
    413: "Request body over the limit",
    429: "The model's queue is full (see Retry-After)",
    500: "The generation failed",
    503: "A model still loading, or the server shutting down",
    504: "The request ran past the server's --request-timeout",
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """The errors of Anthropic's Messages routes, in its shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def documented(*statuses: int, body: type[BaseModel] = ErrorBody) -> dict:
    """``responses=`` for a route: each error status it may answer, with the error body."""
    return {status: {"model": body, "description": _MEANINGS[status]} for status in statuses}


GENERATION_ERRORS = documented(400, 401, 404, 413, 429, 500, 503, 504)
MESSAGES_ERRORS = documented(400, 401, 404, 413, 429, 500, 503, 504, body=AnthropicErrorBody)


def without_validation_errors(schema: dict) -> dict:
    """FastAPI declares a 422 for every route with a body; this server answers 400 instead."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema

