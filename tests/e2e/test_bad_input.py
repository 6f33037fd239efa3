"""Malformed requests each get an OpenAI error body with the right status; the server stays healthy."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "Hi"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"

# (name, method, path, body: dict | bytes | None, status, error type, param or None)
CASES = [
    ("malformed json", "POST", CHAT, b'{"model": "x", "messages": [', 400, "invalid_request_error", None),
    ("body is a list", "POST", CHAT, b"[1, 2]", 400, "invalid_request_error", None),
    ("body is not utf-8", "POST", CHAT, b"\xff\xfe\x00", 400, "invalid_request_error", None),
    ("model not a string", "POST", CHAT, {"model": 7, "messages": MSG}, 400, "invalid_request_error", "model"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, "invalid_request_error", "messages"),
    ("empty messages", "POST", CHAT, {"model": MODEL, "messages": []}, 400, "invalid_request_error",
     "messages"),
    ("messages not a list", "POST", CHAT, {"model": MODEL, "messages": "Hi"}, 400,
     "invalid_request_error", "messages"),
    ("message without role", "POST", CHAT, {"model": MODEL, "messages": [{"content": "Hi"}]}, 400,
     "invalid_request_error", "messages.0.role"),
    ("unknown role", "POST", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]},
     400, "invalid_request_error", "messages.0.role"),
    ("content is a number", "POST", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     400, "invalid_request_error", None),
    ("image part", "POST", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "invalid_request_error",
     "messages.0.content.0.type"),  # the union's branch that got furthest, not "messages.0.content.str"
    ("stop is a number", "POST", CHAT, {"model": MODEL, "messages": MSG, "stop": 5}, 400, "invalid_request_error",
     "stop"),
    ("empty body", "POST", CHAT, b"", 400, "invalid_request_error", None),
    ("stream_options without stream", "POST", CHAT, {"model": MODEL, "messages": MSG,
                                                     "stream_options": {"include_usage": True}}, 400,
     "invalid_request_error", "stream_options"),
    ("stored", "POST", CHAT, {"model": MODEL, "messages": MSG, "store": True}, 400, "invalid_request_error", "store"),
    ("completion top_logprobs", "POST", TEXT, {"model": MODEL, "prompt": "a", "top_logprobs": 3}, 400,
     "invalid_request_error", "top_logprobs"),
    ("negative temperature", "POST", CHAT, {"model": MODEL, "messages": MSG, "temperature": -0.5}, 400,
     "invalid_request_error", "temperature"),
    ("temperature is text", "POST", CHAT, {"model": MODEL, "messages": MSG, "temperature": "hot"}, 400,
     "invalid_request_error", "temperature"),
    # JSON of the wrong type is refused, as OpenAI does, not coerced ("5" to 5, true to 1)
    ("max_tokens is text", "POST", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": "5"}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens is a fraction", "POST", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 5.0}, 400,
     "invalid_request_error", "max_tokens"),
    ("stream is text", "POST", CHAT, {"model": MODEL, "messages": MSG, "stream": "yes"}, 400,
     "invalid_request_error", "stream"),
    ("seed is text", "POST", CHAT, {"model": MODEL, "messages": MSG, "seed": "7"}, 400, "invalid_request_error",
     "seed"),
    ("token ids are booleans", "POST", TEXT, {"model": MODEL, "prompt": [True, False]}, 400,
     "invalid_request_error", None),
    ("responses max_output_tokens is text", "POST", "/v1/responses", {"model": MODEL, "input": "Hi",
                                                                        "max_output_tokens": "8"}, 400,
     "invalid_request_error", "max_output_tokens"),
    ("zero max_tokens", "POST", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 0}, 400,
     "invalid_request_error", "max_tokens"),
    ("negative max_tokens", "POST", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": -3}, 400,
     "invalid_request_error", "max_tokens"),
    ("top_p zero", "POST", CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400,
     "invalid_request_error", "top_p"),
    ("five stop strings", "POST", CHAT, {"model": MODEL, "messages": MSG, "stop": list("abcde")}, 400,
     "invalid_request_error", "stop"),
    ("n of two", "POST", CHAT, {"model": MODEL, "messages": MSG, "n": 2}, 400, "invalid_request_error", "n"),
    ("top_logprobs without logprobs", "POST", CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2},
     400, "invalid_request_error", "top_logprobs"),
    ("too many top_logprobs", "POST", CHAT, {"model": MODEL, "messages": MSG, "logprobs": True,
                                             "top_logprobs": 50}, 400, "invalid_request_error", "top_logprobs"),
    ("unknown model", "POST", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "not_found_error", "model"),
    ("over the context", "POST", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 9000}, 400,
     "invalid_request_error", "messages"),
    ("prompt over the context", "POST", TEXT, {"model": MODEL, "prompt": "word " * 9000, "max_tokens": 1},
     400, "invalid_request_error", "prompt"),
    ("prompt fills the context", "POST", TEXT, {"model": MODEL, "prompt": [1] * 8192, "max_tokens": None},
     400, "invalid_request_error", "prompt"),
    ("completion without prompt", "POST", TEXT, {"model": MODEL}, 400, "invalid_request_error", "prompt"),
    ("token id out of range", "POST", TEXT, {"model": MODEL, "prompt": [1, 2, 10**9]}, 400,
     "invalid_request_error", "prompt"),
    ("two prompts", "POST", TEXT, {"model": MODEL, "prompt": ["a", "b"]}, 400, "invalid_request_error",
     "prompt"),
    ("echo", "POST", TEXT, {"model": MODEL, "prompt": "a", "echo": True}, 400, "invalid_request_error",
     "echo"),
    ("body too large", "POST", CHAT, {"model": MODEL, "messages": [{"role": "user", "content":
                                      "x" * (9 * 1024 * 1024)}]}, 413, "invalid_request_error", None),
    ("unknown route", "POST", "/v1/engines", {}, 404, "not_found_error", None),
    ("wrong method", "GET", CHAT, None, 405, "invalid_request_error", None),
]


@pytest.fixture(scope="module")
def server(server_factory):
    # debug: the worker logs when it holds a first step for requests still arriving
    return server_factory("--engine", "llama", env={"MESH_LLM_LOG_LEVEL": "debug"})


@pytest.mark.parametrize("name,method,path,body,status,etype,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, method, path, body, status, etype, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else ({"json": body} if body is not None else {})
    response = httpx.request(method, server.url + path, timeout=60, **kw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == etype and error["message"]
    if param is not None:
        assert error["param"] == param
    if name in ("malformed json", "body is not utf-8"):
        assert error["code"] == "invalid_json", error
    if name == "empty body":
        assert "empty" in error["message"], error
    assert "Traceback" not in response.text


@pytest.mark.parametrize("path,body,says", [
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 9000},
     "but 9000 tokens were asked for, which leaves no room for the prompt"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 8200}]},
     "tokens, which leaves no room for an answer"),
    (TEXT, {"model": MODEL, "prompt": [1] * 8000, "max_tokens": 500},
     "but the prompt has 8000 tokens and 500 more were asked for"),
], ids=["max_tokens over the context", "chat fills it", "prompt and max_tokens over it"])
def test_a_prompt_over_the_context_is_told_what_does_not_fit(server, path, body, says):
    """The refusal names what went over (once it said "-131 more were asked for" of a long chat
    without ``max_tokens``, and "at least 1 tokens" of a ``max_tokens`` over the context)."""
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("this model's context is 8192 tokens, ") and says in message, message
    assert " -" not in message


def test_a_body_counted_past_the_limit_says_so_as_one_with_a_length_does(server):
    """Sent in chunks (no Content-Length), an over-large body is counted as it comes: the same 413 and
    code as one refused by its header."""
    def chunks():
        yield b'{"pad": "'
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    response = httpx.post(server.url + CHAT, content=chunks(), timeout=60, headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"


def test_still_healthy_after_bad_input(server):
    for _, method, path, body, *_ in CASES:  # all of them again, back to back
        kw = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        httpx.request(method, server.url + path, timeout=60, **kw)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ok = httpx.post(server.url + CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    assert "Traceback" not in server.output()


def test_a_refused_request_is_no_longer_counted_as_arriving(server):
    """Each request counts as arriving from its model's lookup until it is queued, and an idle worker
    holds its first step while any does: one refused on the way (each route, each kind of refusal)
    must stop counting, or every later request would wait the whole hold. These go one at a time, so
    no step here ever has a request to wait for."""
    refused = [(path, body) for _, method, path, body, status, *_ in CASES
               if method == "POST" and status == 400 and isinstance(body, dict) and body.get("model") == MODEL]
    refused.append(("/v1/responses", {"model": MODEL, "input": "word " * 9000, "max_output_tokens": 1}))
    for path, body in refused:
        assert httpx.post(server.url + path, json=body, timeout=60).status_code == 400, (path, body)
    for path, body in [(CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 2}),
                       (TEXT, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
                       ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2})]:
        assert httpx.post(server.url + path, json=body, timeout=60).status_code == 200, path
    output = server.output()
    assert "ms, budget" in output and "first step held" not in output, output[-2000:]
