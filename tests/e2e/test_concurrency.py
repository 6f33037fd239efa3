"""Many clients at once: outputs never mix, a client that leaves frees the worker, a full queue says
429, and the health and model routes answer during a long generation."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Describe the moon briefly.",
           "What color is the sky?", "Name a planet.", "Write a haiku about rain.", "What is a cat?"]


def streamed(client: OpenAI, prompt: str) -> str:
    stream = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=32, stream=True,
                                            messages=[{"role": "user", "content": prompt}])
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_concurrent_streams_match_solo_runs(engine_server):
    client = OpenAI(base_url=engine_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    alone = [streamed(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: streamed(client, p), PROMPTS))
    assert together == alone
    assert len(set(alone)) == len(alone)  # different prompts, different answers: a mix-up would show


def test_disconnect_frees_the_worker(server_factory):
    server = server_factory("--engine", "llama", "--alias", "leaver")
    body = {"model": "leaver", "prompt": "Once upon a time", "max_tokens": 4000, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
        received = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received += 1
            if received >= 5:
                break  # leave mid-stream: the connection closes
    short = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "leaver", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert short.status_code == 200
    # the abandoned generation stopped long before its 4000 tokens
    deadline = time.monotonic() + 30
    while "finish=cancelled" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.2)
    match = re.search(r"completion=(\d+) .*finish=cancelled", server.output())
    assert match, server.output()
    assert int(match.group(1)) < 400


def test_full_queue_answers_429_with_retry_after(server_factory):
    server = server_factory("--engine", "llama", "--max-batch", "1", "--max-queue", "1")
    results: dict[str, int] = {}

    def run(name: str):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
            results[name] = r.status_code
            for _ in r.iter_lines():
                pass

    running = threading.Thread(target=run, args=("running",))
    running.start()
    time.sleep(0.5)
    while "running" not in results:
        time.sleep(0.05)
    waiting = threading.Thread(target=run, args=("waiting",))
    waiting.start()
    time.sleep(1.0)  # the second request is now in the one-place queue
    refused = httpx.post(server.url + "/v1/completions", timeout=60,
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    # health and the model list answer while the generation runs
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert httpx.get(server.url + "/v1/models", timeout=5).json()["data"][0]["id"] == MODEL
    running.join()
    waiting.join()
    assert results == {"running": 200, "waiting": 200}


def test_api_key_is_required_when_configured(server_factory):
    server = server_factory("--engine", "llama", env={"MESH_LLM_API_KEY": "s3cret"})
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    post = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert post.status_code == 401  # auth is checked before the body
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/openapi.json").status_code == 401  # every route but /health needs it
    client = OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
    assert client.models.list().data[0].id == MODEL
