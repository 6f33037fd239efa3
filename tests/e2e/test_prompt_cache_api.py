"""Prompt-cache reuse as clients see it, through a real `mesh-llm serve` of each engine: the usage's
cached_tokens on a repeat and on the next chat turn, GET /api/cache behind the API key, the
--cache-bytes flag, and cached= in the request log."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from mesh_llm.cli import parse_bytes
from support import serve_errors

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
KEY = "cache-test-key"


@pytest.fixture(scope="module", params=["llama", "mlx"])
def engine(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(engine, server_factory):
    return server_factory("--engine", engine, "--cache-bytes", "256M", "--cache-entries", "8",
                          "--ctx-size", "2048", "--api-key", KEY)


def cache_stats(server, engine: str) -> dict:
    reply = httpx.get(server.url + "/api/cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert reply.status_code == 200
    (entry,) = reply.json()["data"]
    assert (entry["model"], entry["engine"]) == (MODEL, engine)
    return entry


def test_cached_tokens_on_repeat_and_next_turn_and_cache_stats(server, engine):
    assert httpx.get(server.url + "/api/cache", timeout=30).status_code == 401
    start = cache_stats(server, engine)
    assert (start["max_bytes"], start["max_entries"]) == (256 * 2**20, 8)
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
                {"role": "user", "content": "Name the capital of France."}]

    def chat(msgs):
        return client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=24)

    first = chat(messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(messages)
    assert again.choices[0].message.content == first.choices[0].message.content
    # An exact repeat computes one prompt token; llama.cpp two (as one batch: see llama_cache).
    recompute = 2 if engine == "llama" else 1
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - recompute
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And of Italy?"}]
    turn = chat(messages)
    reused = turn.usage.prompt_tokens_details.cached_tokens
    if engine == "llama":  # the answer's KV came from decode steps: computed again
        assert reused == first.usage.prompt_tokens
    else:  # the whole first turn and its answer, as far as the answer re-tokenizes the same
        assert first.usage.prompt_tokens + first.usage.completion_tokens - 1 <= reused < turn.usage.prompt_tokens

    stats = cache_stats(server, engine)
    assert stats["hits"] - start["hits"] == 2 and stats["misses"] - start["misses"] == 1
    assert stats["tokens_reused"] - start["tokens_reused"] == first.usage.prompt_tokens - recompute + reused
    assert 0 < stats["bytes"] <= stats["max_bytes"] and 1 <= stats["entries"] <= 8
    assert re.search(rf"prompt={turn.usage.prompt_tokens} cached={reused} ", server.output())


@pytest.mark.parametrize("text, expected", [("512M", 512 * 2**20), ("2G", 2 * 2**30), ("0", 0),
                                            ("1.5g", 3 * 2**29), ("64KiB", 65536), ("1000", 1000)])
def test_cache_bytes_sizes(text, expected):
    assert parse_bytes(text) == expected


def test_a_bad_cache_size_is_one_error_line():
    assert serve_errors("--cache-bytes", "lots") == [
        "error: --cache-bytes must be a byte count such as 512M, 2G or 0, not 'lots'"]
