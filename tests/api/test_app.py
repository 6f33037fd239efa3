"""The OpenAI API over the scripted engine, in-process: shapes, streaming, errors, auth, the queue's
limit and a client that leaves. What the real engines add is tested in tests/e2e/."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from in_process import MODEL, serve_fake

MESSAGES = [{"role": "user", "content": "Say something."}]


def openai_client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]


def test_a_chat_completion_with_the_official_client(fake_server):
    reply = openai_client(fake_server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and len(choice.message.content) == 7  # one letter a token
    assert reply.usage.completion_tokens == 7 and reply.usage.prompt_tokens > 0


def test_a_stream_arrives_token_by_token_and_ends_with_usage(fake_server):
    stream = openai_client(fake_server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 12 and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_the_same_greedy_request_gets_the_same_answer_alone_or_beside_others(fake_server):
    client = openai_client(fake_server)
    alone = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: client.chat.completions.create(
            model=MODEL, messages=MESSAGES if i % 2 else [{"role": "user", "content": f"Other {i}"}],
            max_tokens=20, temperature=0), range(6)))
    assert all(r.choices[0].message.content == alone.choices[0].message.content for r in replies[1::2])


@pytest.mark.parametrize("body,status,param", [
    (b'{"model": "fake", "messages": [', 400, None),
    ({"model": 7, "messages": MESSAGES}, 400, "model"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"model": "nope", "messages": MESSAGES}, 404, "model"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 100_000}, 400, "messages"),  # past the context
])
def test_bad_requests_get_openai_error_bodies(client, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = client.post("/v1/chat/completions", **kwargs)
    error = response.json()["error"]
    assert response.status_code == status and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert client.get("/health").status_code == 200


def test_an_api_key_guards_every_v1_route():
    with serve_fake(api_key="sesame") as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, api_key="wrong").models.list()
        assert [m.id for m in openai_client(server, api_key="sesame").models.list()] == [MODEL]
        assert httpx.get(server.url + "/health").status_code == 200  # for load balancers


def test_the_key_is_checked_before_the_body_is_read():
    """A client without the key is refused from its headers: a 4 MB body it has not sent yet is not
    waited for, and malformed JSON gets 401, not 400 (no parsing for strangers)."""
    with serve_fake(api_key="sesame") as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 4000000\r\n\r\n")
            answer = conn.recv(65536).decode("latin-1")  # would time out if the body were awaited
        assert answer.startswith("HTTP/1.1 401"), answer
        assert '"invalid_api_key"' in answer
        bad = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        right = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                           headers={"content-type": "application/json", "authorization": "Bearer sesame"})
        assert right.status_code == 400


def test_a_full_queue_answers_429_with_retry_after():
    with serve_fake(lambda: FakeEngine(max_batch=1, step_s=0.01), max_queue=1) as server:
        client = openai_client(server)
        running = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, stream=True)
        next(iter(running))  # it holds the only slot
        waiting = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, stream=True)
        response = httpx.post(server.url + "/v1/chat/completions",
                              json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"]
        running.close()
        assert "".join(c.choices[0].delta.content or "" for c in waiting if c.choices)


def test_a_client_that_leaves_mid_stream_frees_its_sequence_at_once():
    with serve_fake(lambda: FakeEngine(step_s=0.01)) as server:
        worker = server.workers[0]
        stream = openai_client(server).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3000, stream=True)
        for _ in zip(range(3), stream):
            pass
        assert worker.load()["active"] == 1
        stream.close()
        deadline = time.monotonic() + 5
        while worker.load()["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.load()["active"] == 0


def test_the_openapi_document_declares_every_error_with_its_body(client):
    schema = client.get("/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"]) and "HTTPValidationError" not in json.dumps(schema)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503", "504"}, path
        for status, response in responses.items():
            if status != "200":
                assert response["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorBody"}
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert set(schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404"}
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/v1/responses", "ResponsesRequest")):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
    refs = {ref.rsplit("/", 1)[1] for ref in _refs(schema)}
    assert refs <= set(schema["components"]["schemas"]), refs - set(schema["components"]["schemas"])
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["required"]


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == "$ref" else _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_a_list_of_bad_items_costs_the_first_bad_items_errors_not_one_per_item():
    from pydantic import ValidationError

    from mesh_llm.api.schemas import ChatCompletionRequest
    counts = []
    for n in (1, 60_000):
        with pytest.raises(ValidationError) as caught:
            ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
                {"role": "user", "content": [{"type": "image"}]}] * n})
        counts.append(caught.value.error_count())
    assert counts[0] == counts[1] <= 3, counts  # the union's str branch, then the first bad part's fields


def test_a_costly_body_is_parsed_beside_running_streams_not_in_their_way(client, fake_server):
    """100,000 short messages (3.4 MB, a valid shape) take the parser about a second here; parsed on
    the event loop (as FastAPI does) they held every stream's next token that long. In a thread, a
    running stream's longest gap must stay well under what the same parse costs inline."""
    from mesh_llm.api.schemas import ChatCompletionRequest
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 100_000,
                       "max_tokens": 1}).encode()
    started = time.perf_counter()
    ChatCompletionRequest.model_validate(json.loads(body))
    inline = time.perf_counter() - started
    gaps: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        def stream() -> None:
            request = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
            with httpx.stream("POST", fake_server.url + "/v1/completions", json=request, timeout=60) as r:
                last = None
                for _ in r.iter_lines():
                    now = time.perf_counter()
                    gaps.append(now - last) if last is not None else None
                    last = now
                    if len(gaps) > 20 and costly.done():
                        break
        costly = concurrent.futures.Future()
        streaming = pool.submit(stream)
        while len(gaps) < 20:
            time.sleep(0.01)
        before = len(gaps)
        response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        costly.set_result(response)
        streaming.result(timeout=60)
    assert response.status_code in (200, 400), response.text
    during = max(gaps[before:])
    assert during < 0.5 * inline, (during, inline)


def test_a_request_timeout_ends_a_stream_with_an_error_event_and_frees_its_slot():
    with serve_fake(lambda: FakeEngine(step_s=0.01), request_timeout=1.0) as server:
        quick = openai_client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
        assert quick.choices[0].finish_reason in ("stop", "length")
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "request_timeout" and "1 s" in error["message"], error
        assert len(events) > 10  # it streamed before it was ended
        assert server.workers[0].load()["active"] == 0


def test_a_request_timeout_ends_running_and_waiting_requests_with_a_504():
    """One engine step longer than the timeout: after it, the request that ran and the one that
    waited for its slot are both past their time."""
    with serve_fake(lambda: FakeEngine(max_batch=1, step_s=1.5), request_timeout=1.0) as server:
        ask = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=ask, timeout=30)
            while not server.workers[0].load()["active"]:
                time.sleep(0.01)
            waiting = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=ask, timeout=30)
            answers = [running.result(), waiting.result()]
        for answer in answers:
            assert answer.status_code == 504, answer.text
            error = answer.json()["error"]
            assert error["code"] == "request_timeout" and error["type"] == "server_error", error
        assert server.workers[0].load() == {"active": 0, "waiting": 0, "max_batch": 1}


def test_a_request_without_a_model_gets_the_one_model_served():
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with serve_fake() as server:
        reply = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10)
        assert reply.status_code == 200 and reply.json()["model"] == MODEL
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert reply.status_code == 200 and reply.json()["model"] == MODEL
        reply = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 3}, timeout=10)
        assert reply.status_code == 200 and reply.json()["model"] == MODEL
    with serve_fake(aliases=("other",)) as server:
        reply = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10)
        assert reply.status_code == 400
        assert reply.json()["error"] == {"message": f"name a model: this server serves {MODEL}, other",
                                         "type": "invalid_request_error", "param": "model",
                                         "code": "missing_required_parameter"}


def test_browser_pages_on_this_machine_may_call_the_api_and_other_origins_may_not():
    from mesh_llm.serve import with_cors

    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with serve_fake(api_key="sesame", wrap=lambda app: with_cors(app, None)) as server:
        url = server.url + "/v1/chat/completions"
        for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:8080"):
            # the preflight carries no key: it is answered before the key is asked for
            reply = httpx.options(url, headers={"origin": origin, **preflight}, timeout=10)
            assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin
            assert "authorization" in reply.headers["access-control-allow-headers"].lower()
            assert "access-control-allow-credentials" not in reply.headers
        reply = httpx.post(url, json=chat, timeout=10, headers={"origin": "http://localhost:3000",
                                                                 "authorization": "Bearer sesame"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "http://localhost:3000"
        for origin in ("https://evil.example", "http://localhost.evil.example", "http://192.168.1.5:3000"):
            reply = httpx.options(url, headers={"origin": origin, **preflight}, timeout=10)
            assert reply.status_code == 400 and "access-control-allow-origin" not in reply.headers
        reply = httpx.post(url, json=chat, timeout=10, headers={"origin": "https://evil.example"})
        assert reply.status_code == 401 and "access-control-allow-origin" not in reply.headers
    with serve_fake(wrap=lambda app: with_cors(app, ["*"])) as server:
        reply = httpx.options(server.url + "/v1/models", headers={"origin": "https://any.example", **preflight})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in reply.headers
    with serve_fake(wrap=lambda app: with_cors(app, [])) as server:  # --no-cors
        reply = httpx.options(server.url + "/v1/models", headers={"origin": "http://localhost:3000", **preflight})
        assert "access-control-allow-origin" not in reply.headers
