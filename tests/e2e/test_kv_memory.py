"""--kv-memory through a real `mesh-llm serve` of each engine: the context is fitted to it, and
requests that outgrow it together are preempted and resumed, never failed; a bad size is one error
line."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from support import serve_errors

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

MODEL = "SmolLM2-135M-Instruct"
KEY = "kv-test-key"
# The embedded model's KV: 23 KB a token on the llama engine (float16 cells), 46 KB on MLX (float32
# on this CPU) counted twice. 24 MB hold about 1,000 llama.cpp cells; 96 MB four 256-token steps of
# one MLX sequence, so two sequences that start with 250-token prompts (each given room for 256
# answer tokens) outgrow it once the first passes 512 tokens.
MEMORY = {"llama": "24M", "mlx": "96M"}
ANSWER = {"llama": 300, "mlx": 280}


@pytest.fixture(scope="module", params=["llama", "mlx"])
def engine(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(engine, server_factory):
    # three at once: by default as many as hold 2,048 tokens each, one here
    return server_factory("--engine", engine, "--kv-memory", MEMORY[engine], "--max-batch", "3",
                          "--api-key", KEY, "--cache-bytes", "0")


def test_requests_that_outgrow_the_kv_memory_are_preempted_not_failed(server, engine):
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    (model,) = client.models.list().data
    assert model.context_length < 8192  # the model's own, fitted to the memory given
    story = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 15

    def complete(i: int):
        return client.completions.create(model=MODEL, prompt=f"Story {i}: {story}", max_tokens=ANSWER[engine],
                                         temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(complete, range(3)))
    for reply in replies:
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == ANSWER[engine]
        assert 200 < reply.usage.prompt_tokens < 256
    stats = httpx.get(server.url + "/api/cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    (entry,) = stats.json()["data"]
    assert entry["kv_preemptions"] > 0
    assert "preempted" in server.output()


def test_a_bad_kv_memory_is_one_error_line():
    assert serve_errors("--kv-memory", "0") == [
        "error: --kv-memory must be a byte count such as 512M or 2G, not '0'"]
